// What the kernels can address, and how the operator makes every other input addressable.
//
// Both kernel families move q, k, v and out in 16-byte vectors (cp.async, ldmatrix, TMA, 16-byte
// stores): the base pointer and every stride they step over must be 16-byte multiples and the
// last dimension contiguous. A tensor that breaks this (a view such as b[..., 4:132], rows of
// 132 elements, a transposed last dimension) would fault with a misaligned address, which kills
// the CUDA context of the whole process; the kernel cannot see it, so the operator decides here,
// before any launch:
//   - q, k, v that the kernels cannot load are copied into a fresh contiguous (aligned) tensor:
//     one device copy of that tensor per call, on the call's stream;
//   - an `out` the kernels cannot store to, or one whose memory overlaps q, k or v (out=q, a
//     slice of a packed qkv buffer), receives the result through a fresh tensor and one copy;
//   - an `out` whose elements overlap each other (an expanded tensor) is refused.
// The aligned common case costs a few integer tests per tensor and no reference counting
// (c10::MaybeOwned borrows the caller's tensor).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/MaybeOwned.h>

#include <array>
#include <cstdint>
#include <utility>

namespace flash::binding {

constexpr int64_t kVectorBytes = 16;

// Why the kernels cannot address t in place, or nullptr when they can. A dimension of size 1 is
// never stepped over, so its stride does not matter; a stride of 0 (an expanded dimension) reads
// the same elements again, which loads allow.
inline const char* unaddressable(const at::Tensor& t) {
    const int64_t last = t.dim() - 1;
    if (t.size(last) > 1 && t.stride(last) != 1)
        return "its last dimension is not contiguous";
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % kVectorBytes != 0)
        return "its data does not start on a 16-byte boundary";
    for (int64_t d = 0; d < last; ++d)
        if (t.size(d) > 1 && (t.stride(d) * t.element_size()) % kVectorBytes != 0)
            return "a stride is not a multiple of 16 bytes";
    return nullptr;
}

// A contiguous copy of t in a fresh allocation (aligned, whatever t's offset).
inline c10::MaybeOwned<at::Tensor> fresh_copy(const at::Tensor& t) {
    at::Tensor copy = at::empty(t.sizes(), t.options());
    copy.copy_(t);
    return c10::MaybeOwned<at::Tensor>::owned(std::move(copy));
}

// t as the kernels can load it: t itself (borrowed), or a contiguous copy.
inline c10::MaybeOwned<at::Tensor> addressable(const at::Tensor& t) {
    if (unaddressable(t) == nullptr)
        return c10::MaybeOwned<at::Tensor>::borrowed(t);
    return fresh_copy(t);
}

// The bytes [begin, end) that t's elements lie in (strides are never negative in torch).
struct ByteSpan {
    uintptr_t begin = 0, end = 0;
};

inline ByteSpan byte_span(const at::Tensor& t) {
    if (t.numel() == 0)
        return {};
    int64_t last_offset = 0;
    for (int64_t d = 0; d < t.dim(); ++d)
        last_offset += (t.size(d) - 1) * t.stride(d);
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    return {begin, begin + uintptr_t((last_offset + 1) * t.element_size())};
}

inline bool spans_overlap(const at::Tensor& a, const at::Tensor& b) {
    const ByteSpan x = byte_span(a), y = byte_span(b);
    return x.begin < x.end && y.begin < y.end && x.begin < y.end && y.begin < x.end;
}

// Whether distinct indices of t address distinct elements. Sufficient test: with the dimensions
// of size > 1 ordered by stride, each stride exceeds the furthest offset the smaller ones reach
// (true of every contiguous tensor, transpose, slice and packed view; an expanded dimension, a
// stride of 0, fails it).
inline bool elements_distinct(const at::Tensor& t) {
    std::array<std::pair<int64_t, int64_t>, 8> dims{};  // (stride, size) of dims of size > 1
    size_t n = 0;
    for (int64_t d = 0; d < t.dim() && n < dims.size(); ++d)
        if (t.size(d) > 1)
            dims[n++] = {t.stride(d), t.size(d)};
    for (size_t i = 1; i < n; ++i)  // insertion sort: at most a few dimensions
        for (size_t j = i; j > 0 && dims[j] < dims[j - 1]; --j)
            std::swap(dims[j], dims[j - 1]);
    int64_t reach = 0;  // the largest offset the dimensions so far address
    for (size_t i = 0; i < n; ++i) {
        if (dims[i].first <= reach)
            return false;
        reach += dims[i].first * (dims[i].second - 1);
    }
    return true;
}

}  // namespace flash::binding
