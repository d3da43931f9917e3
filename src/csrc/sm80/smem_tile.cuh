// Shared-memory tiles of (rows x d_head) elements stored as 16-byte chunks, and the copies between
// them and global memory. With swizzling, chunk c of row r lives at chunk c ^ (r % 8): the 8 rows
// one ldmatrix reads then hit 8 different bank groups instead of one.
//
// Addresses are split into a per-thread part computed once and a compile-time part that folds
// into instruction immediates; this keeps the many tile addresses out of registers.
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace flash {

template <class Cfg>
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
    const int c = Cfg::kSwizzle ? (chunk ^ (row & 7)) : chunk;
    return uint32_t(row * Cfg::kChunksPerRow + c) * 16u;
}

// A kRows-row tile copy split over the CTA: thread t copies chunk (t % chunks_per_row) of rows
// t / chunks_per_row + pass * kRowsPerPass. kRowsPerPass is a multiple of 8, so a thread's
// swizzle (row % 8) is the same in every pass and its smem offsets differ by constants.
// Columns: chunks past the variant's d_head (smem row padding) are never read and not copied;
// chunks past the tensors' d_head (a smaller d_head run on this variant) are zero-filled, so the
// MMAs over them add exact zeros.
template <class Cfg, int kRows>
struct TileCopy {
    static constexpr int kRowsPerPass = Cfg::kThreads / Cfg::kChunksPerRow;
    static constexpr int kPasses = kRows / kRowsPerPass;
    static constexpr uint32_t kPassBytes = kRowsPerPass * Cfg::kChunksPerRow * 16;
    static_assert(Cfg::kThreads % Cfg::kChunksPerRow == 0 && kRowsPerPass % 8 == 0,
                  "a copy pass must cover whole rows in multiples of 8");
    static_assert(kRows % kRowsPerPass == 0, "tile copy must split evenly over threads");

    int row;            // this thread's first row
    uint32_t smem_off;  // byte offset of (row, chunk) in the tile
    bool in_tile;       // the chunk is one the MMAs read (not smem row padding)
    bool in_tensor;     // ... and inside the tensors' d_head
    int64_t gmem_off;   // element offset of (row, chunk) from the tile's first row; of (row, 0)
                        // when the chunk is outside the tensor (a valid address, never read)
    int64_t pass_step;  // elements between passes: kRowsPerPass rows

    __device__ __forceinline__ TileCopy(int tid, int64_t row_stride, int d_head)
        : row(tid / Cfg::kChunksPerRow),
          smem_off(tile_offset<Cfg>(tid / Cfg::kChunksPerRow, tid % Cfg::kChunksPerRow)),
          in_tile(Cfg::kDataChunks == Cfg::kChunksPerRow ||
                  tid % Cfg::kChunksPerRow < Cfg::kDataChunks),
          in_tensor((tid % Cfg::kChunksPerRow) * Cfg::kChunkElems < d_head),
          gmem_off(row * row_stride +
                   (in_tensor ? (tid % Cfg::kChunksPerRow) * Cfg::kChunkElems : 0)),
          pass_step(kRowsPerPass * row_stride) {}

    // Issue the async copies; rows >= valid_rows are zero-filled (so tails of Q, K and V add exact
    // zeros, never stale smem). Row 0 of a tile is always valid: tiles start inside the tensor.
    __device__ __forceinline__ void issue(uint32_t smem_tile, const typename Cfg::Elem* gmem_tile,
                                          int valid_rows) const {
        if (!in_tile)
            return;
        const typename Cfg::Elem* src = gmem_tile + gmem_off;
        if (valid_rows >= kRows) {  // a whole tile (every block but a tail): no row predicates
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
                cp_async_16(smem_tile + smem_off + pass * kPassBytes, src, in_tensor);
                src += pass_step;
            }
            return;
        }
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const bool valid = in_tensor && row + pass * kRowsPerPass < valid_rows;
            cp_async_16(smem_tile + smem_off + pass * kPassBytes, valid ? src : gmem_tile, valid);
            src += pass_step;
        }
    }
};

// One warp writes its kRowsPerWarp rows (starting at tile row `row0`) from smem to global with
// 16-byte streaming stores; rows >= valid_rows (relative to row0) and columns >= d_head are not
// written.
template <class Cfg>
__device__ __forceinline__ void store_warp_rows(const unsigned char* smem_tile, int row0,
                                                typename Cfg::Elem* gmem, int64_t row_stride,
                                                int valid_rows, int d_head, int lane) {
    constexpr int kChunks = Cfg::kRowsPerWarp * Cfg::kChunksPerRow;
    static_assert(kChunks % 32 == 0, "warp store must split evenly over lanes");
#pragma unroll
    for (int t = 0; t < kChunks / 32; ++t) {
        const int idx = t * 32 + lane;
        const int row = idx / Cfg::kChunksPerRow;
        const int chunk = idx % Cfg::kChunksPerRow;
        if (row < valid_rows && chunk * Cfg::kChunkElems < d_head) {
            const uint4 val =
                *reinterpret_cast<const uint4*>(smem_tile + tile_offset<Cfg>(row0 + row, chunk));
            __stcs(reinterpret_cast<uint4*>(gmem + row * row_stride + chunk * Cfg::kChunkElems),
                   val);
        }
    }
}

}  // namespace flash
