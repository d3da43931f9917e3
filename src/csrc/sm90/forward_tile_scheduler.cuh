// The tile scheduler: which tiles a CTA works on, in which order, and what (block, head, batch) a
// tile number stands for. A tile is one block of rows of the sequence the grid splits (query
// rows in the forward) of one (batch, head); what a kernel does with it is its own business.
//
// Tiles are numbered block fastest (neighbouring tiles share K and V in L2). With kCluster a tile
// is a pair of neighbouring blocks, 2t + rank for the CTA of that rank in its cluster (with an
// odd count the last pair's second block lies past the sequence: it is computed, never stored).
// The dynamic schedule numbers them in groups of sched_heads (batch, head) pairs whose K and V
// fit in L2 together; inside a group, blocks from the heaviest down (where the counter hands them
// out first), heads fastest.
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace flash::sm90 {

// Where a tile lies: its block along the split sequence, its (batch, head) and the KV head that
// head reads (GQA/MQA).
struct TileCoord {
    int block, head, kv_head, batch;
};

// Tile number -> coordinates; `blocks` is the number of blocks per (batch, head). Params is the
// kernel's argument: prm.tiles_per_head, prm.heads, prm.heads_per_kv (FastDiv, from the
// launcher), prm.sched_heads (kDynamic) and prm.p.batch, prm.p.heads. kHeavyLast: the last block
// of a (batch, head) carries the most work (query blocks under a causal mask), so the masked
// static order and the dynamic order run from the last block down; else from the first up.
template <class Cfg, bool kHeavyLast, class Params>
__device__ __forceinline__ TileCoord tile_coord(const Params& prm, int tile, int blocks) {
    TileCoord c;
    int pair;  // batch * heads + head
    if constexpr (!Cfg::kDynamic) {
        pair = prm.tiles_per_head.div(tile);
        const int in = tile - pair * prm.tiles_per_head.d;
        if constexpr (Cfg::kCluster)
            c.block = Cfg::kClusterCtas * in + int(cluster_ctarank());
        else
            c.block = Cfg::kMask && kHeavyLast ? blocks - 1 - in : in;
    } else {
        const int per_group = prm.sched_heads * blocks;
        const int group = tile / per_group, in = tile % per_group;
        const int heads_in =
            min(prm.sched_heads, prm.p.batch * prm.p.heads - group * prm.sched_heads);
        c.block = kHeavyLast ? blocks - 1 - in / heads_in : in / heads_in;
        pair = group * prm.sched_heads + in % heads_in;
    }
    c.batch = prm.heads.div(pair);
    c.head = pair - c.batch * prm.p.heads;
    c.kv_head = prm.heads_per_kv.div(c.head);
    return c;
}

// The CTA's sequence of tiles, k = 0, 1, ...: static, first_tile + k * step (every gridDim.x-th
// on a persistent grid, else only its own); dynamic, first_tile and then what the producer draws
// from the launch's counter, handed to the consumers through two shared-memory slots (Layout:
// tile_full(i), tile_empty(i), tile_slot(i), i = 0, 1). A tile number >= tiles ends the
// sequence.
template <class Cfg, class Layout>
struct TileSchedule {
    const Layout& sm;
    int tiles, first_tile, step;

    // The CTA's schedule over the launch's Tile::tiles(params) tiles (of its cluster with
    // kCluster, whose CTAs share the tile): its own (grid = tiles), or every (gridDim.x / cluster
    // size)-th (persistent).
    template <class Tile, class Params>
    __device__ __forceinline__ static TileSchedule of_cta(const Layout& sm, const Params& params) {
        const int clusters_x = gridDim.x / Cfg::kClusterCtas;
        const int first_tile =
            blockIdx.x / Cfg::kClusterCtas + clusters_x * (blockIdx.y + gridDim.y * blockIdx.z);
        const int tiles = Tile::tiles(params);
        return TileSchedule{sm, tiles, first_tile, Cfg::kPersistent ? clusters_x : tiles};
    }

    // Producer: passes tile k to the consumers (dynamic; nothing to pass for a static one).
    // Slot k % 2 is reused once the consumers have read tile k - 2 from it.
    __device__ __forceinline__ void publish(int k, int tile) const {
        if constexpr (Cfg::kDynamic) {
            const int slot = k % 2;
            if (k >= 2)
                mbar_wait(sm.tile_empty(slot), (k / 2 - 1) & 1);
            *sm.tile_slot(slot) = tile;
            mbar_arrive(sm.tile_full(slot));
        }
    }
    // Producer: the tile after `tile`; `counter` is the launch's zeroed tile counter (kDynamic).
    __device__ __forceinline__ int next(int* counter, int tile) const {
        if constexpr (Cfg::kDynamic)
            return atomicAdd(counter, 1) + int(gridDim.x);
        return tile + step;
    }
    // Consumers (every thread, in order of k): tile k.
    __device__ __forceinline__ int consumer_tile(int k, int lane) const {
        if constexpr (Cfg::kDynamic) {
            const int slot = k % 2;
            mbar_wait(sm.tile_full(slot), (k / 2) & 1);  // slot k % 2 holds tile k
            // Lane 0's copy for the whole warp, so that ptxas sees a warp-uniform loop (else it
            // keeps a divergent copy of the loop body beside the convergent one).
            const int tile = __shfl_sync(0xffffffffu, *sm.tile_slot(slot), 0);
            if (lane == 0)
                mbar_arrive(sm.tile_empty(slot));
            return tile;
        } else {
            return first_tile + k * step;
        }
    }
};

}  // namespace flash::sm90
