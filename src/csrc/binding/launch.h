// A forward call from checked inputs to a launched kernel: the kernel chosen (named, or the
// dispatch table's), the checks, the tensors as the kernels can address them (input_layout.h),
// the run-time fallback of a Hopper kernel, the kernel arguments and the launch on the current
// stream; and explain() / layout_report(), which say what a call would run and copy.
#pragma once

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "../common/params.h"
#include "../registry.h"
#include "device_properties.h"
#include "dispatch.h"
#include "input_layout.h"
#include "message.h"
#include "params.h"
#include "tma_fit.h"
#include "validation.h"

namespace flash::binding {

// Runs q (B, Sq, H, D), k/v (B, Sk, Hk, D) into out (B, Sq, H, D) and, if given, lse (B, H, Sq)
// fp32 contiguous; varlen: q/out (total_q, H, D), k/v (total_k, Hk, D), lse (H, total_q).
// window_left/right: -1 unbounded (causal is -1, 0); they need a kernel with masks unless both
// are -1. softcap: 0 off, else a kernel built for it. Any strides: what the kernels cannot
// address goes through a copy (binding/input_layout.h); out_is_fresh: out was allocated by the
// operator (contiguous, shares no memory), so its layout needs no test. fp8: q, k, v are
// float8_e4m3fn (fixed-length, a Hopper FP8 kernel, out bf16) with `descale` (q, k, v; each
// optional, fp32 (batch, kv_heads)).
struct Descales {
    std::optional<at::Tensor> q, k, v;
};
inline void run_forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                        const at::Tensor& out, bool out_is_fresh,
                        const std::optional<at::Tensor>& lse, const Varlen& vl,
                        c10::string_view name, double softmax_scale, int64_t window_left,
                        int64_t window_right, double softcap, const Descales* fp8 = nullptr) {
    const bool varlen = vl.cu_q != nullptr;
    const at::ScalarType dtype = check_qkv(q_in, k_in, v_in, varlen, fp8 != nullptr);
    const CallShape s = call_shape(q_in, k_in, vl);
    if (fp8 != nullptr) {
        FA_CHECK_VALUE(s.d_head % 16 == 0,
                       "FP8 attention needs d_head a multiple of 16 (rows of "
                       "16-byte TMA copies), got ",
                       s.d_head);
        check_descale(fp8->q, "q_descale", s.batch, s.kv_heads, q_in.device());
        check_descale(fp8->k, "k_descale", s.batch, s.kv_heads, q_in.device());
        check_descale(fp8->v, "v_descale", s.batch, s.kv_heads, q_in.device());
    }
    const int64_t B = s.batch, H = s.heads, Sq = s.seqlen_q, Sk = s.seqlen_k;
    const bool mask = window_left != -1 || window_right != -1;
    const Choice<flash::FwdKernelEntry> chosen = choose_kernel<flash::FwdKernelEntry>(
        name, dtype, s.d_head, Sq, mask, window_left != -1, softcap > 0, "");
    check_call(*chosen.kernel, q_in, k_in, out, out_is_fresh, lse, varlen, s, dtype, softmax_scale,
               window_left, window_right, softcap);
    const auto device = q_in.device();
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    if (varlen)
        check_varlen(vl, q_in.size(0), k_in.size(0), device, stream);
    if (B == 0 || Sq == 0 || H == 0 || q_in.size(0) == 0)
        return;
    if (!varlen && Sk == 0) {  // no key for any row: out 0, LSE -inf
        out.zero_();
        if (lse)
            lse->fill_(-std::numeric_limits<float>::infinity());
        return;
    }

    const cudaDeviceProp& prop = device_properties(device.index());
    FA_CHECK(prop.major >= 8,
             "FlashAttention kernels need compute capability 8.0 or newer, this GPU has ",
             prop.major, ".", prop.minor);
    FA_CHECK(fp8 == nullptr || (prop.major == 9 && prop.minor == 0),
             "FP8 attention runs on Hopper (sm_90) GPUs alone (FP8 wgmma); this GPU is sm_",
             prop.major, prop.minor, ": pass fp16 or bf16 tensors");

    // The tensors as the kernels address them: the caller's, or copies (input_layout.h). FP8
    // has no sm80-family fallback: what TMA cannot address (an expanded view, an offset off 16
    // bytes) is copied too.
    const auto address = [&](const at::Tensor& t) {
        if (fp8 != nullptr && sm90_unfit(prop, false, {&t}) != nullptr)
            return fresh_copy(t);
        return addressable(t);
    };
    const c10::MaybeOwned<at::Tensor> q_addr = address(q_in);
    const c10::MaybeOwned<at::Tensor> k_addr = address(k_in);
    const c10::MaybeOwned<at::Tensor> v_addr = address(v_in);
    const at::Tensor &q = *q_addr, &k = *k_addr, &v = *v_addr;
    const bool out_direct =
        out_is_fresh || (unaddressable(out) == nullptr && !spans_overlap(out, q_in) &&
                         !spans_overlap(out, k_in) && !spans_overlap(out, v_in));
    const c10::MaybeOwned<at::Tensor> out_addr =
        out_direct ? c10::MaybeOwned<at::Tensor>::borrowed(out)
                   : c10::MaybeOwned<at::Tensor>::owned(at::empty(q_in.sizes(), out.options()));
    const at::Tensor& o = *out_addr;

    // A Hopper kernel runs only what TMA can address on an sm_90 GPU; else its row's fallback.
    // Varlen calls run the row's varlen kernel where it has one; a fixed-length call whose tiles
    // fit in one wave its row's one-wave kernel.
    const flash::FwdKernelEntry* pick =
        varlen && chosen.varlen != nullptr ? chosen.varlen : chosen.kernel;
    if (pick->arch == 90) {
        if (const char* why = sm90_unfit(prop, varlen, {&q, &k, &v, &o}, pick->varlen_only)) {
            FA_CHECK(chosen.fallback != nullptr, "kernel ", pick->name,
                     " (sm_90a) cannot run this call: ", why);
            pick = chosen.fallback;
        } else if (!varlen) {
            if (const flash::FwdKernelEntry* small =
                    one_wave(chosen, B, H, Sq, prop.multiProcessorCount))
                pick = small;
            else if (const flash::FwdKernelEntry* keys = fewer_padded_keys(chosen, *pick, Sk))
                pick = keys;
        }
    }
    const flash::FwdKernelEntry& e = *pick;
    FA_CHECK(static_cast<size_t>(e.smem_bytes) <= prop.sharedMemPerBlockOptin, "kernel ", e.name,
             " needs ", e.smem_bytes, " bytes of shared memory per block; this GPU allows ",
             prop.sharedMemPerBlockOptin);

    flash::FwdParams p{};
    set_attention_params(p, q, k, v, o, lse ? lse->data_ptr<float>() : nullptr, vl, s,
                         softmax_scale, window_left, window_right, softcap);
    if (fp8 != nullptr) {
        const std::optional<at::Tensor>* d[3] = {&fp8->q, &fp8->k, &fp8->v};
        for (int i = 0; i < 3; ++i) {
            if (!*d[i])
                continue;
            p.descale[i] = (*d[i])->data_ptr<float>();
            p.descale_batch_stride[i] = (*d[i])->stride(0);
            p.descale_head_stride[i] = (*d[i])->stride(1);
        }
    }
    at::Tensor tile_counter;  // zeroed by the launcher on the stream; freed in stream order
    if (e.tile_counter) {
        tile_counter = at::empty({1}, q.options().dtype(at::kInt));
        p.tile_counter = tile_counter.data_ptr<int>();
    }
    const cudaError_t err = e.launch(p, stream);
    FA_CHECK(err == cudaSuccess, "launch of kernel ", e.name, " failed: ", cudaGetErrorString(err));
    if (!out_direct)
        out.copy_(o);
}

// What dispatch runs for a fixed-length call and why (for debug logging): the table's kernel,
// or its fallback with the reason the Hopper kernel cannot run the call, and the inputs copied
// because the kernels cannot address them (input_layout.h). The window is the operator's
// (canonical_window: causal folded in, sides that bound nothing -1).
inline std::string explain(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           int64_t window_left, int64_t window_right, bool softcap) {
    const int64_t D = q.size(-1);
    const bool mask = window_left != -1 || window_right != -1;
    const Choice<flash::FwdKernelEntry> c = lookup<flash::FwdKernelEntry>(
        dtype_code(q.scalar_type()), D, q.size(1), mask, window_left != -1, softcap);
    if (c.kernel == nullptr)
        return "no kernel in the dispatch table";
    std::string copies;
    const std::pair<const char*, const at::Tensor*> inputs[] = {{"q", &q}, {"k", &k}, {"v", &v}};
    for (const auto& [name, t] : inputs)
        if (const char* why = unaddressable(*t))
            copies += message(", copies ", name, " (", why, ")");
    if (c.kernel->arch != 90)
        return c.kernel->name + copies;
    const auto qa = addressable(q), ka = addressable(k), va = addressable(v);
    const cudaDeviceProp& prop = device_properties(q.device().index());
    const char* why = sm90_unfit(prop, false, {&*qa, &*ka, &*va});
    if (why != nullptr)
        return message(c.fallback->name, " (not ", c.kernel->name, ": ", why, ")", copies);
    if (const flash::FwdKernelEntry* small =
            one_wave(c, q.size(0), q.size(2), q.size(1), prop.multiProcessorCount))
        return message(small->name, " (one wave: ",
                       q.size(0) * q.size(2) * ((q.size(1) + small->block_r - 1) / small->block_r),
                       " tiles of ", small->block_r, " rows on ", prop.multiProcessorCount, " SMs)",
                       copies);
    if (const flash::FwdKernelEntry* keys = fewer_padded_keys(c, *c.kernel, k.size(1)))
        return message(keys->name, " (fewer padded keys: ", k.size(1), " keys in blocks of ",
                       keys->block_c, ", not ", c.kernel->block_c, ")", copies);
    return c.kernel->name + copies;
}

// explain() for a varlen call, q (total_q, H, D), k/v (total_k, Hk, D): the row's varlen kernel
// (or its kernel, or the fallback, with the reason the Hopper one cannot run the call).
inline std::string explain_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  int64_t max_seqlen_q, int64_t window_left, int64_t window_right,
                                  bool softcap) {
    const bool mask = window_left != -1 || window_right != -1;
    const Choice<flash::FwdKernelEntry> c = lookup<flash::FwdKernelEntry>(
        dtype_code(q.scalar_type()), q.size(-1), max_seqlen_q, mask, window_left != -1, softcap);
    if (c.kernel == nullptr)
        return "no kernel in the dispatch table";
    const flash::FwdKernelEntry* pick = c.varlen != nullptr ? c.varlen : c.kernel;
    if (pick->arch != 90)
        return pick->name;
    const auto qa = addressable(q), ka = addressable(k), va = addressable(v);
    const char* why = sm90_unfit(device_properties(q.device().index()), true, {&*qa, &*ka, &*va},
                                 pick->varlen_only);
    return why == nullptr ? pick->name
                          : message(c.fallback->name, " (not ", pick->name, ": ", why, ")");
}

// How the operator will address each tensor of a call (input_layout.h), for tests and debug
// logging; reads only metadata, so CPU tensors do too: {name: "" (in place) or why a copy}, and
// for out "refused: ..." when its elements overlap.
inline py::dict layout_report(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& out) {
    py::dict report;
    const std::pair<const char*, const at::Tensor*> inputs[] = {{"q", &q}, {"k", &k}, {"v", &v}};
    for (const auto& [name, t] : inputs) {
        const char* why = unaddressable(*t);
        report[name] = why == nullptr ? "" : why;
    }
    if (out) {
        if (!elements_distinct(*out))
            report["out"] = "refused: its elements share memory";
        else if (const char* why = unaddressable(*out))
            report["out"] = why;
        else if (spans_overlap(*out, q) || spans_overlap(*out, k) || spans_overlap(*out, v))
            report["out"] = "its memory overlaps q, k or v";
        else
            report["out"] = "";
    }
    return report;
}

}  // namespace flash::binding
