// The decode kernel's matrix products over an FP8 KV cache (DecConfig with an e4m3 or e5m2
// CacheElem): K and V stay FP8 in shared memory (half the bytes of a 16-bit cache, which is the
// point: a decode step is bound by reading them) and become fp16 fragment by fragment, right
// before their mma.sync (one conversion instruction per two values: every e4m3 and e5m2 value
// is an fp16 one). Both products run in fp16 whatever q's dtype: a bf16 Q tile is scaled by a
// power of two into fp16's range first (scale_q_to_fp16, exact but for values 2^24 below the
// tile's largest), and P (<= 1) is packed as fp16. The caller folds the descales and Q's scale
// into the softmax scale (k's) and the final normalisation (v's).
//
// ldmatrix moves 16-bit elements, so an FP8 tile is read as pairs of bytes and the contraction
// dimensions are permuted to fit (a permutation of a sum's terms changes nothing):
//   S = Q K^T: a non-transposed load of 8 keys x 16 bytes gives lane (g, t) (g = lane / 4,
//     t = lane % 4) key g's dims 4t..4t+3 of the 16-dim chunk, which serve as B's k slots 2t,
//     2t+1, 2t+8, 2t+9. Q's A fragment follows the same order: lane (g, t) loads Q[g][4t..4t+3]
//     (8 bytes) as its slots {2t, 2t+1} and {2t+8, 2t+9} (load_q_fp8_order).
//   O = P V: keys keep their order (P's registers are S's); a transposed load of 8 keys x 16
//     bytes gives lane (g, t) dims 2g, 2g+1 of keys 2t and 2t+1; a byte permute of the loads of
//     keys 0-7 and 8-15 gives B's fragment of dim 2g (keys 2t, 2t+1, 2t+8, 2t+9) and of dim
//     2g+1. So O's n8 tile 2h holds the even dims of d chunk h and tile 2h+1 the odd ones: lane
//     (g, t)'s accumulators are dims 16h + 4t + {0, 2} and {1, 3} (the merge in
//     decode_kernel.cuh writes them so).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "../common/numeric.cuh"
#include "ptx.cuh"
#include "smem_tile.cuh"

namespace flash::sm80 {

// Byte offset of 16-byte chunk `chunk` of row `row` in an FP8 K or V tile (rows of kKVRowBytes).
// Rows of 128 bytes or more: chunk ^ (row % 8), as the 16-bit tiles. Rows of 64 bytes (d_head
// 64): two rows share a 128-byte line, so chunk ^ ((row / 2) % 4); either way the 8 rows one
// ldmatrix reads hit 8 different bank groups.
template <class Cfg>
__device__ __forceinline__ uint32_t fp8_tile_offset(int row, int chunk) {
    const int c = Cfg::kKVRowBytes >= 128 ? (chunk ^ (row & 7)) : (chunk ^ ((row >> 1) & 3));
    return uint32_t(row * Cfg::kKVRowBytes + c * 16);
}

// Two FP8 values (the low and high byte of `pair`) as one packed half2 register (low: the
// first). sm_89 and newer: one cvt; sm_80: cuda_fp8.h's conversion in integer instructions.
template <typename CacheElem>
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint16_t pair) {
    constexpr __nv_fp8_interpretation_t kind =
        std::is_same_v<CacheElem, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, kind);
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// A bf16 Q tile (kBr rows in smem, swizzled 16-byte chunks) rewritten in place as fp16 times
// 2^k, k chosen so the tile's largest |q| lands in [2^14, 2^15) (fp16 holds 65504); returns
// 2^-k, the factor the scores must take back. All threads of the CTA call it (two barriers);
// Q must have landed. An all-zero (or non-finite) tile keeps k = 0.
template <class Cfg>
__device__ __forceinline__ float scale_q_to_fp16(uint32_t sQ) {
    __shared__ float warp_max[Cfg::kWarps];
    constexpr int kChunks = Cfg::kBr * Cfg::kChunksPerRow;
    float mx = 0.f;
    for (int idx = threadIdx.x; idx < kChunks; idx += Cfg::kThreads) {
        uint32_t w[4];
        asm volatile(
            "ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
            : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
            : "r"(sQ + tile_offset<Cfg>(idx / Cfg::kChunksPerRow, idx % Cfg::kChunksPerRow)));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
            mx = fmaxf(mx, fmaxf(fabsf(f.x), fabsf(f.y)));
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (threadIdx.x % 32 == 0)
        warp_max[threadIdx.x / 32] = mx;
    __syncthreads();  // every warp's maximum is in warp_max
#pragma unroll
    for (int i = 0; i < Cfg::kWarps; ++i)
        mx = fmaxf(mx, warp_max[i]);
    int k = 0;
    if (mx > 0.f && isfinite(mx)) {
        const int e = ((__float_as_int(mx) >> 23) & 0xff) - 127;  // mx in [2^e, 2^(e+1))
        k = min(max(14 - e, -126), 126);
    }
    const float up = __int_as_float((127 + k) << 23);
    for (int idx = threadIdx.x; idx < kChunks; idx += Cfg::kThreads) {
        const uint32_t at =
            sQ + tile_offset<Cfg>(idx / Cfg::kChunksPerRow, idx % Cfg::kChunksPerRow);
        uint32_t w[4];
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                     : "r"(at));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
            w[i] = pack2<__half>(f.x * up, f.y * up);
        }
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(w[0]), "r"(w[1]),
                     "r"(w[2]), "r"(w[3])
                     : "memory");
    }
    __syncthreads();  // the fp16 tile is complete before any warp loads its fragments
    return __int_as_float((127 - k) << 23);
}

// Q's A fragment of d chunk `step` (16 dims) in the FP8 k-slot order: rows g and g + 8 of the
// 16-bit Q tile, dims 16 step + 4t .. +3 (8 bytes, inside one 16-byte chunk).
template <class Cfg>
__device__ __forceinline__ void load_q_fp8_order(uint32_t (&a)[4], uint32_t sQ, int lane,
                                                 int step) {
    const int g = lane / 4, t = lane % 4;
    const uint32_t in_chunk = (t % 2) * 8;
    const int chunk = 2 * step + t / 2;
    uint32_t lo0, hi0, lo8, hi8;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n"
                 : "=r"(lo0), "=r"(hi0)
                 : "r"(sQ + tile_offset<Cfg>(g, chunk) + in_chunk));
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n"
                 : "=r"(lo8), "=r"(hi8)
                 : "r"(sQ + tile_offset<Cfg>(g + 8, chunk) + in_chunk));
    a[0] = lo0;  // row g, slots 2t, 2t+1
    a[1] = lo8;  // row g + 8
    a[2] = hi0;  // row g, slots 2t+8, 2t+9
    a[3] = hi8;
}

// The Q fragments of every d chunk, resident for the whole CTA (d_head <= 128), or none (d_head
// 256: reloaded per chunk, as the 16-bit path slices Q).
template <class Cfg>
struct QFp8Order {
    static constexpr int kSlots = Cfg::kSliceQ ? 1 : Cfg::kStepsQK;
    uint32_t r[kSlots][4];

    __device__ __forceinline__ void load_all(uint32_t sQ, int lane) {
        if constexpr (!Cfg::kSliceQ) {
#pragma unroll
            for (int s = 0; s < Cfg::kStepsQK; ++s)
                load_q_fp8_order<Cfg>(r[s], sQ, lane, s);
        }
    }

    __device__ __forceinline__ const uint32_t (&step(int s, uint32_t sQ, int lane))[4] {
        if constexpr (Cfg::kSliceQ) {
            load_q_fp8_order<Cfg>(r[0], sQ, lane, s);
            return r[0];
        } else {
            return r[s];
        }
    }
};

// S = Q K^T over an FP8 K block in smem (sK): per d chunk, x4 loads of 32 keys (four n8 tiles).
template <class Cfg>
__device__ __forceinline__ void gemm_qk_fp8(float (&S)[1][Cfg::kNTilesS][4], QFp8Order<Cfg>& q,
                                            uint32_t sQ, uint32_t sK, int lane) {
    using CacheElem = typename Cfg::CacheElem;
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            S[0][nt][e] = 0.f;
#pragma unroll
    for (int s = 0; s < Cfg::kStepsQK; ++s) {
        const uint32_t (&a)[4] = q.step(s, sQ, lane);
#pragma unroll
        for (int quad = 0; quad < Cfg::kNTilesS / 4; ++quad) {
            uint32_t r[4];  // n8 tile 4 quad + m: key 8m + g, dims 16s + 4t .. +3
            ldmatrix_x4(r, sK + fp8_tile_offset<Cfg>(32 * quad + lane, s));
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const uint32_t b[2] = {fp8x2_to_half2<CacheElem>(uint16_t(r[m] & 0xffffu)),
                                       fp8x2_to_half2<CacheElem>(uint16_t(r[m] >> 16))};
                mma_16816<__half>(S[0][4 * quad + m], a, b);
            }
        }
    }
}

// O += P V over an FP8 V block in smem (sV): per k16 step of keys, x4 transposed loads of 16
// keys x two d chunks; O's tiles 2h / 2h+1 are d chunk h's even / odd dims.
template <class Cfg>
__device__ __forceinline__ void gemm_pv_fp8(float (&O)[1][Cfg::kNTilesO][4],
                                            const float (&P)[1][Cfg::kNTilesS][4], uint32_t sV,
                                            int lane) {
    using CacheElem = typename Cfg::CacheElem;
    constexpr int kChunks = Cfg::kDHead / 16;
#pragma unroll
    for (int s = 0; s < Cfg::kStepsPV; ++s) {
        const uint32_t pa[4] = {pack2<__half>(P[0][2 * s][0], P[0][2 * s][1]),
                                pack2<__half>(P[0][2 * s][2], P[0][2 * s][3]),
                                pack2<__half>(P[0][2 * s + 1][0], P[0][2 * s + 1][1]),
                                pack2<__half>(P[0][2 * s + 1][2], P[0][2 * s + 1][3])};
#pragma unroll
        for (int h = 0; h < kChunks; h += 2) {
            // lanes 0-15: keys 16s + lane % 16 of chunk h; lanes 16-31: of chunk h + 1
            uint32_t r[4];
            ldmatrix_x4_trans(r, sV + fp8_tile_offset<Cfg>(16 * s + lane % 16, h + lane / 16));
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const uint32_t lo = r[2 * u], hi = r[2 * u + 1];  // keys 0-7, 8-15 of chunk h+u
                const uint32_t even = __byte_perm(lo, hi, 0x6420);
                const uint32_t odd = __byte_perm(lo, hi, 0x7531);
                const uint32_t be[2] = {fp8x2_to_half2<CacheElem>(uint16_t(even & 0xffffu)),
                                        fp8x2_to_half2<CacheElem>(uint16_t(even >> 16))};
                const uint32_t bo[2] = {fp8x2_to_half2<CacheElem>(uint16_t(odd & 0xffffu)),
                                        fp8x2_to_half2<CacheElem>(uint16_t(odd >> 16))};
                mma_16816<__half>(O[0][2 * (h + u)], pa, be);
                mma_16816<__half>(O[0][2 * (h + u) + 1], pa, bo);
            }
        }
    }
}

}  // namespace flash::sm80
