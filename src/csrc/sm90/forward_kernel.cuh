// FlashAttention forward on Hopper: TMA copies into 128-byte-swizzled shared memory completing on
// mbarriers, wgmma for S = Q K^T (both operands in shared memory) and O += P V (P from
// registers), a K/V pipeline of kStages stages, and optionally a producer warpgroup with
// setmaxnreg, ping-pong between the consumer warpgroups, softmax overlapped with P V, an
// epilogue through shared memory and a TMA store, Q held in registers (S GEMMs with A from
// registers) and a lazy rescale of O (only when a row's max grows by more than 2^8).
//
// This header is the kernel: it lays out shared memory, initialises the barriers and splits the
// CTA into its roles, each from its own header:
//   forward_params.cuh          the kernel's argument (FwdParams, tile divisors, TMA maps)
//   forward_smem_layout.cuh     buffers and mbarriers in shared memory
//   forward_tile_scheduler.cuh  the CTA's sequence of tiles (static, persistent, dynamic)
//   forward_tile.cuh            a forward tile: its query rows and the KV blocks it visits
//   tma_loader.cuh              TMA tile copies and the wait for a free buffer (the producer's)
//   forward_mainloop.cuh        the producer's loads and a consumer warpgroup's GEMMs, pipeline
//   forward_softmax.cuh         the online softmax of a warpgroup's rows
//   epilogue.cuh                a warpgroup's accumulators out through smem and TMA stores
//   named_barriers.cuh          the named barrier ids of the roles
#pragma once

#include <cstdint>

#include "../common/params.h"
#include "epilogue.cuh"
#include "forward_mainloop.cuh"
#include "forward_params.cuh"
#include "forward_smem_layout.cuh"
#include "forward_tile.cuh"
#include "forward_tile_scheduler.cuh"
#include "ptx.cuh"

namespace flash::sm90 {

// FP8: thread 0 of the producer warpgroup issues the copies as the 16-bit producer does; after
// those of block g every thread transposes block g - 1's V (fp8_v_transpose.cuh), so the copies
// run a block ahead of the transposes. A static schedule: every thread walks the tiles.
// kVarlen: a block holding its sequence's last key keeps its first `keep` keys (the rows past
// them are the next sequence's: zeroed in the transpose, as 0 x inf or NaN is NaN in P V).
template <class Cfg, class Schedule>
__device__ __forceinline__ void fp8_producer(const FwdKernelParams& params,
                                             const ForwardLoader<Cfg>& loader,
                                             const Schedule& schedule) {
    const FwdParams& p = params.p;
    const int pt = threadIdx.x - 32 * Cfg::kConsumerWarps;
    int q_use = 0, g = 0;
    int keep = Cfg::kBc;  // of the block loaded last, transposed after the next one's copies
    for (int tile = schedule.first_tile; tile < schedule.tiles;
         tile = schedule.next(p.tile_counter, tile)) {
        const ForwardTile<Cfg> w(params, tile);
        if (w.n_blocks > 0) {
            if (pt == 0)
                loader.load_q(w, q_use);
            ++q_use;
            for (int i = 0; i < w.n_blocks; ++i) {
                if (pt == 0) {
                    loader.load_k(w, i, g + i);
                    loader.load_v(w, i, g + i);
                }
                if (g + i > 0)
                    loader.transpose_v(g + i - 1, pt, keep);
                if constexpr (Cfg::kVarlen) {
                    const int j = w.kv_block(i), seqlen_k = w.seqlen_k(p);
                    keep = w.kv_tail(j, seqlen_k) ? seqlen_k - j * Cfg::kBc : Cfg::kBc;
                }
            }
            g += w.n_blocks;
        }
    }
    if (g > 0)
        loader.transpose_v(g - 1, pt, keep);
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdKernelParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ unsigned char smem_raw[];
    const SmemLayout<Cfg> sm = SmemLayout<Cfg>::aligned(smem_raw);
    const ForwardLoader<Cfg> loader{{Cfg::kCluster ? int(cluster_ctarank()) : 0}, params, sm};
    const FwdParams& p = params.p;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    using Schedule = TileSchedule<Cfg, SmemLayout<Cfg>>;
    const Schedule schedule = Schedule::template of_cta<ForwardTile<Cfg>>(sm, p);
    const int first_tile = schedule.first_tile, tiles = schedule.tiles;

    if (threadIdx.x == 0) {
        prefetch_tensor_map(&params.tma_q);
        prefetch_tensor_map(&params.tma_k);
        prefetch_tensor_map(&params.tma_v);
        sm.init_barriers();
    }
    // The barriers are initialised and visible to the TMA unit (and to the other CTA, which
    // multicasts into this one and arrives on its empty barriers).
    if constexpr (Cfg::kCluster)
        cluster_sync();
    else
        __syncthreads();

    const bool producer = Cfg::kWarpSpec && warp >= Cfg::kConsumerWarps;
    if (producer && Cfg::kFp8) {
        setmaxnreg_dec<Cfg::kProducerRegs>();
        if constexpr (Cfg::kFp8)
            fp8_producer<Cfg>(params, loader, schedule);
    } else if (producer) {
        setmaxnreg_dec<Cfg::kProducerRegs>();
        if (warp == Cfg::kConsumerWarps && lane == 0) {
            int q_use = 0, g = 0;  // both sides count tiles with work and K/V blocks alike
            int k = 0;             // tiles passed to the consumers (dynamic schedule)
            for (int tile = first_tile; tile < tiles; ++k) {
                schedule.publish(k, tile);
                const ForwardTile<Cfg> w(params, tile);
                if (w.n_blocks > 0) {
                    loader.load_q(w, q_use++);
                    for (int i = 0; i < w.n_blocks; ++i) {
                        loader.load_k(w, i, g + i);
                        loader.load_v(w, i, g + i);
                    }
                    g += w.n_blocks;
                }
                tile = schedule.next(p.tile_counter, tile);
            }
            if constexpr (Cfg::kDynamic)  // the end of the sequence, for the consumers
                schedule.publish(k, tiles);
        }
    } else {
        if constexpr (Cfg::kWarpSpec)
            setmaxnreg_inc<Cfg::kConsumerRegs>();
        ForwardConsumer<Cfg> c{params, sm, loader, warp / 4, warp, lane};
        int q_use = 0, g = 0;
        if constexpr (Cfg::kTileOverlap) {
            // Each tile ends into the next one (its block 0 under this one's last P V), so the
            // next tile is fetched before the current one ends.
            // One call site each of the tile phases: ptxas copies what is inlined.
            int tile = schedule.consumer_tile(0, lane);
            if (tile < tiles) {
                ForwardTile<Cfg> w(params, tile);
                bool begun = false;  // the previous end_into() ran this tile's block 0
                for (int k = 1;; ++k) {
                    if (!begun) {
                        c.start(w, q_use, g);
                        if (w.n_blocks > 0)
                            c.first_block();
                    }
                    c.body();
                    q_use += w.n_blocks > 0;
                    g += w.n_blocks;
                    tile = schedule.consumer_tile(k, lane);
                    const bool more = tile < tiles;
                    const ForwardTile<Cfg> next(params, more ? tile : 0);
                    begun = more && w.n_blocks > 0 && next.n_blocks > 0;
                    if (begun) {
                        c.end_into(next, q_use, g);
                    } else {
                        if (w.n_blocks > 0)
                            c.last_block();
                        c.finish();
                    }
                    if (!more)
                        break;
                    w = next;
                }
            }
        } else {
            // Rotated (the next tile fetched at the end), as ptxas keeps one copy of the body so.
            for (int k = 1, tile = schedule.consumer_tile(0, lane); tile < tiles;
                 tile = schedule.consumer_tile(k++, lane)) {
                const ForwardTile<Cfg> w(params, tile);
                if (!Cfg::kWarpSpec && threadIdx.x == 0 && w.n_blocks > 0) {
                    // The first stages; the rest are refilled as the consumers release them.
                    loader.load_q(w, q_use);
                    for (int i = 0; i < Cfg::kStages && i < w.n_blocks; ++i) {
                        loader.load_k(w, i, g + i);
                        loader.load_v(w, i, g + i);
                    }
                }
                __syncwarp();
                c.run(w, q_use, g);
                q_use += w.n_blocks > 0;
                g += w.n_blocks;
            }
        }
        if constexpr (Cfg::kPersistent)
            Epilogue<Cfg>::wait_stores_read();  // smem stays valid until the last store read it
    }
    if constexpr (Cfg::kCluster)
        cluster_sync();  // the other CTA may still arrive on this one's barriers until it is done
#endif
}

}  // namespace flash::sm90
