// One tile of the Hopper forward: a query block of one (batch, head) (coordinates from the tile
// scheduler), its query rows, the KV blocks it visits, the order it visits them in, and which of
// them need a mask.
#pragma once

#include "../common/mask.cuh"
#include "../common/params.h"
#include "forward_params.cuh"
#include "forward_tile_scheduler.cuh"

namespace flash::sm90 {

template <class Cfg>
struct ForwardTile : TileCoord {  // block: the query block
    int q_row0;                   // first query row of the tile
    KvBlocks kv;
    int n_blocks;

    __host__ __device__ __forceinline__ static int q_blocks(const FwdParams& p) {
        return (p.seqlen_q + Cfg::kBr - 1) / Cfg::kBr;
    }
    // Query blocks per (batch, head) in tile numbers: pairs with kCluster (the launcher's too).
    __host__ __device__ __forceinline__ static int tiles_per_head(const FwdParams& p) {
        return (q_blocks(p) + Cfg::kClusterCtas - 1) / Cfg::kClusterCtas;
    }
    __device__ __forceinline__ static int tiles(const FwdParams& p) {
        return tiles_per_head(p) * p.heads * p.batch;
    }

    ForwardTile() = default;
    // With a causal mask the last query block sees the most keys: heaviest last.
    __device__ __forceinline__ ForwardTile(const FwdKernelParams& prm, int tile)
        : TileCoord(tile_coord<Cfg, /*kHeavyLast=*/true>(prm, tile, q_blocks(prm.p))) {
        const FwdParams& p = prm.p;
        q_row0 = block * Cfg::kBr;
        if constexpr (Cfg::kMask) {
            kv = window_blocks<Cfg::kBr, Cfg::kBc>(p, p.seqlen_q, p.seqlen_k, q_row0);
            n_blocks = kv.count();
        } else {
            kv = KvBlocks{0, (p.seqlen_k + Cfg::kBc - 1) / Cfg::kBc - 1, 0, 0};
            n_blocks = kv.last + 1;
        }
    }
    // Visit order: the i-th block visited is the last block but i (with a causal mask the last
    // holds the diagonal, so the row maxima are known early).
    __device__ __forceinline__ int kv_block(int i) const { return kv.last - i; }
    __device__ __forceinline__ bool needs_mask(int j, int seqlen_k) const {
        if constexpr (Cfg::kMask)
            return kv.needs_mask(j);
        return (j + 1) * Cfg::kBc > seqlen_k;
    }
};

}  // namespace flash::sm90
