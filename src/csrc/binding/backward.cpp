// The backward operator, in its own translation unit:
//   flash_attention::bwd(dout, q, k, v, out, lse, dlse?, cu_seqlens_q?, cu_seqlens_k?,
//       max_seqlen_q, max_seqlen_k, softmax_scale?, causal, window_left, window_right, softcap,
//       deterministic, kernel) -> (dq, dk, dv)
//   flash_attention::bwd_accumulate(dout, q, k, v, out, lse, cu_seqlens_q?, cu_seqlens_k?,
//       max_seqlen_q, max_seqlen_k, softmax_scale?, causal, window_left, window_right, softcap,
//       deterministic, dq_sum!, dk_sum!, dv_sum!, kernel) -> ()   the same gradients added into
//       fp32 tensors shaped like q, k, v (ring attention's per-block partials, no 16-bit
//       rounding per block)
//   flash_attention::bwd_kernels() -> str     the backward kernels of this build, comma-separated
//   flash_attention::bwd_explain(dout, q, k, v, varlen, softcap) -> str   what a call's backward
//       runs, and why not the Hopper kernel (debug logging, as the forward's explain())
// Shaped like the forward: the checks (validation.h: check_backward), the choice (dispatch.h:
// the named kernel, or the backward table's row for (dtype, d_head variant, softcap), which
// flash_attention.backward computes from the backward kinds' rows), the run (backward_launch.h:
// layout, buffers, parameters, launch). The fake implementation and the autograd formula of
// flash_attention::attention that calls it are in flash_attention/backward.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "backward_launch.h"
#include "dispatch.h"
#include "kernel_registry.h"
#include "validation.h"

namespace {

using namespace flash::binding;

std::string bwd_kernels() {
    std::string out;
    for (const flash::BwdKernelEntry* e : registry_entries<flash::BwdKernelEntry>())
        out += (out.empty() ? "" : ",") + std::string(e->name);
    return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal,
    int64_t window_left, int64_t window_right, double softcap, bool deterministic,
    c10::string_view kernel) {
    const Varlen vl = varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    const BackwardCall call = check_backward(dout, q, k, v, out, lse, dlse, vl, softmax_scale,
                                             causal, window_left, window_right, softcap);
    const Choice<flash::BwdKernelEntry> chosen = choose_kernel<flash::BwdKernelEntry>(
        kernel, call.dtype, call.shape.d_head, 1, false, false, softcap > 0, "backward ");
    if (!kernel.empty())
        check_backward_kernel(*chosen.kernel, call);
    return run_backward(call, chosen, dout, q, k, v, out, lse, dlse, vl, deterministic,
                        !kernel.empty());
}

// An fp32 tensor shaped like `like` on its device that the kernels can add into: 8-byte
// aligned, even strides, the last dimension contiguous (the kernels add pairs of floats).
void check_grad_sum(const at::Tensor& t, const char* name, const at::Tensor& like,
                    const char* like_name) {
    FA_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32 (the sum the gradients ",
                  "are added into), got ", t.scalar_type());
    FA_CHECK_VALUE(t.sizes() == like.sizes(), name, " must have the shape of ", like_name, " ",
                   like.sizes(), ", got ", t.sizes());
    FA_CHECK_VALUE(t.device() == like.device(), name, " must be on the device of ", like_name, " (",
                   like.device(), "), got ", t.device());
    bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 8 == 0 && t.stride(-1) == 1;
    for (int64_t d = 0; d + 1 < t.dim(); ++d)
        aligned = aligned && (t.size(d) <= 1 || t.stride(d) % 2 == 0);
    FA_CHECK_VALUE(aligned, name, " must have a contiguous last dimension, even strides and an ",
                   "8-byte aligned start (strides ", t.strides(), ")");
}

void bwd_accumulate_cuda(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                         const std::optional<at::Tensor>& cu_seqlens_q,
                         const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                         int64_t max_seqlen_k, std::optional<double> softmax_scale, bool causal,
                         int64_t window_left, int64_t window_right, double softcap,
                         bool deterministic, const at::Tensor& dq_sum, const at::Tensor& dk_sum,
                         const at::Tensor& dv_sum, c10::string_view kernel) {
    const Varlen vl = varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    const BackwardCall call =
        check_backward(dout, q, k, v, out, lse, std::nullopt, vl, softmax_scale, causal,
                       window_left, window_right, softcap);
    check_grad_sum(dq_sum, "dq_sum", q, "q");
    check_grad_sum(dk_sum, "dk_sum", k, "k");
    check_grad_sum(dv_sum, "dv_sum", v, "v");
    const Choice<flash::BwdKernelEntry> chosen = choose_kernel<flash::BwdKernelEntry>(
        kernel, call.dtype, call.shape.d_head, 1, false, false, softcap > 0, "backward ");
    if (!kernel.empty())
        check_backward_kernel(*chosen.kernel, call);
    const GradSums sums{dq_sum, dk_sum, dv_sum};
    run_backward(call, chosen, dout, q, k, v, out, lse, std::nullopt, vl, deterministic,
                 !kernel.empty(), &sums);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flash_attention, m) {
    m.def(
        "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
        "float? softmax_scale, bool causal, int window_left, int window_right, float softcap, "
        "bool deterministic, str kernel) -> (Tensor dq, Tensor dk, Tensor dv)");
    m.def(
        "bwd_accumulate(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
        "float? softmax_scale, bool causal, int window_left, int window_right, float softcap, "
        "bool deterministic, Tensor(a!) dq_sum, Tensor(b!) dk_sum, Tensor(c!) dv_sum, "
        "str kernel) -> ()");
    m.def("bwd_kernels() -> str", &bwd_kernels);
    m.def(
        "bwd_explain(Tensor dout, Tensor q, Tensor k, Tensor v, bool varlen, bool softcap) -> str",
        &explain_backward);
}

TORCH_LIBRARY_IMPL(flash_attention, CUDA, m) {
    m.impl("bwd", &bwd_cuda);
    m.impl("bwd_accumulate", &bwd_accumulate_cuda);
}
