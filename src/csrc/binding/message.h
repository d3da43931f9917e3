// Error messages of the binding, built here: numbers with std::to_string, and handed to
// TORCH_CHECK as one string. Formatting a number through an ostream (what TORCH_CHECK does with
// its arguments) crashed inside this extension in a torch 2.11 process on the GPU machine, while
// strings were fine. FA_CHECK* take TORCH_CHECK*'s arguments and are evaluated only on failure;
// they raise the Python exception a user expects: TypeError for a wrong type or dtype
// (FA_CHECK_TYPE), ValueError for a wrong shape or value (FA_CHECK_VALUE).
#pragma once

#include <torch/extension.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace flash::binding {

inline void append(std::string& out, const char* s) {
    out += s;
}
inline void append(std::string& out, const std::string& s) {
    out += s;
}
inline void append(std::string& out, c10::string_view s) {
    out.append(s.data(), s.size());
}
inline void append(std::string& out, at::ScalarType t) {
    out += c10::toString(t);
}
inline void append(std::string& out, const c10::Device& d) {
    out += d.str();
}
inline void append(std::string& out, double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    out += buf;
}
// Numbers only: a bool or char argument does not compile (no overload prints them).
template <typename T,
          typename = std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                      !std::is_same_v<T, char>>>
inline void append(std::string& out, T v) {
    out += std::to_string(v);
}
inline void append(std::string& out, at::IntArrayRef sizes) {
    out += '[';
    for (size_t i = 0; i < sizes.size(); ++i)
        out += (i ? ", " : "") + std::to_string(sizes[i]);
    out += ']';
}

template <typename... Args>
inline std::string message(const Args&... args) {
    std::string out;
    (append(out, args), ...);
    return out;
}

}  // namespace flash::binding

#define FA_CHECK(cond, ...) TORCH_CHECK(cond, ::flash::binding::message(__VA_ARGS__))
#define FA_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, ::flash::binding::message(__VA_ARGS__))
#define FA_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::flash::binding::message(__VA_ARGS__))
