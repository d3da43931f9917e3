// Register fragments of Q, K and V for mma.sync m16n8k16, loaded from shared memory with
// ldmatrix, one k16 slice at a time, and the buffer that holds either every slice (whole block)
// or one/two slices in rotation (sliced, double-buffered).
#pragma once

#include <cstdint>

#include "ptx.cuh"
#include "smem_tile.cuh"

namespace flash {

// One d-slice (16 columns) of this warp's Q rows: an A operand per m16 tile.
template <class Cfg>
struct QFrag {
    uint32_t r[Cfg::kMTiles][4];
};

// One d-slice of a K block: a B operand (16 x 8, keys as columns of B) per n8 tile of S.
template <class Cfg>
struct KFrag {
    uint32_t r[Cfg::kNTilesS][2];
};

// One key-slice (16 keys) of a V block: a B operand per n8 tile of O (d_head columns).
template <class Cfg>
struct VFrag {
    uint32_t r[Cfg::kNTilesO][2];
};

// Per-thread ldmatrix addresses for a walk over k16 slices: lane l reads row r_l at chunk
// 2*step + x_l. Rows vary by multiples of 8 (tiles, pairs) and chunks by 8 every 4 steps, so with
// swizzling the physical chunk is 8*(step/4) + ((2*(step%4) + x_l) ^ (r_l % 8)): four per-thread
// bases, everything else a compile-time offset that folds into the instruction's immediate.
template <class Cfg>
struct LdsmAddr {
    static constexpr uint32_t kRowBytes = Cfg::kChunksPerRow * 16;
    uint32_t base[4];

    __device__ __forceinline__ LdsmAddr(uint32_t tile, int row, int chunk_lo) {
#pragma unroll
        for (int u = 0; u < 4; ++u)
            base[u] = tile + tile_offset<Cfg>(row, 2 * u + chunk_lo);
    }

    // row_off: a compile-time multiple of 8 rows added to this thread's row.
    __device__ __forceinline__ uint32_t operator()(int row_off, int step) const {
        return base[step % 4] + row_off * kRowBytes + (step / 4) * 8 * 16;
    }
};

// Q (A operand): lane l reads row l % 16 of the m16 tile at chunk 2*step + l / 16; the four 8x8
// matrices land as A's {rows 0-7, rows 8-15} x {k 0-7, k 8-15} registers.
template <class Cfg>
__device__ __forceinline__ LdsmAddr<Cfg> q_addr(uint32_t sQ, int warp_row0, int lane) {
    return LdsmAddr<Cfg>(sQ, warp_row0 + lane % 16, lane / 16);
}

template <class Cfg>
__device__ __forceinline__ void load_q_slice(QFrag<Cfg>& f, const LdsmAddr<Cfg>& addr, int step) {
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt)
        ldmatrix_x4(f.r[mt], addr(mt * 16, step));
}

// One x4 load covers two n8 tiles: registers {0, 1} are tile 2*pair's B operand, {2, 3} tile
// 2*pair+1's.
template <int N>
__device__ __forceinline__ void split_pair(uint32_t (&dst)[N][2], int pair,
                                           const uint32_t (&r)[4]) {
    dst[2 * pair][0] = r[0];
    dst[2 * pair][1] = r[1];
    dst[2 * pair + 1][0] = r[2];
    dst[2 * pair + 1][1] = r[3];
}

// K (B operand of S = Q K^T): K rows are keys, so a non-transposed 8x8 load already has B's
// column-major layout. One x4 load covers two n8 tiles: {keys 0-7, keys 8-15} x {d 0-7, d 8-15}.
template <class Cfg>
__device__ __forceinline__ LdsmAddr<Cfg> k_addr(uint32_t sK, int lane) {
    return LdsmAddr<Cfg>(sK, (lane / 16) * 8 + lane % 8, (lane / 8) % 2);
}

template <class Cfg>
__device__ __forceinline__ void load_k_slice(KFrag<Cfg>& f, const LdsmAddr<Cfg>& addr, int step) {
#pragma unroll
    for (int pair = 0; pair < Cfg::kNTilesS / 2; ++pair) {
        uint32_t r[4];
        ldmatrix_x4(r, addr(pair * 16, step));
        split_pair(f.r, pair, r);
    }
}

// V (B operand of O = P V): V rows are keys = the k dimension, so B needs the transposed load.
// Lane l reads key row 16*step + l % 16 at d chunk 2*pair + l / 16; one x4.trans load covers two
// n8 tiles of d. Here the walk is over pairs (chunks) and the step moves rows.
template <class Cfg>
__device__ __forceinline__ LdsmAddr<Cfg> v_addr(uint32_t sV, int lane) {
    return LdsmAddr<Cfg>(sV, lane % 16, lane / 16);
}

template <class Cfg>
__device__ __forceinline__ void load_v_slice(VFrag<Cfg>& f, const LdsmAddr<Cfg>& addr, int step) {
#pragma unroll
    for (int pair = 0; pair < Cfg::kNTilesO / 2; ++pair) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, addr(step * 16, pair));
        split_pair(f.r, pair, r);
    }
}

// Holds the fragments of an operand over kSteps k-slices: all of them (whole block), or one slot
// reused per slice, or two slots alternating so slice s+1 loads while slice s multiplies.
// Indices are compile-time after unrolling, so the slots stay in registers.
template <typename Frag, int kSteps, bool kSliced, bool kDoubleBuffer>
struct FragBuffer {
    static constexpr int kSlots = !kSliced ? kSteps : (kDoubleBuffer ? 2 : 1);
    Frag slots[kSlots];

    __device__ __forceinline__ Frag& slot(int step) {
        return slots[!kSliced ? step : (kDoubleBuffer ? step % 2 : 0)];
    }
};

}  // namespace flash
