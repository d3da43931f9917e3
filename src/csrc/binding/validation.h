// Checks of a call's inputs, before any launch: ranks, dtypes and shapes of q, k, v, out and
// lse, the scalar arguments and the window, what the chosen kernel serves, and the cu_seqlens
// of a varlen batch (their metadata and, on the host, their values), for the forward's and the
// backward's operators. Any strides are accepted: what the kernels cannot address is copied
// (input_layout.h). Mirrors flash_attention.validation, which raises the same errors from
// Python (and under tracing).
#pragma once

#include <torch/extension.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../registry.h"
#include "input_layout.h"
#include "message.h"

namespace flash::binding {

// Any strides are accepted: what the kernels cannot address is copied (binding/input_layout.h).
inline void check_rank(const at::Tensor& t, const char* name, int64_t rank, const char* dims) {
    FA_CHECK_VALUE(t.dim() == rank, name, " must be ", rank, "-D ", dims, ", got ", t.dim(), "-D");
}

// q (B, Sq, H, D) or varlen (total_q, H, D); the element type of q, k, v (and out).
// fp8: the call may take torch.float8_e4m3fn tensors (the FP8 forward, attention_fp8).
inline at::ScalarType check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                bool varlen, bool fp8 = false) {
    const int64_t rank = varlen ? 3 : 4;
    const char* dims = varlen ? "(total_tokens, heads, d_head)" : "(batch, seq, heads, d_head)";
    check_rank(q, "q", rank, dims);
    check_rank(k, "k", rank, dims);
    check_rank(v, "v", rank, dims);
    const auto dtype = q.scalar_type();
    FA_CHECK_TYPE(fp8 || dtype != at::kFloat8_e4m3fn,
                  "float8_e4m3fn inputs run the forward alone (flash_attn_func or "
                  "flash_attn_varlen_func with q_descale/k_descale/v_descale, or attention_fp8): "
                  "no backward or KV cache path takes them");
    FA_CHECK_TYPE(fp8 ? dtype == at::kFloat8_e4m3fn : dtype == at::kHalf || dtype == at::kBFloat16,
                  "q has dtype ", dtype,
                  "; supported: ", fp8 ? "torch.float8_e4m3fn" : "torch.float16, torch.bfloat16");
    FA_CHECK_TYPE(k.scalar_type() == dtype && v.scalar_type() == dtype,
                  "q, k and v must share a dtype");
    FA_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape, got ", k.sizes(),
                   " and ", v.sizes());
    const int64_t D = q.size(rank - 1), H = q.size(rank - 2), Hk = k.size(rank - 2);
    FA_CHECK_VALUE(D > 0 && D % 8 == 0 && D <= 256, "d_head=", D,
                   " is not supported; supported: every multiple of 8 up to 256");
    FA_CHECK_VALUE(k.size(rank - 1) == D, "d_head of k/v (", k.size(rank - 1),
                   ") differs from d_head of q (", D, ")");
    FA_CHECK_VALUE((Hk == 0 && H == 0) || (Hk > 0 && H % Hk == 0), "heads of q (", H,
                   ") must be a multiple of heads of k/v (", Hk, ")");
    if (!varlen)
        FA_CHECK_VALUE(k.size(0) == q.size(0), "batch of k/v (", k.size(0),
                       ") differs from batch of q (", q.size(0), ")");
    FA_CHECK_VALUE(q.is_cuda(), "q, k and v are on ", q.device(),
                   "; flash_attention runs on CUDA tensors (use .cuda())");
    FA_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(),
                   "q, k and v must be on the same device");
    return dtype;
}

// The cu_seqlens of a varlen call (cu_q == nullptr: a fixed-length batch).
struct Varlen {
    const at::Tensor* cu_q = nullptr;
    const at::Tensor* cu_k = nullptr;
    int64_t max_q = 0, max_k = 0;
};

// The call's varlen arguments (both cu_seqlens or neither); cu_q == nullptr for fixed length.
// The optionals must outlive the result.
inline Varlen varlen_args(const std::optional<at::Tensor>& cu_seqlens_q,
                          const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q,
                          int64_t max_seqlen_k) {
    FA_CHECK_VALUE(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
                   "give both cu_seqlens_q and cu_seqlens_k, or neither");
    if (!cu_seqlens_q.has_value())
        return Varlen{};
    return Varlen{&*cu_seqlens_q, &*cu_seqlens_k, max_seqlen_q, max_seqlen_k};
}

// The sizes of a call: q (B, Sq, H, D), k/v (B, Sk, Hk, D); varlen: B from cu_seqlens, Sq and Sk
// the longest sequences (max_seqlen_q/k). After check_qkv().
struct CallShape {
    int64_t batch, heads, kv_heads, seqlen_q, seqlen_k, d_head;
};

inline CallShape call_shape(const at::Tensor& q, const at::Tensor& k, const Varlen& vl) {
    const bool varlen = vl.cu_q != nullptr;
    const int64_t rank = q.dim();
    CallShape s;
    s.d_head = q.size(rank - 1);
    s.heads = q.size(rank - 2);
    s.kv_heads = k.size(rank - 2);
    s.batch = varlen ? vl.cu_q->numel() - 1 : q.size(0);
    s.seqlen_q = varlen ? vl.max_q : q.size(1);
    s.seqlen_k = varlen ? vl.max_k : k.size(1);
    return s;
}

// (left, right) with causal folded in (right = 0) and every side that bounds nothing written as
// -1; mirrors flash_attention.masks.canonical_window.
inline std::pair<int64_t, int64_t> canonical_window(bool causal, int64_t left, int64_t right,
                                                    int64_t seqlen_q, int64_t seqlen_k) {
    if (causal)
        right = 0;
    if (left >= seqlen_k)
        left = -1;
    if (right >= seqlen_q)
        right = -1;
    return {left, right};
}

// The rest of a call against its kernel `c` (or its fallback: they share dtype, d_head variant,
// masks and softcap, so these checks hold for whichever runs): out and lse, the limits of the
// kernels' index arithmetic, softmax_scale, the window and the softcap.
inline void check_call(const flash::FwdKernelEntry& c, const at::Tensor& q_in,
                       const at::Tensor& k_in, const at::Tensor& out, bool out_is_fresh,
                       const std::optional<at::Tensor>& lse, bool varlen, const CallShape& s,
                       at::ScalarType dtype, double softmax_scale, int64_t window_left,
                       int64_t window_right, double softcap) {
    const int64_t rank = q_in.dim();
    const int64_t B = s.batch, H = s.heads, Sq = s.seqlen_q, Sk = s.seqlen_k, D = s.d_head;
    const bool mask = window_left != -1 || window_right != -1;
    const auto device = q_in.device();

    const auto want = c.dtype == flash::DType::kFp16   ? at::kHalf
                      : c.dtype == flash::DType::kBf16 ? at::kBFloat16
                                                       : at::kFloat8_e4m3fn;
    FA_CHECK_TYPE(dtype == want, "kernel ", c.name, " needs ", want, " tensors");
    // FP8 kernels write bf16.
    const auto out_dtype = dtype == at::kFloat8_e4m3fn ? at::kBFloat16 : dtype;
    FA_CHECK_VALUE(D <= c.d_head, "kernel ", c.name, " serves d_head multiples of 8 up to ",
                   c.d_head, ", got ", D);
    check_rank(out, "out", rank, "like q");
    FA_CHECK_VALUE(out.sizes() == q_in.sizes(), "out must have the shape of q ", q_in.sizes(),
                   ", got ", out.sizes());
    FA_CHECK_TYPE(out.scalar_type() == out_dtype, "out must have dtype ", out_dtype);
    FA_CHECK_VALUE(B <= 65535 && H <= 65535, "batch (", B, ") and heads (", H,
                   ") must each be at most 65535");
    // kMaxSeqlen leaves room for the largest tile past the last row in 32-bit row indices.
    constexpr int64_t kMaxSeqlen = std::numeric_limits<int>::max() - 256;
    FA_CHECK_VALUE(Sq <= kMaxSeqlen && Sk <= kMaxSeqlen &&
                       q_in.size(0) <= std::numeric_limits<int>::max() &&
                       k_in.size(0) <= std::numeric_limits<int>::max(),
                   "sequence lengths and token counts must be at most 2^31 - 257");
    FA_CHECK_VALUE(std::isfinite(softmax_scale) && softmax_scale > 0,
                   "softmax_scale must be finite and positive, got ", softmax_scale);
    FA_CHECK_VALUE(window_left >= -1 && window_right >= -1 &&
                       window_left <= std::numeric_limits<int>::max() &&
                       window_right <= std::numeric_limits<int>::max(),
                   "window sizes must be -1 (unbounded) or in [0, 2^31)");
    FA_CHECK_VALUE(c.mask || !mask, "kernel ", c.name,
                   " has no masks (config flag m): it cannot run causal or windowed attention");
    FA_CHECK_VALUE(varlen || !c.varlen_only, "kernel ", c.name,
                   " runs varlen (packed) batches only (config flag j): pass cu_seqlens_q/k");
    FA_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0,
                   "softcap must be 0 (off) or finite and positive, got ", softcap);
    FA_CHECK_VALUE(c.softcap == (softcap > 0), "kernel ", c.name,
                   c.softcap ? " applies a softcap: call it with softcap > 0"
                             : " has no softcap (config flag t)");
    FA_CHECK_VALUE(out.device() == device, "out must be on ", device);
    FA_CHECK_VALUE(out_is_fresh || elements_distinct(out),
                   "out has elements that share memory (an expanded tensor: a stride of 0?); "
                   "pass a tensor whose elements are distinct, e.g. torch.empty_like(q)");
    const int64_t lse_rows = varlen ? q_in.size(0) : Sq;
    if (lse) {
        const bool shape_ok =
            varlen
                ? (lse->dim() == 2 && lse->size(0) == H && lse->size(1) == lse_rows)
                : (lse->dim() == 3 && lse->size(0) == B && lse->size(1) == H && lse->size(2) == Sq);
        FA_CHECK_VALUE(lse->device() == device && lse->scalar_type() == at::kFloat &&
                           lse->is_contiguous() && shape_ok,
                       "lse must be a contiguous fp32 ",
                       varlen ? "(heads, total_q)" : "(batch, heads, seqlen_q)",
                       " tensor on q's device");
    }
}

// An FP8 call's descale (q_descale, k_descale or v_descale): fp32, (batch, kv_heads) with any
// strides (an expanded scalar for a per-tensor scale), on q's device.
inline void check_descale(const std::optional<at::Tensor>& d, const char* name, int64_t batch,
                          int64_t kv_heads, const at::Device& device) {
    if (!d)
        return;
    FA_CHECK_VALUE(d->scalar_type() == at::kFloat && d->dim() == 2 && d->size(0) == batch &&
                       d->size(1) == kv_heads && d->device() == device,
                   name, " must be an fp32 (batch, kv_heads) = (", batch, ", ", kv_heads,
                   ") tensor on q's device (a per-tensor scale: t.expand(batch, kv_heads)), got ",
                   d->scalar_type(), " ", d->sizes(), " on ", d->device());
}

// cu_seqlens: int32, 1-D, contiguous, on q's device, batch + 1 entries.
inline void check_cu_seqlens_meta(const at::Tensor& cu, const char* name,
                                  const at::Device& device) {
    FA_CHECK_TYPE(cu.scalar_type() == at::kInt, name, " must be int32 (torch.int32), got ",
                  cu.scalar_type());
    FA_CHECK_VALUE(cu.dim() == 1 && cu.numel() >= 2, name,
                   " must be 1-D with batch + 1 >= 2 entries, got shape ", cu.sizes());
    FA_CHECK_VALUE(cu.device() == device, name, " must be on ", device, " (q's device), got ",
                   cu.device());
    FA_CHECK_VALUE(cu.is_contiguous(), name, " must be contiguous");
}

// The values of cu_seqlens, checked on the host before any launch: 0 first, non-decreasing,
// `total` last, no sequence longer than max_seqlen. A device-to-host copy (it synchronises), so
// a tensor already checked and not modified since (same TensorImpl, same version counter) is not
// read again: a model's layers reuse one cu_seqlens. The cache holds weak references: they keep
// a dead TensorImpl's memory from being reused by a new tensor (so an address match is the same
// object) without keeping it alive, whose last release would run Python code without the GIL.
// During CUDA graph capture device memory cannot be read; the kernel then clamps every offset
// into the tensors instead, and the backward's main kernel (sm80/backward_kernel.cuh,
// clamped_span) cuts each sequence to max_seqlen_q/k, which size its grid and turn counters.
struct CheckedSeqlens {
    c10::weak_intrusive_ptr<c10::TensorImpl> impl;
    uint32_t version;
    int64_t total, max_seqlen;
};

inline void check_cu_seqlens_values(const at::Tensor& cu, const char* name, int64_t total,
                                    int64_t max_seqlen, cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FA_CHECK(cudaStreamIsCapturing(stream, &capture) == cudaSuccess,
             "cudaStreamIsCapturing failed");
    if (capture != cudaStreamCaptureStatusNone)
        return;
    static std::mutex mutex;
    static std::vector<CheckedSeqlens> checked;  // the last few, most recent last
    const uint32_t version = cu.unsafeGetTensorImpl()->version_counter().current_version();
    {
        const std::lock_guard<std::mutex> lock(mutex);
        for (const CheckedSeqlens& c : checked)
            if (c.impl._unsafe_get_target() == cu.unsafeGetTensorImpl() && c.version == version &&
                c.total == total && c.max_seqlen <= max_seqlen)
                return;
    }
    const at::Tensor host = cu.to(at::kCPU);
    const int32_t* values = host.data_ptr<int32_t>();
    const int64_t n = host.numel();
    FA_CHECK_VALUE(values[0] == 0, name, "[0] must be 0, got ", values[0]);
    int64_t longest = 0;
    for (int64_t i = 1; i < n; ++i) {
        FA_CHECK_VALUE(values[i] >= values[i - 1], name, " must be non-decreasing: ", name, "[", i,
                       "] = ", values[i], " < ", name, "[", i - 1, "] = ", values[i - 1]);
        longest = std::max<int64_t>(longest, values[i] - values[i - 1]);
    }
    FA_CHECK_VALUE(values[n - 1] == total, name, "[-1] = ", values[n - 1],
                   " must equal the number of tokens, ", total);
    FA_CHECK_VALUE(longest <= max_seqlen, "a sequence of ", longest, " tokens is longer than ",
                   name == std::string("cu_seqlens_q") ? "max_seqlen_q" : "max_seqlen_k", " = ",
                   max_seqlen);
    const std::lock_guard<std::mutex> lock(mutex);
    if (checked.size() >= 8)
        checked.erase(checked.begin());
    checked.push_back(
        {c10::weak_intrusive_ptr<c10::TensorImpl>(cu.getIntrusivePtr()), version, total, longest});
}

// What a varlen call's cu_seqlens and max_seqlen_q/k must be, short of the values (no device
// read): check_cu_seqlens_meta for both, the same length, max_seqlen_q/k >= 0.
inline void check_varlen_meta(const Varlen& vl, const at::Device& device) {
    check_cu_seqlens_meta(*vl.cu_q, "cu_seqlens_q", device);
    check_cu_seqlens_meta(*vl.cu_k, "cu_seqlens_k", device);
    FA_CHECK_VALUE(vl.cu_k->numel() == vl.cu_q->numel(),
                   "cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1)");
    FA_CHECK_VALUE(vl.max_q >= 0 && vl.max_k >= 0, "max_seqlen_q/k must be >= 0");
}

// Both cu_seqlens of a varlen call (total_q, total_k: the packed token counts of q and k), on the
// call's stream (the values are read on the host unless the stream is capturing).
inline void check_varlen(const Varlen& vl, int64_t total_q, int64_t total_k,
                         const at::Device& device, cudaStream_t stream) {
    check_varlen_meta(vl, device);
    check_cu_seqlens_values(*vl.cu_q, "cu_seqlens_q", total_q, vl.max_q, stream);
    check_cu_seqlens_values(*vl.cu_k, "cu_seqlens_k", total_k, vl.max_k, stream);
}

// A backward call after check_backward: its shape, dtype, scale, window (canonical) and softcap.
struct BackwardCall {
    CallShape shape;
    at::ScalarType dtype;
    bool varlen;
    int64_t total_q, total_k;  // tokens of q and k (varlen), else their first dimension
    double scale;
    int64_t window_left, window_right;
    double softcap;
};

inline void check_like(const at::Tensor& t, const char* name, const at::Tensor& like,
                       const char* like_name) {
    FA_CHECK_VALUE(t.sizes() == like.sizes(), name, " must have the shape of ", like_name, " ",
                   like.sizes(), ", got ", t.sizes());
    FA_CHECK_TYPE(t.scalar_type() == like.scalar_type(), name, " must have the dtype of ",
                  like_name, " (", like.scalar_type(), "), got ", t.scalar_type());
    FA_CHECK_VALUE(t.device() == like.device(), name, " must be on the device of ", like_name, " (",
                   like.device(), "), got ", t.device());
}

// Every argument of flash_attention::bwd short of the cu_seqlens values (read on the call's
// stream, check_cu_seqlens_values): q, k, v as the forward checks them, out and dout like q, lse
// (and dlse) the forward's fp32 LSE, the limits of the kernels' index arithmetic, the scale, the
// window and the softcap.
inline BackwardCall check_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& out,
                                   const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
                                   const Varlen& vl, std::optional<double> softmax_scale,
                                   bool causal, int64_t window_left, int64_t window_right,
                                   double softcap) {
    BackwardCall c{};
    c.varlen = vl.cu_q != nullptr;
    c.dtype = check_qkv(q, k, v, c.varlen);
    check_like(out, "out", q, "q");
    check_like(dout, "dout", q, "q");
    const auto device = q.device();
    if (c.varlen)
        check_varlen_meta(vl, device);
    // By role: (batch, row, head, d) fixed-length; varlen (token, head, d), the batch from
    // cu_seqlens and the lengths their longest (max_seqlen_q/k).
    c.shape = call_shape(q, k, vl);
    const CallShape& s = c.shape;
    c.total_q = q.size(0);
    c.total_k = k.size(0);
    FA_CHECK_VALUE(s.batch <= 65535 && s.kv_heads <= 65535 && s.heads <= 65535, "batch (", s.batch,
                   ") and heads (", s.heads, ", k/v: ", s.kv_heads, ") must each be at most 65535");
    constexpr int64_t kMaxSeqlen = std::numeric_limits<int>::max() - 256;
    FA_CHECK_VALUE(s.seqlen_q <= kMaxSeqlen && s.seqlen_k <= kMaxSeqlen,
                   "sequence lengths must be at most 2^31 - 257");
    // Varlen row buffers hold every token plus a query block of slack (run_backward).
    FA_CHECK_VALUE(!c.varlen || (c.total_q <= std::numeric_limits<int>::max() - 512 &&
                                 c.total_k <= std::numeric_limits<int>::max() - 512),
                   "token counts must be at most 2^31 - 513");
    const std::vector<int64_t> lse_shape = c.varlen
                                               ? std::vector<int64_t>{s.heads, c.total_q}
                                               : std::vector<int64_t>{s.batch, s.heads, s.seqlen_q};
    FA_CHECK_VALUE(
        lse.scalar_type() == at::kFloat && lse.sizes() == lse_shape && lse.device() == device,
        "lse must be the forward's fp32 ",
        c.varlen ? "(heads, total_q)" : "(batch, heads, seqlen_q)", " = ",
        at::IntArrayRef(lse_shape), " tensor on q's device, got ", lse.sizes(), " ",
        lse.scalar_type(), " on ", lse.device());
    if (dlse)
        FA_CHECK_VALUE(dlse->scalar_type() == at::kFloat && dlse->sizes() == lse_shape &&
                           dlse->device() == device,
                       "dlse must be an fp32 tensor of the shape of lse ",
                       at::IntArrayRef(lse_shape), " on q's device, got ", dlse->sizes(), " ",
                       dlse->scalar_type(), " on ", dlse->device());
    c.scale = softmax_scale ? *softmax_scale : 1.0 / std::sqrt(double(s.d_head));
    FA_CHECK_VALUE(std::isfinite(c.scale) && c.scale > 0,
                   "softmax_scale must be finite and positive, got ", c.scale);
    FA_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0,
                   "softcap must be 0 (off) or finite and positive, got ", softcap);
    c.softcap = softcap;
    FA_CHECK_VALUE(window_left >= -1 && window_right >= -1 &&
                       window_left <= std::numeric_limits<int>::max() &&
                       window_right <= std::numeric_limits<int>::max(),
                   "window sizes must be -1 (unbounded) or in [0, 2^31)");
    std::tie(c.window_left, c.window_right) =
        canonical_window(causal, window_left, window_right, s.seqlen_q, s.seqlen_k);
    return c;
}

// A backward kernel the caller named must serve the call's dtype, d_head and softcap.
inline void check_backward_kernel(const flash::BwdKernelEntry& e, const BackwardCall& c) {
    FA_CHECK_VALUE((e.dtype == flash::DType::kBf16) == (c.dtype == at::kBFloat16) &&
                       e.d_head >= c.shape.d_head && e.softcap == (c.softcap > 0),
                   "backward kernel ", e.name, " cannot serve this call (dtype ", c.dtype,
                   ", d_head=", c.shape.d_head, c.softcap > 0 ? ", a softcap" : ", no softcap",
                   ")");
}

}  // namespace flash::binding
