// A backward call from checked inputs to launched kernels: the tensors as the kernels can address
// them (input_layout.h), the run-time fallback of a Hopper kernel to its row's sm80-family
// kernel, the operator's fp32 buffers, the kernel arguments and the launch (preprocess, main
// kernel, dQ conversion) on the current stream; and explain_backward(), which says what a call
// would run.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "../registry.h"
#include "device_properties.h"
#include "dispatch.h"
#include "input_layout.h"
#include "message.h"
#include "params.h"
#include "tma_fit.h"
#include "validation.h"

namespace flash::binding {

// The sm80 family's dQ order for a fixed-length call (BwdParams::dq_tiles): 1 (tiles, one 16-byte
// reduction per tile and thread) on sm_90 and later, 2 (lane-major tiles, four scalar
// reductions) on sm_80-89, which have no vector reductions. FLASH_ATTENTION_SM80_DQ_ORDER=rows,
// tiles or lane overrides it, so that an sm_90 GPU can test sm_80-89's order (a diagnostic).
inline int sm80_fixed_length_dq_order(int major) {
    const char* env = std::getenv("FLASH_ATTENTION_SM80_DQ_ORDER");
    if (env == nullptr || *env == '\0')
        return major >= 9 ? 1 : 2;
    static const std::pair<const char*, int> kOrders[] = {{"rows", 0}, {"tiles", 1}, {"lane", 2}};
    for (const auto& [name, order] : kOrders)
        if (std::strcmp(env, name) == 0)
            return order;
    FA_CHECK_VALUE(false, "FLASH_ATTENTION_SM80_DQ_ORDER must be rows, tiles or lane, got '", env,
                   "'");
    return 0;
}

// The kernel a call runs: the chosen one, or its row's sm80-family fallback where the Hopper
// kernel cannot run the call (`unfit` says why; nullptr: it can); a named Hopper kernel that
// cannot run it (a name has no fallback), or a row without a fallback, is refused.
inline const flash::BwdKernelEntry& runnable(const Choice<flash::BwdKernelEntry>& chosen,
                                             const char* unfit, bool named) {
    if (chosen.kernel->arch != 90 || unfit == nullptr)
        return *chosen.kernel;
    FA_CHECK(chosen.fallback != nullptr, "backward kernel ", chosen.kernel->name,
             " (sm_90a) cannot run this call: ", unfit,
             named ? ""
                   : "; this build has no sm80-family backward kernel for it (rebuild with "
                     "FLASH_ATTENTION_KERNELS=default)");
    return *chosen.fallback;
}

// flash_attention::bwd_accumulate's fp32 tensors, shaped like q, k, v, that a call's gradients
// are added into (check_grad_sums).
struct GradSums {
    at::Tensor dq, dk, dv;
};

// Runs the backward of a checked call on `chosen` (or its fallback): dq, dk, dv like q, k, v, or
// with `sums` added into those and returned.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(
    const BackwardCall& c, const Choice<flash::BwdKernelEntry>& chosen, const at::Tensor& dout_in,
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const std::optional<at::Tensor>& dlse_in,
    const Varlen& vl, bool deterministic, bool named, const GradSums* sums = nullptr) {
    const CallShape& s = c.shape;
    const auto device = q_in.device();
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    if (c.varlen) {
        // The values, as the forward checks them (a cached no-op for the cu_seqlens the forward
        // of this backward already read): a max_seqlen below a sequence's length would leave
        // that sequence's tail without gradients.
        check_cu_seqlens_values(*vl.cu_q, "cu_seqlens_q", c.total_q, vl.max_q, stream);
        check_cu_seqlens_values(*vl.cu_k, "cu_seqlens_k", c.total_k, vl.max_k, stream);
    }
    at::Tensor dq = sums ? sums->dq : at::empty(q_in.sizes(), q_in.options());
    at::Tensor dk = sums ? sums->dk : at::empty(k_in.sizes(), k_in.options());
    at::Tensor dv = sums ? sums->dv : at::empty(v_in.sizes(), v_in.options());
    if (s.batch == 0 || s.heads == 0 || s.seqlen_q == 0 || s.seqlen_k == 0 || c.total_q == 0 ||
        c.total_k == 0) {  // nothing to attend: every gradient is 0
        if (sums)
            return {dq, dk, dv};
        dq.zero_();
        dk.zero_();
        dv.zero_();
        return {dq, dk, dv};
    }
    const cudaDeviceProp& prop = device_properties(device.index());
    FA_CHECK(prop.major >= 8,
             "FlashAttention kernels need compute capability 8.0 or newer, this GPU has ",
             prop.major, ".", prop.minor);

    const c10::MaybeOwned<at::Tensor> q_a = addressable(q_in), k_a = addressable(k_in),
                                      v_a = addressable(v_in), o_a = addressable(out_in),
                                      do_a = addressable(dout_in);
    const at::Tensor &q = *q_a, &k = *k_a, &v = *v_a, &o = *o_a, &dout = *do_a;
    const at::Tensor lse = lse_in.contiguous();
    const at::Tensor dlse = dlse_in ? dlse_in->contiguous() : at::Tensor();

    // The Hopper kernel runs calls whose tensors TMA can address on an sm_90 GPU (deterministic
    // ones too; varlen ones on the row's varlen kernel, flag j); the rest run on the sm80 family.
    const flash::BwdKernelEntry* pick =
        c.varlen && chosen.varlen != nullptr ? chosen.varlen : chosen.kernel;
    FA_CHECK_VALUE(c.varlen || !pick->varlen_only, "backward kernel ", pick->name,
                   " runs varlen (packed) batches only (config flag j): pass cu_seqlens_q/k");
    const flash::BwdKernelEntry& e = runnable(
        Choice<flash::BwdKernelEntry>{pick, chosen.fallback},
        sm90_unfit(prop, c.varlen,
                   sums ? std::initializer_list<const at::Tensor*>{&q, &k, &v, &dout}
                        : std::initializer_list<const at::Tensor*>{&q, &k, &v, &dout, &dk, &dv},
                   pick->varlen_only),
        named);
    FA_CHECK(size_t(e.smem_bytes) <= prop.sharedMemPerBlockOptin, "backward kernel ", e.name,
             " needs ", e.smem_bytes, " bytes of shared memory per block; this GPU allows ",
             prop.sharedMemPerBlockOptin);

    // Rows of the fp32 buffers per (batch, head): whole query blocks; varlen, every token of a
    // head with a block of slack past the last (a sequence's last block may reach past it), or
    // on the Hopper family each sequence from a multiple of kBwdVarlenRowAlign rows.
    const int64_t align = flash::kBwdVarlenRowAlign;
    const int64_t Sq_pad = !c.varlen ? (s.seqlen_q + e.block_r - 1) / e.block_r * e.block_r
                           : e.arch == 90
                               ? (c.total_q + align * s.batch + align - 1) / align * align
                               : (c.total_q + e.block_r - 1) / e.block_r * e.block_r + e.block_r;
    const int64_t B_rows = c.varlen ? 1 : s.batch;
    const auto f32 = q.options().dtype(at::kFloat);
    at::Tensor dq_accum = at::empty({B_rows, s.heads, Sq_pad, e.d_head}, f32);
    at::Tensor d_rows = at::empty({B_rows, s.heads, Sq_pad}, f32);
    at::Tensor lse_log2 = at::empty({B_rows, s.heads, Sq_pad}, f32);
    // Deterministic: one turn counter per (batch, query head, query block), zeroed. The kernel
    // indexes it with the query blocks of BwdParams::seqlen_q, which is Sq for both layouts:
    // varlen, max_seqlen_q, so every sequence has room (none longer: checked above, and during
    // CUDA graph capture, where the values cannot be read, cut to it by the kernel).
    at::Tensor semaphore;
    if (deterministic)
        semaphore = at::zeros({s.batch, s.heads, (s.seqlen_q + e.block_r - 1) / e.block_r},
                              q.options().dtype(at::kInt));

    flash::BwdParams p{};
    set_attention_params(p, q, k, v, o, lse.data_ptr<float>(), vl, s, c.scale, c.window_left,
                         c.window_right, c.softcap);
    p.dout = dout.data_ptr();
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    p.dlse = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
    p.d_rows = d_rows.data_ptr<float>();
    p.lse_log2 = lse_log2.data_ptr<float>();
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dq_semaphore = deterministic ? semaphore.data_ptr<int>() : nullptr;
    // The sm80 family's dQ order: rows for varlen calls (a sequence starts at any token, not on
    // a 64-row block), else sm80_fixed_length_dq_order's. The Hopper family's is always tiles.
    p.dq_tiles = c.varlen ? 0 : sm80_fixed_length_dq_order(prop.major);
    p.accumulate = sums != nullptr;
    const RoleStrides ds = role_strides(dout, c.varlen), qs = role_strides(dq, c.varlen),
                      ks = role_strides(dk, c.varlen), vs = role_strides(dv, c.varlen);
    p.do_batch_stride = ds.batch;
    p.do_row_stride = ds.row;
    p.do_head_stride = ds.head;
    p.dq_batch_stride = qs.batch;
    p.dq_row_stride = qs.row;
    p.dq_head_stride = qs.head;
    p.dk_batch_stride = ks.batch;
    p.dk_row_stride = ks.row;
    p.dk_head_stride = ks.head;
    p.dv_batch_stride = vs.batch;
    p.dv_row_stride = vs.row;
    p.dv_head_stride = vs.head;
    p.kv_heads = static_cast<int>(s.kv_heads);
    p.seqlen_q_pad = static_cast<int>(Sq_pad);
    p.d_pad = e.d_head;
    p.softmax_scale = static_cast<float>(c.scale);
    const cudaError_t err = e.launch(p, stream);
    FA_CHECK(err == cudaSuccess, "launch of backward kernel ", e.name,
             " failed: ", cudaGetErrorString(err));
    return {dq, dk, dv};
}

// The kernel run_backward runs for a call of these tensors (no kernel named), and why not the
// Hopper one when it falls back to the sm80 family: from the tensors' metadata and the GPU's
// properties alone (dK and dV are new contiguous tensors, which TMA addresses whenever K and V
// are).
inline std::string explain_backward(const at::Tensor& dout, const at::Tensor& q,
                                    const at::Tensor& k, const at::Tensor& v, bool varlen,
                                    bool softcap) {
    FA_CHECK_VALUE(q.is_cuda(), "bwd_explain needs CUDA tensors, got ", q.device());
    const Choice<flash::BwdKernelEntry> c = lookup<flash::BwdKernelEntry>(
        dtype_code(q.scalar_type()), q.size(-1), 1, false, false, softcap);
    if (c.kernel == nullptr)
        return "no backward kernel in this build";
    const flash::BwdKernelEntry* pick = varlen && c.varlen != nullptr ? c.varlen : c.kernel;
    if (pick->arch != 90)
        return pick->name;
    const c10::MaybeOwned<at::Tensor> qa = addressable(q), ka = addressable(k), va = addressable(v),
                                      da = addressable(dout);
    const char* why = sm90_unfit(device_properties(q.device().index()), varlen,
                                 {&*qa, &*ka, &*va, &*da}, pick->varlen_only);
    if (why == nullptr)
        return pick->name;
    if (c.fallback == nullptr)
        return message("no backward kernel in this build (not the Hopper family: ", why, ")");
    return message(c.fallback->name, " (not the Hopper family: ", why, ")");
}

}  // namespace flash::binding
