// How dQ leaves the Hopper backward (the algorithm: backward_config.cuh): the writer warp of
// the producer warpgroup adds each block's fp32 dQ, as the consumer warpgroups hand it over in
// shared memory (named barriers kBwdDqFull + g, kBwdDqEmpty + g), to the accumulator with bulk
// reduce-adds, in a fixed order for deterministic calls.
#pragma once

#include <cstdint>

#include "../common/backward_common.cuh"
#include "../common/params.h"
#include "backward_config.cuh"
#include "backward_tile.cuh"
#include "named_barriers.cuh"
#include "ptx.cuh"

namespace flash::sm90 {

// The writer warp: each block's dQ, part by part as the consumer warpgroups store it, added to
// the fp32 accumulator with one bulk reduce-add per part (the block's B_r x d_head floats are
// contiguous there, in the consumers' order: part h of warpgroup g, 64 columns, at
// (g kDqParts + h) B_r 64 floats; with kDqOwnKeys each warpgroup's partial sum over all the
// columns, at 0). Parts go in the order h, then g. A warpgroup's buffer is released when the
// reduction has read it; the last part's release has no taker and is skipped. The
// deterministic order (dq_semaphore): the reductions of a block wait for its turn
// (BackwardTile::dq_turn), own-key partials one after the other, and the turn passes on when
// they have completed.
template <class Cfg>
struct BackwardDqWriter {
    const BwdKernelParams& prm;
    const BwdSmem<Cfg>& sm;
    const int lane;

    __device__ __forceinline__ void run(const BackwardTile<Cfg>& w) const {
        // Two loops, so that the default one carries no test of the order. kSplitD without the
        // order: the consumers add dQ themselves (BackwardConsumer::hand_dq).
        if (prm.p.dq_semaphore != nullptr)
            loop<true>(w);
        else if constexpr (!Cfg::kSplitD)
            loop<false>(w);
    }

    __device__ __forceinline__ static void release_buffers() {
#pragma unroll
        for (int g = 0; g < Cfg::kConsumerWGs; ++g)
            named_arrive(kBwdDqEmpty + g, 128 + 32);
    }

    template <bool kOrdered>
    __device__ __forceinline__ void loop(const BackwardTile<Cfg>& w) const {
        constexpr int kSync = 128 + 32;
        constexpr uint32_t kPartBytes = Cfg::kDqBytes / Cfg::kConsumerWGs;
        const BwdParams& p = prm.p;
        auto x = w.first(p.heads_per_kv);
        for (int t = 0; t < w.n; ++t, w.advance(x)) {
            const typename BackwardTile<Cfg>::Pair b{x.head, w.block_at(prm, x.i)};
            float* acc = p.dq_accum + w.padded_row(p, b) * Cfg::kDHead;
            int* sem = nullptr;
            if (kOrdered && lane == 0) {
                int turn;
                sem = BackwardTile<Cfg>::dq_turn(prm, b, turn);
                while (bwd::ld_acquire(sem) != turn) {
                }
                fence_proxy_async_global();  // the earlier KV blocks' additions come first
            }
#pragma unroll
            for (int h = 0; h < Cfg::kDqParts; ++h) {
#pragma unroll
                for (int g = 0; g < Cfg::kConsumerWGs; ++g) {
                    named_sync(kBwdDqFull + g, kSync);
                    if (lane == 0) {
                        float* dst = Cfg::kDqOwnKeys
                                         ? acc
                                         : acc + (g * Cfg::kDqParts + h) * (kPartBytes / 4);
                        bulk_reduce_add_f32(dst, sm.dq(g), kPartBytes);
                        tma_store_commit();
                        if (Cfg::kDqOwnKeys && kOrdered && g + 1 < Cfg::kConsumerWGs)
                            bulk_wait_all();  // the partials add in a fixed order too
                    }
                }
                if (h + 1 < Cfg::kDqParts) {  // the buffers take the block's next parts
                    if (lane == 0)
                        tma_store_wait_read();
                    __syncwarp();
                    release_buffers();
                }
            }
            if (lane == 0) {
                if (kOrdered) {
                    bulk_wait_all();
                    fence_proxy_async_global();
                    bwd::red_release_add(sem, 1);  // the next KV block's turn
                } else {
                    tma_store_wait_read();
                }
            }
            __syncwarp();
            if (t + 1 < w.n)
                release_buffers();
        }
        if (lane == 0)
            bulk_wait_all();
    }
};

}  // namespace flash::sm90
