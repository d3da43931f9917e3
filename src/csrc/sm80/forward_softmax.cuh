// Online softmax over KV blocks, fp32, base 2 (log2(e) is folded into the scale on the host).
// Each thread holds two rows per m16 tile (lane/4 and lane/4 + 8) and two columns per n8 tile; a
// row's four owner threads are one quad, so row max needs two xor-shuffles. The running sum l is
// kept per thread and quad-reduced once at the end (the rescale factor is the same for the quad).
#pragma once

#include <cmath>

#include "ptx.cuh"

namespace flash {

template <class Cfg>
struct OnlineSoftmax {
    static constexpr int kMT = Cfg::kMTiles;
    static constexpr int kNS = Cfg::kNTilesS;
    static constexpr int kNO = Cfg::kNTilesO;

    // Running row max: raw score units with kOptSoftmax (scaled inside the exp2 FMA), else
    // already scaled by scale_log2.
    float m[kMT][2];
    float l[kMT][2];  // this thread's share of the running row sum of exp2(s - m)

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                m[mt][h] = -INFINITY;
                l[mt][h] = 0.f;
            }
    }

    // Soft-capping: s -> tanh(s * softcap_scale); the softcap itself is folded into scale_log2.
    __device__ __forceinline__ static void softcap(float (&S)[kMT][kNS][4], float softcap_scale) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNS; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    S[mt][nt][e] = tanh_mufu(S[mt][nt][e] * softcap_scale);
    }

    // Scores of key columns >= seqlen_k (the tail block) become -inf: zero probability.
    __device__ __forceinline__ static void mask_tail(float (&S)[kMT][kNS][4], int kv_col0,
                                                     int seqlen_k, int lane) {
#pragma unroll
        for (int nt = 0; nt < kNS; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = kv_col0 + nt * 8 + (lane % 4) * 2 + (e % 2);
                if (col >= seqlen_k) {
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt)
                        S[mt][nt][e] = -INFINITY;
                }
            }
    }

    // S (scores) -> P (unnormalised probabilities) in place; rescales O and l by exp2(m_old -
    // m_new). kFirst (only with kOptSoftmax: the peeled first block) knows m_old = -inf, O = 0 and
    // l = 0, so it skips the rescale entirely.
    template <bool kFirst>
    __device__ __forceinline__ void update(float (&S)[kMT][kNS][4], float (&O)[kMT][kNO][4],
                                           float scale_log2) {
        static_assert(!kFirst || Cfg::kOptSoftmax, "only the optimised softmax peels block 0");
        if constexpr (!Cfg::kOptSoftmax) {
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                for (int nt = 0; nt < kNS; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        S[mt][nt][e] *= scale_log2;
        }
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = kFirst ? -INFINITY : m[mt][h];
#pragma unroll
                for (int nt = 0; nt < kNS; ++nt)
                    mx = fmaxf(mx, fmaxf(S[mt][nt][2 * h], S[mt][nt][2 * h + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));

                // Exponent offset; a row that has seen no finite score keeps offset 0 so that
                // exp2(-inf - offset) is 0 rather than NaN.
                const float offset =
                    mx == -INFINITY ? 0.f : (Cfg::kOptSoftmax ? mx * scale_log2 : mx);
                if constexpr (!kFirst) {
                    const float m_old = m[mt][h];
                    const float corr =
                        mx == -INFINITY
                            ? 1.f
                            : fast_exp2(Cfg::kOptSoftmax ? (m_old - mx) * scale_log2 : m_old - mx);
                    l[mt][h] *= corr;
#pragma unroll
                    for (int nt = 0; nt < kNO; ++nt) {
                        O[mt][nt][2 * h] *= corr;
                        O[mt][nt][2 * h + 1] *= corr;
                    }
                }
                m[mt][h] = mx;

                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < kNS; ++nt)
#pragma unroll
                    for (int e = 2 * h; e < 2 * h + 2; ++e) {
                        const float p = Cfg::kOptSoftmax
                                            ? fast_exp2(fmaf(S[mt][nt][e], scale_log2, -offset))
                                            : fast_exp2(S[mt][nt][e] - offset);
                        S[mt][nt][e] = p;
                        sum += p;
                    }
                l[mt][h] = kFirst ? sum : l[mt][h] + sum;
            }
    }

    // O /= l per row and the natural-log LSE = (m_scaled + log2 l) * ln 2. A row whose sum is 0
    // (no key) gives O = 0 and LSE = -inf.
    __device__ __forceinline__ void finalize(float (&O)[kMT][kNO][4], float (&lse)[kMT][2],
                                             float scale_log2) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float sum = l[mt][h];
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
                for (int nt = 0; nt < kNO; ++nt) {
                    O[mt][nt][2 * h] *= inv;
                    O[mt][nt][2 * h + 1] *= inv;
                }
                const float m_scaled = Cfg::kOptSoftmax ? m[mt][h] * scale_log2 : m[mt][h];
                lse[mt][h] = sum > 0.f ? (m_scaled + log2f(sum)) * 0.69314718055994531f : -INFINITY;
            }
    }
};

}  // namespace flash
