// The online softmax of the Hopper forward: fp32, base 2 (log2(e) is folded into the scale on the
// host), on the wgmma accumulator layout of one consumer warpgroup's rows.
#pragma once

#include <cmath>

#include "../common/numeric.cuh"

namespace flash::sm90 {

// Online softmax of one warpgroup's rows, split so that O can be rescaled after P V_{j-1} has
// landed: scores() turns S into P and returns the rescale factors, rescale() applies them.
// Thread rows: lane / 4 and lane / 4 + 8 of its warp's 16; a row's quad holds its columns.
template <class Cfg>
struct Softmax {
    float m[2];  // running max, raw score units (scaled inside the exp2 FMA)
    float l[2];  // this thread's share of the running sum
    // kLazyRescale: a row of this warp moved its max in the last scores() (warp-uniform), so O
    // needs the rescale; otherwise every factor is 1.
    bool moved = false;

    // kExp2Fma: the exp2s of kExp2FmaTiles of the kNTilesS n8 tiles, spread evenly, run on the
    // FMA pipe (exp2_fma), the rest on MUFU, whose 16 results per clock and SM bound the softmax
    // where the GEMMs per score are few (FP8 at d_head 128).
    __host__ __device__ static constexpr bool on_fma_pipe(int t) {
        return (t + 1) * Cfg::kExp2FmaTiles / Cfg::kNTilesS >
               t * Cfg::kExp2FmaTiles / Cfg::kNTilesS;
    }

    __device__ __forceinline__ void init() {
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.f;
    }

    template <bool kFirst>
    __device__ __forceinline__ void scores(float (&S)[Cfg::kNTilesS][4], float scale_log2,
                                           float (&corr)[2]) {
        bool row_moved = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = m[h];
#pragma unroll
            for (int t = 0; t < Cfg::kNTilesS; ++t)
                mx = fmaxf(mx, fmaxf(S[t][2 * h], S[t][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            if constexpr (Cfg::kLazyRescale && !kFirst) {
                // Keep the old max while the new one exceeds it by at most kRescaleLog2 (false
                // for an old max of -inf: +inf or NaN on the left).
                if ((mx - m[h]) * scale_log2 <= Cfg::kRescaleLog2)
                    mx = m[h];
                row_moved |= mx != m[h];
            }
            // A row with no finite score yet keeps offset 0: exp2(-inf) = 0, never NaN. FP8: P
            // is 2^kPShiftLog2 times the probability (l too; totals() takes it out of the LSE).
            float offset = mx == -INFINITY ? 0.f : mx * scale_log2;
            if constexpr (Cfg::kFp8)
                offset = mx == -INFINITY ? 0.f : offset - Cfg::kPShiftLog2;
            corr[h] = (kFirst || mx == -INFINITY) ? 1.f : fast_exp2((m[h] - mx) * scale_log2);
            m[h] = mx;
            float sum = 0.f;
#pragma unroll
            for (int t = 0; t < Cfg::kNTilesS; ++t)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    const float x = fmaf(S[t][e], scale_log2, -offset);
                    S[t][e] = on_fma_pipe(t) ? exp2_fma<Cfg::kExp2FmaDegree>(x) : fast_exp2(x);
                    sum += S[t][e];
                }
            l[h] = kFirst ? sum : l[h] * corr[h] + sum;
        }
        if constexpr (Cfg::kLazyRescale)
            moved = !kFirst && __any_sync(0xffffffffu, row_moved);
    }

    // O *= the factors of the last scores() (skipped by a warp whose rows all kept their max).
    __device__ __forceinline__ void rescale(float (&O)[Cfg::kNTilesO][4],
                                            const float (&corr)[2]) const {
        if (Cfg::kLazyRescale && !moved)
            return;
#pragma unroll
        for (int t = 0; t < Cfg::kNTilesO; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                O[t][e] *= corr[e / 2];
    }

    // Once the last block's scores are in: O's factors 1 / l and the LSE (natural log) per row;
    // a row with no key gives O = 0 and LSE = -inf.
    __device__ __forceinline__ void totals(float (&inv)[2], float (&lse)[2],
                                           float scale_log2) const {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = l[h];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            // MUFU approximations (about 2^-22 relative): the precise 1/x and log2f are ~100
            // dependent instructions with slow paths, on the tile change's critical path.
            inv[h] = sum > 0.f ? fast_rcp(sum) : 0.f;
            float log2_sum = fast_log2(sum);
            if constexpr (Cfg::kFp8)
                log2_sum -= Cfg::kPShiftLog2;
            lse[h] = sum > 0.f ? (m[h] * scale_log2 + log2_sum) * 0.69314718055994531f : -INFINITY;
        }
    }
    // O /= l, with inv from totals().
    __device__ __forceinline__ static void normalize(float (&O)[Cfg::kNTilesO][4],
                                                     const float (&inv)[2]) {
#pragma unroll
        for (int t = 0; t < Cfg::kNTilesO; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                O[t][e] *= inv[e / 2];
    }
};

}  // namespace flash::sm90
