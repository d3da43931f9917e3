// The producer's tools: TMA copies of whole tiles (64-column panels, 128-byte swizzled) into
// shared memory, completing on an mbarrier, optionally split across the CTAs of a cluster and
// multicast, and the wait for a buffer the consumers have released. Nothing here knows which
// tensors a kernel loads (the forward's loads: ForwardLoader in forward_mainloop.cuh).
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace flash::sm90 {

// Producer: waits until a buffer may be refilled for its use `use` (the first use needs no
// wait): its empty barrier has completed use - 1, i.e. the consumers (of both CTAs with a cluster)
// have released what they read. A CTA-scope wait: the producer reads nothing they wrote, it only
// orders its next copy after their reads.
__device__ __forceinline__ void wait_buffer_free(uint64_t* empty, int use) {
    if (use > 0)
        mbar_wait(empty, (use - 1) & 1);
}

// Producer: copies of whole tiles, kRows rows x Cfg::kPanels panels of 128 bytes a row
// (Cfg::kPanelCols columns: 64 of 16-bit elements, 128 of FP8; panel c at
// dst + c * kRows * 128 bytes), tile `block` being rows row_start + block * kRows .. of (head,
// batch) of a 4-D tensor map (d_head, rows, heads, batch) (row_start: a varlen sequence's first
// row in the packed tensor).
template <class Cfg>
struct TmaLoader {
    const int rank;  // this CTA's rank in its cluster (0 without kCluster)

    // Arms `full` with the tile's bytes, then issues the copies, which complete on it.
    // kShared: every CTA of the cluster needs the tile; this CTA copies its 1 / kClusterCtas of
    // the rows and multicasts them into the same offsets of every CTA (with kCluster; else it
    // copies the whole tile), so each CTA's full barrier still expects the whole tile.
    template <int kRows, bool kShared>
    __device__ __forceinline__ void load_tile(unsigned char* dst, const CUtensorMap* map,
                                              uint64_t* full, int block, int head, int batch,
                                              int row_start = 0) const {
        mbar_arrive_expect_tx(full, kRows * Cfg::kPanels * 128);
        // This CTA's rows: a multiple of 8, so its part of each panel stays 1024-byte aligned.
        constexpr int kPart = kShared ? kRows / Cfg::kClusterCtas : kRows;
        const int row0 = row_start + block * kRows + (kShared ? rank * kPart : 0);
#pragma unroll
        for (int c = 0; c < Cfg::kPanels; ++c) {
            unsigned char* panel = dst + c * kRows * 128 + (kShared ? rank * kPart * 128 : 0);
            if constexpr (kShared && Cfg::kCluster)
                tma_load_4d_multicast(panel, map, full, uint16_t((1u << Cfg::kClusterCtas) - 1),
                                      c * Cfg::kPanelCols, row0, head, batch);
            else
                tma_load_4d(panel, map, full, c * Cfg::kPanelCols, row0, head, batch);
        }
    }
};

// Rows keep .. kRows - 1 of a tile as load_tile() lays it out (kPanels 64-column panels of
// kRows x 128 bytes) zeroed by the 128 threads of a warpgroup: whole 128-byte rows of every
// panel (the swizzle permutes chunks within a row). Thread t: chunk t % 8 of rows t / 8 + 16 r.
// The caller orders the zeros before the async proxy's reads (fence_proxy_async_smem and a
// barrier of the warpgroup).
template <int kRows, int kPanels>
__device__ __forceinline__ void zero_rows(unsigned char* tile, int keep) {
    const int t = threadIdx.x % 128;
    const uint32_t chunk = smem_u32(tile) + (t / 8) * 128 + (t % 8) * 16;
#pragma unroll
    for (int r = 0; r < kRows; r += 16)
        if (t / 8 + r >= keep)
#pragma unroll
            for (int c = 0; c < kPanels; ++c)
                st_shared_zero16(chunk + (c * kRows + r) * 128);
}

}  // namespace flash::sm90
