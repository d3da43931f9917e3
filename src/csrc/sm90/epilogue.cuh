// The epilogue of one consumer warpgroup (kTmaStore): its 64 rows x d_head accumulator tile
// (fp32, in the wgmma accumulator layout) leaves as 16-bit elements through a shared-memory
// staging buffer and TMA stores. It knows nothing of attention: the caller names the buffer and
// the destination (a tensor map and coordinates), so a kernel that stores other accumulators
// (dK, dV) can reuse it. Without kTmaStore the forward writes O straight from registers
// (ForwardConsumer::write_output).
#pragma once

#include <cstdint>

#include "../common/ldmatrix.cuh"
#include "../common/numeric.cuh"
#include "named_barriers.cuh"
#include "ptx.cuh"

namespace flash::sm90 {

// kTileRows: the CTA's rows in the staging buffer (each 64-column panel is kTileRows x 128
// bytes, the layout of the CTA's TMA tiles); warpgroup wg owns rows 64 wg .. 64 wg + 63, every
// column, or with kSplitCols rows 0 .. 63 and the columns 8 kNO wg .. (its kNO n8 tiles).
template <class Cfg, int kTileRows = Cfg::kBr, bool kSplitCols = false>
struct Epilogue {
    using Elem = typename Cfg::OutElem;  // of the stored tile (16-bit)
    static constexpr int kNO = Cfg::kNTilesO;
    static constexpr int kStorePanels = kSplitCols ? kNO / 8 : Cfg::kOutPanels;
    static_assert(!kSplitCols || (kNO % 8 == 0 && kTileRows == 64), "whole panels of 64 rows");

    const int wg, warp, lane;  // warpgroup among the consumers; warp among the consumer warps

    // Through `buffer` (1024-byte aligned; swizzled as the map's 128-byte swizzle) and TMA stores
    // of this warpgroup's rows to rows row0 + 64 wg .. of (head, batch) of `map` (box: 64
    // columns x 64 rows); rows and columns outside the tensor are not written. On a persistent
    // grid the buffer is reused by the next tile: this call first waits until the previous
    // tile's stores have read it; else it returns once the stores have read it.
    __device__ __forceinline__ void store_tma(const float (&acc)[kNO][4], unsigned char* buffer,
                                              const CUtensorMap* map, int row0, int head,
                                              int batch) const {
        stage(acc, buffer);
        issue_tma(buffer, map, row0, head, batch);
    }

    // The TMA stores of store_tma(), once stage() has filled the buffer.
    __device__ __forceinline__ void issue_tma(unsigned char* buffer, const CUtensorMap* map,
                                              int row0, int head, int batch) const {
        const int row_wg = kSplitCols ? 0 : wg;                 // the warpgroup's 64 rows
        const int panel0 = kSplitCols ? wg * kStorePanels : 0;  // and its first panel
        if (threadIdx.x % 128 == 0) {
#pragma unroll
            for (int c = panel0; c < panel0 + kStorePanels; ++c)
                tma_store_4d(map, buffer + c * kTileRows * 128 + row_wg * 64 * 128, c * 64,
                             row0 + row_wg * 64, head, batch);
            tma_store_commit();
            if constexpr (!Cfg::kPersistent)
                tma_store_wait_read();  // smem stays valid until the store has read it
        }
    }

    // Instead of issue_tma(), once stage() has filled the buffer: the warpgroup's threads copy
    // its rows r < rows (of its 64) and columns < cols (of its panels) out to `out` (16-byte
    // copies from shared memory), row r at out + r * row_stride (elements), out pointing at
    // column 0 of the warpgroup's first row. For rows that end inside the tensor: a varlen
    // sequence's last rows (a TMA store, clipped only at the tensor's end, would write the next
    // sequence's).
    __device__ __forceinline__ void copy_rows(unsigned char* buffer, Elem* out, int64_t row_stride,
                                              int rows, int cols) const {
        const int row_wg = kSplitCols ? 0 : wg;                 // the warpgroup's 64 rows
        const int panel0 = kSplitCols ? wg * kStorePanels : 0;  // and its first panel
        // Element (r, 8 k .. 8 k + 7) of panel c lies in chunk k ^ (r & 7) of its 128-byte row.
        const uint32_t base = smem_u32(buffer) + row_wg * 64 * 128;
        constexpr int kChunks = kStorePanels * 8;  // 16-byte chunks per row
        for (int i = threadIdx.x % 128; i < 64 * kChunks; i += 128) {
            const int r = i / kChunks, c = panel0 + (i % kChunks) / 8, k = i % 8;
            if (r < rows && c * 64 + k * 8 < cols)
                *reinterpret_cast<uint4*>(out + r * row_stride + c * 64 + k * 8) =
                    ld_shared16(base + c * kTileRows * 128 + r * 128 + ((k ^ (r & 7)) * 16));
        }
    }

    // The warpgroup's accumulators into `buffer` (stmatrix, swizzled as a TMA tile), visible to
    // the TMA unit and to every thread of the warpgroup on return; on a persistent grid first
    // waits until the previous tile's stores have read the buffer.
    __device__ __forceinline__ void stage(const float (&acc)[kNO][4], unsigned char* buffer) const {
        if constexpr (Cfg::kPersistent) {
            if (threadIdx.x % 128 == 0)
                tma_store_wait_read();
            named_sync(kEpilogueBarrier + wg, 128);  // the previous tile's rows have been read
        }
        // One stmatrix.x4 per two n8 tiles t, t + 1 (t even): its 8x8 matrices are rows +0
        // and +8 of tile t, then of t + 1; lane l gives the address of row l % 8 of matrix
        // l / 8, CTA row r below, tile t + l / 16. That tile's chunk (t % 8 + l / 16) ^ (r & 7)
        // is (t % 8) ^ (l / 16) ^ (l % 8): the 128-byte-aligned row address with the lane's
        // chunk, XORed with the compile-time (t % 8) * 16.
        const int panel0 = kSplitCols ? wg * kStorePanels : 0;  // the warpgroup's first panel
        const int r = (kSplitCols ? warp % 4 : warp) * 16 + 8 * ((lane / 8) % 2) + lane % 8;
        const uint32_t row = smem_u32(buffer) + panel0 * kTileRows * 128 + r * 128 +
                             (((lane / 16) ^ (lane % 8)) * 16);
#pragma unroll
        for (int t = 0; t < kNO; t += 2) {
            const uint32_t frag[4] = {pack2<Elem>(acc[t][0], acc[t][1]),
                                      pack2<Elem>(acc[t][2], acc[t][3]),
                                      pack2<Elem>(acc[t + 1][0], acc[t + 1][1]),
                                      pack2<Elem>(acc[t + 1][2], acc[t + 1][3])};
            stmatrix_x4((row ^ ((t % 8) * 16)) + (t / 8) * kTileRows * 128, frag);
        }
        fence_proxy_async_smem();                // the TMA store reads what these stores wrote
        named_sync(kEpilogueBarrier + wg, 128);  // ... every thread of the warpgroup has written
    }

    // Before the CTA exits (persistent grid: store_tma() returns before its stores have read
    // the buffer): shared memory stays valid until the last store has read it.
    __device__ __forceinline__ static void wait_stores_read() {
        if (threadIdx.x % 128 == 0)
            tma_store_wait_read();
    }
};

}  // namespace flash::sm90
