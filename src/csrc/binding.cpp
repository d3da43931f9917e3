// The forward's translation unit: it registers the operators
//   flash_attention::attention(q, k, v, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q,
//       max_seqlen_k, softmax_scale?, causal, window_left, window_right, softcap, return_lse,
//       kernel) -> (out, lse)         the whole call, fixed-length or varlen (the fast path)
//   flash_attention::fwd(q, k, v, out!, lse!?, kernel, softmax_scale, window_left,
//       window_right, softcap) -> ()  into a given out
//   flash_attention::attention_fp8(q, k, v, cu_seqlens_q?, cu_seqlens_k?, max_seqlen_q,
//       max_seqlen_k, q_descale?, k_descale?, v_descale?, softmax_scale?,
//       causal, window_left, window_right, softcap, return_lse, kernel) -> (out, lse)
//                                     float8_e4m3fn q, k, v (Hopper), out bf16; forward only
// (CUDA kernels here; fake implementations for tracing in flash_attention/ops.py) and the
// module functions flash_attention reads: the kernels of this build, the dispatch table it
// computes once per process, what a call would run and copy, and the KV-cache status word. The
// backward's and the decode's operators are binding/backward.cpp and binding/decode.cpp. The
// forward's work is in binding/, one header per job:
//   message.h            error messages (FA_CHECK*)
//   kernel_registry.h    the build's kernels of each direction, by name
//   params.h             the kernels' parameters of a checked call (both directions)
//   device_properties.h  cudaDeviceProp per device
//   dispatch.h           the dispatch tables, the kernel for a call, the Hopper fallback
//   validation.h         input, cu_seqlens and per-kernel checks (no call launches on bad input)
//   input_layout.h       what the kernels can address, and copies of what they cannot
//   launch.h             run_forward(): checks, layout, kernel arguments, launch; explain()
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "binding/decode.h"
#include "binding/dispatch.h"
#include "binding/kernel_registry.h"
#include "binding/launch.h"
#include "binding/message.h"
#include "binding/validation.h"

namespace {

using namespace flash::binding;

// The kernels of a direction ("fwd" or "bwd"), in build order, with what Python reads of them.
py::list list_kernels(const std::string& direction) {
    FA_CHECK_VALUE(direction == "fwd" || direction == "bwd" || direction == "dec",
                   "kernels: direction must be fwd, bwd or dec, got ", direction);
    py::list out;
    const auto add = [&out](const auto& e) {
        py::dict d;
        d["name"] = e.name;
        d["dtype"] = dtype_name(e.dtype);
        d["cache_dtype"] = dtype_name(e.cache_dtype);
        d["d_head"] = e.d_head;
        d["block_r"] = e.block_r;
        d["block_c"] = e.block_c;
        d["threads"] = e.threads;
        d["smem_bytes"] = e.smem_bytes;
        d["mask"] = e.mask;
        d["softcap"] = e.softcap;
        d["arch"] = e.arch;
        out.append(d);
    };
    if (direction == "fwd")
        for (const flash::FwdKernelEntry* e : registry_entries<flash::FwdKernelEntry>())
            add(*e);
    else if (direction == "bwd")
        for (const flash::BwdKernelEntry* e : registry_entries<flash::BwdKernelEntry>())
            add(*e);
    else
        for (const flash::DecKernelEntry* e : registry_entries<flash::DecKernelEntry>())
            add(*e);
    return out;
}

// flash_attention::fwd: fixed-length batches into a given out (and lse).
void fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
              const std::optional<at::Tensor>& lse, c10::string_view name, double softmax_scale,
              int64_t window_left, int64_t window_right, double softcap) {
    run_forward(q, k, v, out, /*out_is_fresh=*/false, lse, Varlen{}, name, softmax_scale,
                window_left, window_right, softcap);
}

// The whole forward call in C++ (defaults, window, allocation, checks, dispatch, launch), so the
// Python functions above it are a single operator call. Returns out (q's dtype; bf16 for FP8)
// and lse, empty unless return_lse. fp8: float8_e4m3fn q, k, v with their descales.
std::tuple<at::Tensor, at::Tensor> forward_call(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Varlen& vl,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, bool return_lse, c10::string_view kernel, const Descales* fp8 = nullptr) {
    const bool varlen = vl.cu_q != nullptr;
    check_rank(q, "q", varlen ? 3 : 4,
               varlen ? "(total_tokens, heads, d_head)" : "(batch, seq, heads, d_head)");
    const int64_t D = q.size(-1);
    const int64_t Sq = varlen ? vl.max_q : q.size(1);
    const int64_t Sk = varlen ? vl.max_k : (k.dim() == 4 ? k.size(1) : 0);
    const double scale = softmax_scale ? *softmax_scale : 1.0 / std::sqrt(double(D > 0 ? D : 1));
    FA_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                   "window_size sides must be -1 (unbounded) or >= 0, got (", window_left, ", ",
                   window_right, ")");
    const auto [left, right] = canonical_window(causal, window_left, window_right, Sq, Sk);
    at::Tensor out = at::empty(q.sizes(), fp8 ? q.options().dtype(at::kBFloat16) : q.options());
    at::Tensor lse;
    if (return_lse) {
        const auto lse_shape = varlen ? std::vector<int64_t>{q.size(1), q.size(0)}
                                      : std::vector<int64_t>{q.size(0), q.size(2), q.size(1)};
        lse = at::empty(lse_shape, q.options().dtype(at::kFloat));
    } else {
        lse = at::empty({0}, q.options().dtype(at::kFloat));
    }
    run_forward(q, k, v, out, /*out_is_fresh=*/true,
                return_lse ? std::optional<at::Tensor>(lse) : std::nullopt, vl, kernel, scale, left,
                right, softcap, fp8);
    return {out, lse};
}

// flash_attention::attention: fixed-length, or varlen with cu_seqlens_q/k.
std::tuple<at::Tensor, at::Tensor> attention_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, bool return_lse,
    c10::string_view kernel) {
    return forward_call(
        q, k, v, varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), softmax_scale,
        causal, window_left, window_right, softcap, return_lse, kernel);
}

// flash_attention::attention_fp8: a float8_e4m3fn call (q, k, v; fixed-length, or varlen with
// cu_seqlens_q/k) on a Hopper FP8 kernel with per-(batch, KV head) fp32 descales (varlen: per
// sequence); out is bf16, lse as attention's.
std::tuple<at::Tensor, at::Tensor> attention_fp8_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale,
    std::optional<double> softmax_scale, bool causal, int64_t window_left, int64_t window_right,
    double softcap, bool return_lse, c10::string_view kernel) {
    const Descales descales{q_descale, k_descale, v_descale};
    return forward_call(
        q, k, v, varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), softmax_scale,
        causal, window_left, window_right, softcap, return_lse, kernel, &descales);
}

}  // namespace

TORCH_LIBRARY(flash_attention, m) {
    m.def(
        "fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!)? lse, str kernel, "
        "float softmax_scale, int window_left, int window_right, float softcap) -> ()");
    m.def(
        "attention(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, float? softmax_scale, bool causal, "
        "int window_left, int window_right, float softcap, bool return_lse, str kernel) "
        "-> (Tensor, Tensor)");
    m.def(
        "attention_fp8(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, Tensor? q_descale, Tensor? k_descale, "
        "Tensor? v_descale, float? softmax_scale, bool causal, int window_left, int window_right, "
        "float softcap, bool return_lse, str kernel) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) {
    m.impl("fwd", &fwd_cuda);
    m.impl("attention", &attention_cuda);
    m.impl("attention_fp8", &attention_fp8_cuda);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() =
        "FlashAttention forward, backward and KV-cache decoding, sm80 and Hopper families; API: "
        "flash_attention";
    m.def("kernels", &list_kernels, "the kernels of a direction (fwd, bwd, dec) in build order",
          py::arg("direction") = "fwd");
    m.def(
        "set_dispatch", &flash::binding::set_dispatch,
        "replace a direction's (fwd, bwd, dec) dispatch table: rows (dtype, d_head, bucket, mask, "
        "local, softcap, kernel, fallback, varlen kernel; '' for none)");
    m.def("layout_report", &flash::binding::layout_report,
          "how the operator addresses q, k, v (and out): '' in place, else why it copies",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out") = py::none());
    m.def("kvcache_status", &flash::binding::kvcache_status,
          "the KV-cache status word of a device (error bits of bad cache metadata met by the "
          "decode kernels; a synchronous read), cleared when asked",
          py::arg("device"), py::arg("clear") = true);
    m.def("explain", &flash::binding::explain,
          "the kernel a fixed-length call runs, and why not a Hopper one");
    m.def("explain_varlen", &flash::binding::explain_varlen,
          "the kernel a varlen call runs (max_seqlen_q its bucket), and why not a Hopper one",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("max_seqlen_q"), py::arg("window_left"),
          py::arg("window_right"), py::arg("softcap"));
    m.def("choice", &flash::binding::choice, "the dispatch table's kernel for a call ('' if none)",
          py::arg("dtype"), py::arg("d_head"), py::arg("seqlen_q"), py::arg("mask"),
          py::arg("softcap"), py::arg("local") = false);
}
