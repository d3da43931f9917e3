// Host-side launcher of one Hopper backward config and its registry entry: the TMA tensor maps
// of Q, K, V, dO (loads) and dK, dV (stores), then the preprocess, the main kernel and the dQ
// conversion. Plain CUDA (no torch). The binding calls it only for fixed-length calls that
// sm90_unfit() (binding/tma_fit.h) accepts; errors are returned, never swallowed.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "../backward_registry.h"
#include "../common/backward_common.cuh"
#include "../common/launch_support.cuh"
#include "backward_kernel.cuh"
#include "tensor_map.h"

namespace flash::sm90 {

template <class Cfg>
cudaError_t launch_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
    using Elem = typename Cfg::Elem;
    // Varlen runs on the sm80 family; the kernel strides the dQ accumulator by its d_head.
    if (p.cu_seqlens_q != nullptr || p.d_pad != Cfg::kDHead)
        return cudaErrorInvalidValue;
    Sm90BwdParams prm{};
    prm.p = p;
    const bool ok =
        encode_bshd<Elem>(&prm.tma_q, p.q, p.d_head, p.seqlen_q, p.heads, p.batch, p.q_row_stride,
                          p.q_head_stride, p.q_batch_stride, Cfg::kBr) &&
        encode_bshd<Elem>(&prm.tma_do, p.dout, p.d_head, p.seqlen_q, p.heads, p.batch,
                          p.do_row_stride, p.do_head_stride, p.do_batch_stride, Cfg::kBr) &&
        encode_bshd<Elem>(&prm.tma_k, p.k, p.d_head, p.seqlen_k, p.kv_heads, p.batch,
                          p.k_row_stride, p.k_head_stride, p.k_batch_stride, Cfg::kBc) &&
        encode_bshd<Elem>(&prm.tma_v, p.v, p.d_head, p.seqlen_k, p.kv_heads, p.batch,
                          p.v_row_stride, p.v_head_stride, p.v_batch_stride, Cfg::kBc) &&
        encode_bshd<Elem>(&prm.tma_dk, p.dk, p.d_head, p.seqlen_k, p.kv_heads, p.batch,
                          p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride, 64) &&
        encode_bshd<Elem>(&prm.tma_dv, p.dv, p.d_head, p.seqlen_k, p.kv_heads, p.batch,
                          p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride, 64);
    if (!ok)
        return cudaErrorInvalidValue;
    // The CTA order (Sm90BwdParams). Under a causal mask (a window bounded on one side only)
    // the first KV blocks see many more query blocks than the last: groups of pairs whose Q,
    // dO, LSE and D take at most 16 MB (a third of an H100's L2), heaviest KV blocks first.
    // Otherwise one pair per group (more only where the pairs exceed the grid's z limit). The
    // deterministic order adds the last KV block first (BackwardTile::dq_turn): a CTA waits
    // only for CTAs earlier in the order, which run first. Groups are a divisor of the pairs.
    const int kv_blocks = (p.seqlen_k + Cfg::kBc - 1) / Cfg::kBc;
    const int64_t pairs = int64_t(p.batch) * p.kv_heads;
    if (pairs <= 0 || pairs > INT32_MAX || kv_blocks <= 0 || kv_blocks > 65535)
        return cudaErrorInvalidValue;  // (the binding answers empty calls itself)
    int64_t want = 1;
    const bool uneven = (p.window_left < 0) != (p.window_right < 0);
    if (uneven && p.dq_semaphore == nullptr) {
        const int64_t pair_bytes = int64_t(p.seqlen_q_pad) * p.heads_per_kv * (4 * p.d_pad + 8);
        want = pair_bytes > 0 ? (int64_t(16) << 20) / pair_bytes : 1;
    }
    int64_t group = 0;  // the largest divisor of the pairs up to `want` leaving z in its limit
    for (int64_t g = want < pairs ? want : pairs; g >= 1 && group == 0; --g)
        if (pairs % g == 0 && pairs / g <= 65535)
            group = g;
    for (int64_t g = want + 1; g <= pairs && group == 0; ++g)  // else the smallest above it
        if (pairs % g == 0 && pairs / g <= 65535)
            group = g;
    prm.kv_heads = FastDiv(p.kv_heads);
    prm.kv_block0 = p.dq_semaphore != nullptr ? kv_blocks - 1 : 0;
    prm.kv_block_step = p.dq_semaphore != nullptr ? -1 : 1;
    const dim3 grid(static_cast<unsigned>(group), static_cast<unsigned>(kv_blocks),
                    static_cast<unsigned>(pairs / group));
    return bwd::launch_passes<Elem, bwd::DqLayout::kWgmmaTiles>(p, stream, [&] {
        return launch_checked<&bwd_sm90_kernel<Cfg>>(grid, Cfg::kThreads, Cfg::kSmemBytes, stream,
                                                     prm);
    });
}

template <class Cfg>
constexpr BwdKernelEntry make_bwd_entry(const char* name) {
    return bwd_kernel_entry<Cfg>(name, &launch_bwd_sm90<Cfg>, /*arch=*/90);
}

}  // namespace flash::sm90
