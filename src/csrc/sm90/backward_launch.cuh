// Host-side launcher of one Hopper backward config and its registry entry: the TMA tensor maps
// of Q, K, V, dO (loads) and dK, dV (stores, unless BwdParams::accumulate), then the preprocess,
// the main kernel and the dQ conversion. Plain CUDA (no torch). The binding calls it only for calls
// that sm90_unfit() (binding/tma_fit.h) accepts, varlen ones only on a kVarlen kernel; errors are
// returned, never swallowed.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "../common/backward_common.cuh"
#include "../common/launch_support.cuh"
#include "../registry.h"
#include "backward_kernel.cuh"
#include "tensor_map.h"

namespace flash::sm90 {

template <class Cfg>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
    using Elem = typename Cfg::Elem;
    // A kVarlen kernel runs varlen calls, the others none; the kernel strides the dQ
    // accumulator by its d_head.
    if ((p.cu_seqlens_q != nullptr) != Cfg::kVarlen || p.d_pad != Cfg::kDHead)
        return cudaErrorInvalidValue;
    BwdKernelParams prm{};
    prm.p = p;
    // Varlen: one batch of every packed row (a CTA adds its sequence's first row).
    const int rows_q = Cfg::kVarlen ? p.total_q : p.seqlen_q;
    const int rows_k = Cfg::kVarlen ? p.total_k : p.seqlen_k;
    const int batch = Cfg::kVarlen ? 1 : p.batch;
    const bool ok =
        encode_bshd<Elem>(&prm.tma_q, p.q, p.d_head, rows_q, p.heads, batch, p.q_row_stride,
                          p.q_head_stride, p.q_batch_stride, Cfg::kBr) &&
        encode_bshd<Elem>(&prm.tma_do, p.dout, p.d_head, rows_q, p.heads, batch, p.do_row_stride,
                          p.do_head_stride, p.do_batch_stride, Cfg::kBr) &&
        encode_bshd<Elem>(&prm.tma_k, p.k, p.d_head, rows_k, p.kv_heads, batch, p.k_row_stride,
                          p.k_head_stride, p.k_batch_stride, Cfg::kBc) &&
        encode_bshd<Elem>(&prm.tma_v, p.v, p.d_head, rows_k, p.kv_heads, batch, p.v_row_stride,
                          p.v_head_stride, p.v_batch_stride, Cfg::kBc) &&
        (p.accumulate ||  // fp32 dK, dV added from registers: no stores through maps
         (encode_bshd<Elem>(&prm.tma_dk, p.dk, p.d_head, rows_k, p.kv_heads, batch, p.dk_row_stride,
                            p.dk_head_stride, p.dk_batch_stride, 64) &&
          encode_bshd<Elem>(&prm.tma_dv, p.dv, p.d_head, rows_k, p.kv_heads, batch, p.dv_row_stride,
                            p.dv_head_stride, p.dv_batch_stride, 64)));
    if (!ok)
        return cudaErrorInvalidValue;
    // Varlen: KV blocks of the longest sequence (BwdParams::seqlen_k is max_seqlen_k), a grid
    // row per sequence.
    const dim3 grid((p.seqlen_k + Cfg::kBc - 1) / Cfg::kBc, p.kv_heads, p.batch);
    // The deterministic order adds the last KV block first (BackwardTile::dq_turn): it runs
    // first, so no CTA waits for one not yet launched. With no mask where it is safe, the
    // rotated order instead (bwd::rotation_of), KV blocks first to last.
    int r = 0;
    if (cudaError_t err =
            bwd::rotation_of(p, (p.seqlen_q + Cfg::kBr - 1) / Cfg::kBr, int(grid.x), r);
        err != cudaSuccess)
        return err;
    const bool rotate = r > 0;
    prm.rotated_kv_blocks = rotate ? int(grid.x) : 0;
    prm.rotation = FastDiv(rotate ? r : 1);
    prm.rotation_step = rotate ? prm.rotation.d : 0;
    prm.kv_block0 = p.dq_semaphore != nullptr && !rotate ? int(grid.x) - 1 : 0;
    prm.kv_block_step = p.dq_semaphore != nullptr && !rotate ? -1 : 1;
    return bwd::launch_passes<Elem, bwd::DqLayout::kWgmmaTiles, Cfg::kVarlen>(p, stream, [&] {
        return launch_checked<&bwd_kernel<Cfg>>(grid, Cfg::kThreads, Cfg::kSmemBytes, stream, prm);
    });
}

template <class Cfg>
constexpr BwdKernelEntry make_bwd_entry(const char* name) {
    return kernel_entry<Cfg>(name, &launch_bwd<Cfg>, /*arch=*/90, /*tile_counter=*/false,
                             /*varlen_only=*/Cfg::kVarlen);
}

}  // namespace flash::sm90
