// Warp-level products of the backward on mma.sync m16n8k16 (fp32 accumulators), with operand
// fragments loaded by ldmatrix from the swizzled smem tiles in the four ways the backward needs:
//   A row-major (rows of the tile are m, k runs along them):   K, V in phase 1; P^T, dS^T in 2
//   A transposed (rows of the tile are k, m runs along them):  dS from the dS^T tile in phase 3
//   B "col-major" (rows are n, k runs along them):             Q, dO in phase 1
//   B transposed (rows are k, n runs along them):              dO, Q in phase 2; K in phase 3
// Each is an LdsmAddr walk (sm80/fragments.cuh): lane l's row and chunk are set once, tiles
// and k-steps are compile-time offsets. `Tile` is a layout: kChunksPerRow and kSwizzle.
#pragma once

#include <cstdint>

#include "fragments.cuh"
#include "ptx.cuh"

namespace flash::sm80 {

template <int kMT>
struct AFrag {
    uint32_t r[kMT][4];
};

// A, row-major: the warp's m rows start at tile row `row0`, its k columns at chunk `chunk0`.
template <class Tile, int kMT>
struct LoadA {
    LdsmAddr<Tile> at;
    __device__ __forceinline__ LoadA(uint32_t tile, int row0, int chunk0, int lane)
        : at(tile, row0 + lane % 16, chunk0 + lane / 16) {}
    __device__ __forceinline__ void operator()(AFrag<kMT>& f, int step) const {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
            ldmatrix_x4(f.r[mt], at(mt * 16, step));
    }
};

// A, transposed: the tile's rows are k (from row 0), its m columns start at chunk `chunk0`.
// Lanes 0-7 give rows k 0-7 at m chunk 0 (A's rows 0-7, k 0-7), lanes 8-15 the same rows at
// m chunk 1 (rows 8-15), lanes 16-31 rows k 8-15 likewise.
template <class Tile, int kMT>
struct LoadATrans {
    LdsmAddr<Tile> at;
    __device__ __forceinline__ LoadATrans(uint32_t tile, int chunk0, int lane)
        : at(tile, (lane / 16) * 8 + lane % 8, chunk0 + (lane / 8) % 2) {}
    __device__ __forceinline__ void operator()(AFrag<kMT>& f, int step) const {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
            ldmatrix_x4_trans(f.r[mt], at(step * 16, mt));
    }
};

// B, rows are n: the warp's n rows start at tile row `row0`, k at chunk `chunk0`. One x4 load
// covers two n8 tiles: {n 0-7, n 8-15} x {k 0-7, k 8-15}.
template <class Tile, int kNT>
struct LoadB {
    LdsmAddr<Tile> at;
    __device__ __forceinline__ LoadB(uint32_t tile, int row0, int chunk0, int lane)
        : at(tile, row0 + (lane / 16) * 8 + lane % 8, chunk0 + (lane / 8) % 2) {}
    static constexpr int kPairs = kNT / 2;
    // n8 tiles 2*pair and 2*pair+1 of k-step `step`: registers {0, 1} and {2, 3}.
    __device__ __forceinline__ void pair(uint32_t (&r)[4], int step, int pair) const {
        ldmatrix_x4(r, at(pair * 16, step));
    }
};

// B, transposed: the tile's rows are k (from row 0), the warp's n columns start at chunk
// `chunk0`; one x4.trans load covers two n8 tiles.
template <class Tile, int kNT>
struct LoadBTrans {
    LdsmAddr<Tile> at;
    __device__ __forceinline__ LoadBTrans(uint32_t tile, int chunk0, int lane)
        : at(tile, lane % 16, chunk0 + lane / 16) {}
    static constexpr int kPairs = kNT / 2;
    __device__ __forceinline__ void pair(uint32_t (&r)[4], int step, int pair) const {
        ldmatrix_x4_trans(r, at(step * 16, pair));
    }
};

template <int kMT, int kNT>
__device__ __forceinline__ void zero(float (&acc)[kMT][kNT][4]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                acc[mt][nt][e] = 0.f;
}

// acc += A B over kSteps k16 steps. B is loaded a pair of n8 tiles at a time, the pair after
// next in flight while the MMAs of this one run, so only two x4 fragments of B are live (a
// whole k-step of B for d_head 128 columns would hold 64 registers); A of step s+1 loads before
// the MMAs of step s.
template <typename Elem, int kSteps, int kMT, int kNT, class LA, class LB>
__device__ __forceinline__ void warp_gemm(float (&acc)[kMT][kNT][4], const LA& load_a,
                                          const LB& load_b) {
    constexpr int kPairs = kNT / 2;
    AFrag<kMT> a[2];
    uint32_t b[2][4];
    load_a(a[0], 0);
    load_b.pair(b[0], 0, 0);
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
        if (s + 1 < kSteps)
            load_a(a[(s + 1) % 2], s + 1);
#pragma unroll
        for (int pr = 0; pr < kPairs; ++pr) {
            const int idx = s * kPairs + pr;
            if (idx + 1 < kSteps * kPairs)
                load_b.pair(b[(idx + 1) % 2], (idx + 1) / kPairs, (idx + 1) % kPairs);
            const uint32_t (&r)[4] = b[idx % 2];
            const uint32_t lo[2] = {r[0], r[1]}, hi[2] = {r[2], r[3]};
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                mma_16816<Elem>(acc[mt][2 * pr], a[s % 2].r[mt], lo);
                mma_16816<Elem>(acc[mt][2 * pr + 1], a[s % 2].r[mt], hi);
            }
        }
    }
}

}  // namespace flash::sm80
