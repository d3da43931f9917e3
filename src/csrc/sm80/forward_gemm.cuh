// The two per-warp matrix products of one KV block, S = Q K^T and O += P V, on mma.sync m16n8k16
// with fp32 accumulators. The config decides how operand fragment loads interleave with the MMAs:
// a whole block up front, one k16 slice right before its MMAs, or (double buffer) slice s+1
// loaded before the MMAs of slice s so shared-memory latency hides behind tensor-core work.
#pragma once

#include "fragments.cuh"
#include "ptx.cuh"

namespace flash {

// When the fragment loads of one operand happen, relative to its k-steps.
template <bool kSliced, bool kDoubleBuffer, int kSteps>
struct LoadSchedule {
    template <class Load>
    __device__ __forceinline__ static void prologue(Load&& load) {
        if constexpr (!kSliced) {
#pragma unroll
            for (int s = 0; s < kSteps; ++s)
                load(s);
        } else if constexpr (kDoubleBuffer) {
            load(0);
        }
    }

    template <class Load>
    __device__ __forceinline__ static void before_step(int s, Load&& load) {
        if constexpr (kSliced && kDoubleBuffer) {
            if (s + 1 < kSteps)
                load(s + 1);
        } else if constexpr (kSliced) {
            load(s);
        }
    }
};

template <class Cfg>
using QBuffer = FragBuffer<QFrag<Cfg>, Cfg::kStepsQK, Cfg::kSliceQ, Cfg::kDoubleBuffer>;

// S = Q K^T for this warp's rows against the K block in smem. A whole (unsliced) Q buffer is
// resident and already loaded by the caller; a sliced one is refilled from smem here.
template <class Cfg>
__device__ __forceinline__ void gemm_qk(float (&S)[Cfg::kMTiles][Cfg::kNTilesS][4],
                                        QBuffer<Cfg>& qbuf, const LdsmAddr<Cfg>& q_at,
                                        const LdsmAddr<Cfg>& k_at) {
    using KSched = LoadSchedule<Cfg::kSliceK, Cfg::kDoubleBuffer, Cfg::kStepsQK>;
    using QSched = LoadSchedule<Cfg::kSliceQ, Cfg::kDoubleBuffer, Cfg::kStepsQK>;
    FragBuffer<KFrag<Cfg>, Cfg::kStepsQK, Cfg::kSliceK, Cfg::kDoubleBuffer> kbuf;
    auto load_k = [&](int s) { load_k_slice<Cfg>(kbuf.slot(s), k_at, s); };
    auto load_q = [&](int s) { load_q_slice<Cfg>(qbuf.slot(s), q_at, s); };

#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                S[mt][nt][e] = 0.f;

    if constexpr (Cfg::kSliceQ)
        QSched::prologue(load_q);
    KSched::prologue(load_k);
#pragma unroll
    for (int s = 0; s < Cfg::kStepsQK; ++s) {
        if constexpr (Cfg::kSliceQ)
            QSched::before_step(s, load_q);
        KSched::before_step(s, load_k);
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
                mma_16816<typename Cfg::Elem>(S[mt][nt], qbuf.slot(s).r[mt], kbuf.slot(s).r[nt]);
    }
}

// O += P V for the V block in smem. P (fp32 probabilities in the S accumulator layout) becomes the
// A operand directly: the C layout of n8 tiles 2k and 2k+1 is the A layout of k16 step k.
template <class Cfg>
__device__ __forceinline__ void gemm_pv(float (&O)[Cfg::kMTiles][Cfg::kNTilesO][4],
                                        const float (&P)[Cfg::kMTiles][Cfg::kNTilesS][4],
                                        const LdsmAddr<Cfg>& v_at) {
    using Elem = typename Cfg::Elem;
    using VSched = LoadSchedule<Cfg::kSliceV, Cfg::kDoubleBuffer, Cfg::kStepsPV>;
    FragBuffer<VFrag<Cfg>, Cfg::kStepsPV, Cfg::kSliceV, Cfg::kDoubleBuffer> vbuf;
    auto load_v = [&](int s) { load_v_slice<Cfg>(vbuf.slot(s), v_at, s); };

    // P as packed 16-bit A fragments, converted up front so the fp32 scores die early.
    uint32_t pa[Cfg::kMTiles][Cfg::kStepsPV][4];
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
        for (int s = 0; s < Cfg::kStepsPV; ++s) {
            pa[mt][s][0] = pack2<Elem>(P[mt][2 * s][0], P[mt][2 * s][1]);
            pa[mt][s][1] = pack2<Elem>(P[mt][2 * s][2], P[mt][2 * s][3]);
            pa[mt][s][2] = pack2<Elem>(P[mt][2 * s + 1][0], P[mt][2 * s + 1][1]);
            pa[mt][s][3] = pack2<Elem>(P[mt][2 * s + 1][2], P[mt][2 * s + 1][3]);
        }

    VSched::prologue(load_v);
#pragma unroll
    for (int s = 0; s < Cfg::kStepsPV; ++s) {
        VSched::before_step(s, load_v);
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < Cfg::kNTilesO; ++nt)
                mma_16816<Elem>(O[mt][nt], pa[mt][s], vbuf.slot(s).r[nt]);
    }
}

}  // namespace flash
