// The mainloop of the Hopper backward (the algorithm: backward_config.cuh): what its producer
// loads (BackwardLoader) and what a consumer warpgroup computes (BackwardConsumer), over the
// CTA's tile (backward_tile.cuh); dQ leaves through the writer warp (backward_dq_writer.cuh).
//
// Pipeline, per query block t of the CTA (stage s = t % S, its use t / S waits for phase parity
// (t / S) & 1; S = kStages for Q, LSE and D, kDoStages for dO): q_full[s] completes when Q, LSE
// and D of the block have landed, do_full[s] when dO has; q_empty[s] when every consumer thread
// is done with Q, LSE and D (its loads, and the GEMMs reading Q have completed), do_empty[s]
// when every consumer warp is done with dO, so the producer may refill the stage with block
// t + S.
// kv_full completes once, when K and V have landed. The dQ buffer is handed between consumer
// warpgroup g and the writer warp by the named barriers kBwdDqFull + g and kBwdDqEmpty + g.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/backward_common.cuh"
#include "../common/ldmatrix.cuh"
#include "../common/mask.cuh"
#include "../common/numeric.cuh"
#include "../common/params.h"
#include "backward_config.cuh"
#include "backward_tile.cuh"
#include "epilogue.cuh"
#include "named_barriers.cuh"
#include "ptx.cuh"
#include "tma_loader.cuh"
#include "wgmma.cuh"

namespace flash::sm90 {

// The producer's side: K and V once, then Q, LSE, D and dO of each (head, query block) pair
// through the stage ring. One thread.
template <class Cfg>
struct BackwardLoader : TmaLoader<Cfg> {
    const BwdKernelParams& prm;
    const BwdSmem<Cfg>& sm;

    __device__ __forceinline__ void run(const BackwardTile<Cfg>& w) const {
        const BwdParams& p = prm.p;
        if (w.n == 0)
            return;
        this->template load_tile<Cfg::kBc, false>(sm.k(), &prm.tma_k, sm.kv_full(), w.kv_block,
                                                  w.kv_head, w.map_batch(), w.k_start());
        this->template load_tile<Cfg::kBc, false>(sm.v(), &prm.tma_v, sm.kv_full(), w.kv_block,
                                                  w.kv_head, w.map_batch(), w.k_start());
        auto x = w.first(p.heads_per_kv);
        for (int t = 0; t < w.n; ++t, w.advance(x)) {
            const int s = t % Cfg::kStages, use = t / Cfg::kStages;
            const int sd = t % Cfg::kDoStages, use_d = t / Cfg::kDoStages;
            const typename BackwardTile<Cfg>::Pair b{x.head, w.block_at(prm, x.i)};
            wait_buffer_free(sm.q_empty(s), use);
            this->template load_tile<Cfg::kBr, false>(sm.q(s), &prm.tma_q, sm.q_full(s), b.i,
                                                      b.head, w.map_batch(), w.q_start());
            const int64_t vec = w.padded_row(p, b);
            mbar_arrive_expect_tx(sm.q_full(s), 2 * Cfg::kVecBytes);
            bulk_load(sm.lse(s), p.lse_log2 + vec, Cfg::kVecBytes, sm.q_full(s));
            bulk_load(sm.d(s), p.d_rows + vec, Cfg::kVecBytes, sm.q_full(s));
            wait_buffer_free(sm.do_empty(sd), use_d);
            this->template load_tile<Cfg::kBr, false>(sm.dout(sd), &prm.tma_do, sm.do_full(sd), b.i,
                                                      b.head, w.map_batch(), w.q_start());
        }
    }
};

// One consumer warpgroup: keys 64 wg .. 64 wg + 63 of the CTA's block through every query block
// (kSplitD: all 64 keys, d_head columns 128 wg .. of dK, dV and dQ).
template <class Cfg>
struct BackwardConsumer {
    using Elem = typename Cfg::Elem;
    static constexpr int kNS = Cfg::kSCols / 8;       // n8 tiles of S^T, dP^T (query columns)
    static constexpr int kNO = Cfg::kNTilesO;         // n8 tiles of dK, dV (d_head columns)
    static constexpr int kNQ = 64 / 8;                // n8 tiles of a dQ part's columns
    static constexpr int kMQ = Cfg::kDqMTiles;        // m64 tiles of its dQ rows
    static constexpr int kStepsD = Cfg::kDHead / 16;  // k16 steps over d_head
    static constexpr int kStepsR = Cfg::kBr / 16;     // over a query block
    static constexpr int kStepsS = kNS / 2;           // over this warpgroup's query columns
    static constexpr int kStepsC = Cfg::kBc / 16;     // over the CTA's keys

    const BwdKernelParams& prm;
    const BwdSmem<Cfg>& sm;
    const BackwardTile<Cfg>& w;
    const int wg, warp, lane;  // warpgroup among the consumers; warp among the consumer warps

    float dV[kNO][4];
    float dK[kNO][4];

    // ---- GEMMs ----------------------------------------------------------------------------------

    // S^T = K Q^T (A = K, B = Q, or with dP^T V and dO): K-major operands, 16 columns of d per
    // instruction (a 32-byte step inside the swizzled 128-byte row, then the next panel). A is
    // this warpgroup's keys, B its query rows (kSplitD: all keys, query rows kSCols wg ..).
    __device__ __forceinline__ void issue_kq(float (&acc)[kNS][4], const unsigned char* a_tile,
                                             const unsigned char* b_tile) const {
        const uint32_t a0 = smem_u32(a_tile) + wg * Cfg::kWgKeys * 128;
        const uint32_t b0 = smem_u32(b_tile) + (Cfg::kSplitD ? wg * Cfg::kSCols * 128 : 0);
#pragma unroll
        for (int kk = 0; kk < kStepsD; ++kk) {
            const uint32_t step = (kk % 4) * 32;
            const uint64_t a = desc_sw128(a0 + (kk / 4) * Cfg::kBc * 128 + step, 16, 1024);
            const uint64_t b = desc_sw128(b0 + (kk / 4) * Cfg::kBr * 128 + step, 16, 1024);
            Wgmma<Cfg::kSCols, Elem>::ss(acc, a, b, kk > 0 ? 1u : 0u);
        }
    }

    // dV += P^T dO (or dK += dS^T Q): A the 16-bit fragments of this warpgroup's rows, B a
    // query-block tile (B_r rows x d) MN-major: 8-row groups 1024 bytes apart (SBO), 64-column
    // panels B_r x 128 bytes apart (LBO); 16 query rows per instruction.
    __device__ __forceinline__ void issue_acc(float (&acc)[kNO][4], const uint32_t (&a)[kStepsS][4],
                                              const unsigned char* b_tile) const {
        const uint32_t b0 = smem_u32(b_tile);
#pragma unroll
        for (int kk = 0; kk < kStepsR; ++kk) {
            const uint64_t b = desc_sw128(b0 + kk * 16 * 128, Cfg::kBr * 128, 1024);
            Wgmma<Cfg::kDHead, Elem>::rs(acc, a[kk], b, 1u);
        }
    }

    // kSplitD: the same with A from shared memory, P^T or dS^T of all keys (B_c rows x B_r, one
    // panel, K-major), and B the columns kDCols wg .. of the query-block tile.
    __device__ __forceinline__ void issue_acc_ss(float (&acc)[kNO][4], const unsigned char* a_tile,
                                                 const unsigned char* b_tile) const {
        const uint32_t a0 = smem_u32(a_tile);
        const uint32_t b0 = smem_u32(b_tile) + wg * (Cfg::kDCols / 64) * Cfg::kBr * 128;
#pragma unroll
        for (int kk = 0; kk < kStepsR; ++kk) {
            const uint64_t a = desc_sw128(a0 + (kk / 4) * Cfg::kBc * 128 + (kk % 4) * 32, 16, 1024);
            const uint64_t b = desc_sw128(b0 + kk * 16 * 128, Cfg::kBr * 128, 1024);
            Wgmma<Cfg::kDCols, Elem>::ss_bmn(acc, a, b, 1u);
        }
    }

    // dQ part h (64 columns, one panel of K) of this warpgroup = dS K over all B_c keys: A is
    // dS^T of both warpgroups (B_c rows x B_r columns, one panel: M-major), B is K (B_c rows x
    // d, N-major) from column wg * kDqCols + 64 h. With kDqOwnKeys (d_head 64): this
    // warpgroup's part of dQ, every column, over its own 64 keys (rows 64 wg .. of dS^T and
    // K). Query rows 64 m .. of the block (m64 tile m) from panel m of dS^T.
    __device__ __forceinline__ void issue_dq(float (&acc)[kMQ][kNQ][4], int buf, int h) const {
        constexpr int kSteps = Cfg::kDqOwnKeys ? 64 / 16 : kStepsC;
        const int row0 = Cfg::kDqOwnKeys ? wg * 64 : 0;
        const int col0 = Cfg::kDqOwnKeys ? 0 : wg * Cfg::kDqCols + 64 * h;
        const uint32_t a0 = smem_u32(sm.ds(buf)) + row0 * 128;
        const uint32_t b0 = smem_u32(sm.k()) + row0 * 128 + (col0 / 64) * Cfg::kBc * 128;
#pragma unroll
        for (int m = 0; m < kMQ; ++m)
#pragma unroll
            for (int kk = 0; kk < kSteps; ++kk) {
                const uint64_t a =
                    desc_sw128(a0 + m * Cfg::kBc * 128 + kk * 16 * 128, Cfg::kBc * 128, 1024);
                const uint64_t b = desc_sw128(b0 + kk * 16 * 128, Cfg::kBc * 128, 1024);
                Wgmma<64, Elem>::ss_mn(acc[m], a, b, kk > 0 ? 1u : 0u);
            }
    }

    // ---- element-wise ---------------------------------------------------------------------------

    // Key (row of S^T) of this thread's element e of any n8 tile, within the CTA's block.
    __device__ __forceinline__ int key_of(int e) const {
        return wg * Cfg::kWgKeys + (warp % 4) * 16 + lane / 4 + 8 * (e / 2);
    }

    // This warpgroup's first query column of S^T (the block's first query row: 0 but kSplitD).
    __device__ __forceinline__ int q_col0() const { return Cfg::kSplitD ? wg * Cfg::kSCols : 0; }

    // A stage's row vector (LSE * log2(e) or D) at this thread's query columns (kSplitD: from
    // column kSCols wg): those of n8 tile t at v[t]. At B_r = 64 loaded into registers while the
    // block's GEMMs run, ahead of the element-wise pass (kEagerCols); at B_r = 128 (32 registers
    // per vector) read from shared memory tile by tile in the pass.
    static constexpr bool kEagerCols = kNS <= 8;
    struct SmemCols {
        uint32_t addr;
        __device__ __forceinline__ float2 operator[](int t) const {
            return ld_shared_f32x2(addr + t * 32);
        }
    };
    using Cols = std::conditional_t<kEagerCols, float2[kNS], SmemCols>;

    __device__ __forceinline__ void load_cols(Cols& v, const float* vec) const {
        const uint32_t addr = smem_u32(vec) + (q_col0() + 2 * (lane % 4)) * 4;
        if constexpr (kEagerCols) {
#pragma unroll
            for (int t = 0; t < kNS; ++t)
                v[t] = ld_shared_f32x2(addr + t * 32);
        } else {
            v.addr = addr;
        }
    }

    // S^T -> P^T in place: exp2(S scale_log2 - LSE log2 e) (softcap: of tanh(S / c), scaled),
    // kMasked (a block with keys past seqlen_k or pairs outside the window; rows past seqlen_q
    // have an LSE of +inf): 0 where masked. A template parameter, so that an unmasked block's
    // pass is straight-line code with no branch per element. kFused (dP^T has landed too):
    // dP^T -> dS^T in place in the same pass (softcap: the tanh's derivative is used where it
    // is computed).
    template <bool kFused, bool kMasked>
    __device__ __forceinline__ void probabilities(float (&S)[kNS][4], float (&dP)[kNS][4],
                                                  const Cols& lse_cols, const Cols& dd_cols,
                                                  int i) const {
        const BwdParams& p = prm.p;
        // kMasked: per key row of this thread the query columns it keeps are a range, so an
        // element takes two compares with an immediate (its k = t * 8 + e % 2) and a select.
        // Column c0 + k (c0: this thread's first) is visible from key k_row0 + r iff rel = b +
        // r - k, b = k_row0 - c0 - off, lies in [-left, right], and the key is below seqlen_k
        // (rows past seqlen_q have an LSE of +inf); bounds clamped (clamp_mask_bound). The
        // thread's second key row is its first + 8 (key_of): both share the bounds, compared
        // with k - 8, and a predicate says where seqlen_k falls between them.
        int k_lo = 0, k_hi = 0;
        bool row8_dead = false;
        if constexpr (kMasked) {
            const int64_t b =
                int64_t(w.k_row0) - (int64_t(i) * Cfg::kBr + q_col0() + 2 * (lane % 4)) - w.win.off;
            const int r = key_of(0);
            k_lo = r + (w.win.right < 0 ? -kMaskBig : clamp_mask_bound(b - w.win.right));
            const int seqlen_k = w.seqlen_k(p);
            k_hi = w.k_row0 + r < seqlen_k
                       ? r + (w.win.left < 0 ? kMaskBig : clamp_mask_bound(b + w.win.left))
                       : -kMaskBig;
            row8_dead = w.k_row0 + r + 8 >= seqlen_k;
        }
#pragma unroll
        for (int t = 0; t < kNS; ++t) {
            const float2 lse = lse_cols[t];
            float2 dd;
            if constexpr (kFused)
                dd = dd_cols[t];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = S[t][e], dtanh = 1.f;
                if constexpr (Cfg::kSoftcap) {
                    x = tanh_fast(x * p.softcap_scale);
                    dtanh = 1.f - x * x;
                }
                float prob = fast_exp2(fmaf(x, p.scale_log2, -(e % 2 ? lse.y : lse.x)));
                if constexpr (kMasked) {
                    const int k = t * 8 + e % 2 - 8 * (e / 2);  // against key row key_of(0)
                    if (k < k_lo || k > k_hi || (e / 2 == 1 && row8_dead))
                        prob = 0.f;
                }
                S[t][e] = prob;
                if constexpr (kFused)
                    dP[t][e] = prob * (dP[t][e] - (e % 2 ? dd.y : dd.x)) * dtanh;
            }
        }
    }

    template <bool kFused>
    __device__ __forceinline__ void probabilities(float (&S)[kNS][4], float (&dP)[kNS][4],
                                                  const Cols& lse, const Cols& dd, int i,
                                                  bool masked) const {
        if (masked)
            probabilities<kFused, true>(S, dP, lse, dd, i);
        else
            probabilities<kFused, false>(S, dP, lse, dd, i);
    }

    // dP^T -> dS^T in place: P^T (dP^T - D) (no softcap: see probabilities<true>).
    __device__ __forceinline__ void dscores(const float (&P)[kNS][4], float (&dP)[kNS][4],
                                            const Cols& dd_cols) const {
#pragma unroll
        for (int t = 0; t < kNS; ++t) {
            const float2 dd = dd_cols[t];
#pragma unroll
            for (int e = 0; e < 4; ++e)
                dP[t][e] = P[t][e] * (dP[t][e] - (e % 2 ? dd.y : dd.x));
        }
    }

    // Two fp32 values from shared memory (addr 8-byte aligned). volatile: a stage's address
    // repeats across blocks, so the load must not be hoisted over the barrier waits.
    __device__ __forceinline__ static float2 ld_shared_f32x2(uint32_t addr) {
        float2 v;
        asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
        return v;
    }

    // dS^T (or P^T) of this warpgroup's keys and query columns into `tile` (B_c x B_r, rows
    // kWgKeys wg .., swizzled as a TMA tile): one stmatrix.x4 per k16 step, whose fragments are
    // those of the dK GEMM (to_a_fragments). Lane l addresses row l % 8 of matrix l / 8: rows
    // + 8 for odd l / 8, the step's second n8 tile for l / 16; chunk (2 (kk % 4) + l / 16) ^
    // (row & 7), row & 7 = l % 8, in panel kk / 4. kSplitD: this warpgroup's steps are those
    // from 2 wg of the block's 4 (chunks 4 wg .., a XOR, as 2 wg + kk has no carry).
    __device__ __forceinline__ void store_scores(const uint32_t (&f)[kStepsS][4],
                                                 unsigned char* tile) const {
        static_assert(!Cfg::kSplitD || (kStepsS == 2 && kStepsR == 4), "kSplitD: B_r = 64");
        const int r = wg * Cfg::kWgKeys + (warp % 4) * 16 + 8 * ((lane / 8) % 2) + lane % 8;
        const uint32_t row = (smem_u32(tile) + r * 128 + (((lane / 16) ^ (lane % 8)) * 16)) ^
                             (Cfg::kSplitD ? wg * kStepsS * 32 : 0);
#pragma unroll
        for (int kk = 0; kk < kStepsS; ++kk)
            stmatrix_x4((row ^ ((kk % 4) * 32)) + (kk / 4) * Cfg::kBc * 128, f[kk]);
    }

    // dS^T of this warpgroup's keys into block t's buffer, for the dQ GEMM of this warpgroup
    // (kDqOwnKeys: one buffer, see store_dq) or of both (two: the other buffer may still be
    // read by the previous block's dQ GEMM; this one was last read two blocks ago, before the
    // previous block's barrier here).
    __device__ __forceinline__ void share_ds(const uint32_t (&dSf)[kStepsS][4], int t) const {
        store_scores(dSf, sm.ds(t % Cfg::kDsBuffers));
        fence_proxy_async_smem();  // the wgmma reads what the stmatrix wrote
        if constexpr (Cfg::kDqOwnKeys)
            named_sync(kBwdDsOwnBarrier + wg, 128);  // ... of this warpgroup's warps
        else
            named_sync(kBwdDsBarrier, 128 * Cfg::kConsumerWGs);  // ... of both warpgroups
    }

    // ---- the loop ------------------------------------------------------------------------------

    // kVarlen, after this warpgroup zeroed rows of a tile (zero_rows): the wgmma (async proxy)
    // reads the zeros once every thread of the warpgroup wrote them. Both warpgroups write the
    // same zeros, each before its own GEMMs read them; a stage is refilled only after both
    // released it.
    __device__ __forceinline__ void tail_zeroed() const {
        fence_proxy_async_smem();
        named_sync(kBwdTailBarrier + wg, 128);
    }

    __device__ __forceinline__ void release(uint64_t* bar) const {
        __syncwarp();
        if (lane == 0)
            mbar_arrive(bar);
    }

    __device__ __forceinline__ void run() {
#pragma unroll
        for (int t = 0; t < kNO; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                dV[t][e] = dK[t][e] = 0.f;
        if (w.n > 0) {
            mbar_wait(sm.kv_full(), 0);  // K and V have landed
            if constexpr (Cfg::kVarlen) {
                const int keep = w.seqlen_k(prm.p) - w.k_row0;  // keys of the sequence
                if (keep < Cfg::kBc) {
                    zero_rows<Cfg::kBc, Cfg::kPanels>(sm.k(), keep);
                    zero_rows<Cfg::kBc, Cfg::kPanels>(sm.v(), keep);
                    tail_zeroed();
                }
            }
            auto x = w.first(prm.p.heads_per_kv);
            for (int t = 0; t < w.n; ++t, w.advance(x))
                // x.i, the place in the head's cycle, serves as the block: with the rotated order
                // (no mask, block_at) the block matters only for the key tail's mask, which
                // every block of the last KV block gets, and rows past seqlen_q have an LSE of
                // +inf (P = 0) in any block; without it the place is the block.
                block(t, x.head, x.i);
        }
        // Both warpgroups are done with every stage (the dV and dK staging buffers).
        named_sync(kBwdDsBarrier, 128 * Cfg::kConsumerWGs);
        write_dk_dv();
    }

    __device__ __forceinline__ void block(int t, int head, int i) {
        if constexpr (Cfg::kSplitD)
            block_split_d(t, head, i);
        else
            block_own_keys(t, i);
    }

    // A block's S^T = K Q^T and dP^T = V dO^T issued (a commit group each), each once its
    // operands have landed (Q stage s, dO stage sd); with kLoadCols LSE and D are loaded into
    // lse and dd between the two.
    // kVarlen: a block that reaches past its sequence's last query row first has the rows past
    // it (the next sequence's Q and dO) zeroed, as TMA zero-fills those of a fixed-length call
    // past the tensor: their LSE is +inf and D 0 (the varlen layout), so P and dS are 0 there.
    template <bool kLoadCols>
    __device__ __forceinline__ void issue_scores(float (&S)[kNS][4], float (&dP)[kNS][4], Cols& lse,
                                                 Cols& dd, int s, uint32_t phase, int sd,
                                                 uint32_t phase_d, int i) const {
        if constexpr (Cfg::kVarlen) {
            const int keep = w.seqlen_q(prm.p) - i * Cfg::kBr;  // rows of the sequence
            if (keep < Cfg::kBr) {
                mbar_wait(sm.q_full(s), phase);
                mbar_wait(sm.do_full(sd), phase_d);
                zero_rows<Cfg::kBr, Cfg::kPanels>(sm.q(s), keep);
                zero_rows<Cfg::kBr, Cfg::kPanels>(sm.dout(sd), keep);
                tail_zeroed();
            }
        }
        mbar_wait(sm.q_full(s), phase);  // Q, LSE and D have landed
        wgmma_fence();
        issue_kq(S, sm.k(), sm.q(s));
        wgmma_commit();
        if constexpr (kLoadCols) {
            load_cols(lse, sm.lse(s));
            load_cols(dd, sm.d(s));
        }
        mbar_wait(sm.do_full(sd), phase_d);  // dO has landed
        wgmma_fence();  // (dP^T's registers were last written by the previous block)
        issue_kq(dP, sm.v(), sm.dout(sd));
        wgmma_commit();
    }

    // d_head 64 and 128: this warpgroup's keys, every query column of the block.
    __device__ __forceinline__ void block_own_keys(int t, int i) {
        const int s = t % Cfg::kStages;
        const uint32_t phase = (t / Cfg::kStages) & 1;
        const bool masked = i < w.unmasked.x || i > w.unmasked.y;
        float S[kNS][4], dP[kNS][4];
        uint32_t Pf[kStepsS][4], dSf[kStepsS][4];

        // LSE and D at this thread's query columns, loaded while the GEMMs run (without
        // softcap, each just before its pass: registers are short at d_head 128).
        Cols lse, dd;
        issue_scores<Cfg::kSoftcap>(S, dP, lse, dd, s, phase, s, phase, i);
        if constexpr (Cfg::kSoftcap) {
            wgmma_wait<0>();  // S^T and dP^T are in registers
            fence_regs(S);
            fence_regs(dP);
            probabilities<true>(S, dP, lse, dd, i, masked);
            to_a_fragments<Elem>(S, Pf);
            wgmma_fence();
            issue_acc(dV, Pf, sm.dout(s));
            wgmma_commit();
        } else {
            load_cols(lse, sm.lse(s));
            wgmma_wait<1>();  // S^T is in registers; dP^T may still run
            fence_regs(S);
            probabilities<false>(S, dP, lse, dd, i, masked);
            to_a_fragments<Elem>(S, Pf);
            wgmma_fence();
            issue_acc(dV, Pf, sm.dout(s));
            wgmma_commit();
            wgmma_wait<1>();  // dP^T is in registers; dV may still run
            fence_regs(dP);
            load_cols(dd, sm.d(s));
            dscores(S, dP, dd);
        }
        to_a_fragments<Elem>(dP, dSf);
        if constexpr (Cfg::kDqBeforeDk) {
            // The dQ GEMM before dK += dS^T Q, so that dQ leaves for the writer while dK runs.
            share_ds(dSf, t);
            float dQ[kMQ][kNQ][4];
            wgmma_fence();
            issue_dq(dQ, t % Cfg::kDsBuffers, 0);
            wgmma_commit();
            issue_acc(dK, dSf, sm.q(s));
            wgmma_commit();
            wgmma_wait<1>();  // dV and dQ are complete (dO is free); dK may still run
            fence_regs(dV);
            fence_regs(dQ);
            release(sm.do_empty(s));
            store_dq(dQ, t);
            wgmma_wait<0>();  // dK is complete: Q may be refilled
            fence_regs(dK);
            mbar_arrive(sm.q_empty(s));  // this thread's LSE and D loads are done
        } else {
            wgmma_fence();
            issue_acc(dK, dSf, sm.q(s));
            wgmma_commit();
            share_ds(dSf, t);
            float dQ[kMQ][kNQ][4];
            wgmma_fence();
            issue_dq(dQ, t % Cfg::kDsBuffers, 0);
            wgmma_commit();
            wgmma_wait<0>();  // dV, dK and dQ are complete: the stage may be refilled
            fence_regs(dV);
            fence_regs(dK);
            fence_regs(dQ);
            mbar_arrive(sm.q_empty(s));  // this thread's LSE and D loads are done
            release(sm.do_empty(s));
            store_dq(dQ, t);
        }
    }

    // kSplitD (d_head 256): this warpgroup's query columns of S^T and dP^T; P^T and dS^T of
    // both warpgroups meet in shared memory (buffer t % 2: a warpgroup writes block t's after
    // block t - 1's barrier, which both passed only once done with block t - 2's GEMMs); then
    // dQ's two parts, dV and dK over this warpgroup's d_head columns, in that order, so that dQ
    // leaves (hand_dq) while dV and dK run.
    __device__ __forceinline__ void block_split_d(int t, int head, int i) {
        static_assert(Cfg::kDqParts == 2 && Cfg::kPBuffers == 2 && Cfg::kDsBuffers == 2,
                      "kSplitD: two dQ parts, two P^T and dS^T buffers");
        const int s = t % Cfg::kStages, sd = t % Cfg::kDoStages, buf = t % 2;
        const uint32_t phase = (t / Cfg::kStages) & 1, phase_d = (t / Cfg::kDoStages) & 1;
        const bool masked = i < w.unmasked.x || i > w.unmasked.y;
        float S[kNS][4], dP[kNS][4];
        uint32_t Pf[kStepsS][4], dSf[kStepsS][4];

        Cols lse, dd;
        issue_scores<true>(S, dP, lse, dd, s, phase, sd, phase_d, i);
        if constexpr (Cfg::kSoftcap) {
            wgmma_wait<0>();  // S^T and dP^T are in registers
            fence_regs(S);
            fence_regs(dP);
            probabilities<true>(S, dP, lse, dd, i, masked);
        } else {
            wgmma_wait<1>();  // S^T is in registers; dP^T may still run
            fence_regs(S);
            probabilities<false>(S, dP, lse, dd, i, masked);
            wgmma_wait<0>();
            fence_regs(dP);
            dscores(S, dP, dd);
        }
        to_a_fragments<Elem>(S, Pf);
        to_a_fragments<Elem>(dP, dSf);
        store_scores(Pf, sm.p(buf));
        store_scores(dSf, sm.ds(buf));
        fence_proxy_async_smem();  // the wgmma reads what the stmatrix wrote
        named_sync(kBwdDsBarrier, 128 * Cfg::kConsumerWGs);  // ... of both warpgroups

        float dQ[Cfg::kDqParts][kMQ][kNQ][4];
        wgmma_fence();
#pragma unroll
        for (int h = 0; h < Cfg::kDqParts; ++h) {
            issue_dq(dQ[h], buf, h);
            wgmma_commit();
        }
        issue_acc_ss(dV, sm.p(buf), sm.dout(sd));
        wgmma_commit();
        issue_acc_ss(dK, sm.ds(buf), sm.q(s));
        wgmma_commit();
        wgmma_wait<3>();  // dQ part 0 is complete
        fence_regs(dQ[0]);
        hand_dq(dQ[0], t, head, i, 0);
        wgmma_wait<2>();  // dQ part 1
        fence_regs(dQ[1]);
        hand_dq(dQ[1], t, head, i, 1);
        wgmma_wait<1>();  // dV: dO is free
        fence_regs(dV);
        release(sm.do_empty(sd));
        wgmma_wait<0>();  // dK: Q may be refilled
        fence_regs(dK);
        mbar_arrive(sm.q_empty(s));  // this thread's LSE and D loads are done
    }

    // A dQ part (64 columns) into this warpgroup's dQ buffer, for the writer warp: of m64 tile
    // m, n8 tile n of thread x at float4 (m kNQ + n) * 128 + x (bwd::DqLayout::kWgmmaTiles, 64
    // rows at a time). u counts this warpgroup's parts (kDqParts per block): part 0 finds the
    // buffer free, part u > 0 waits until the writer has read part u - 1. Every warp of the
    // warpgroup is past the wait for block t's dQ GEMM here, so after this barrier the single
    // dS^T buffer (kDsBuffers) may be refilled; block 0 has a barrier of the warpgroup alone
    // for that.
    __device__ __forceinline__ void store_dq(const float (&dQ)[kMQ][kNQ][4], int u) const {
        constexpr int kSync = 128 + 32;
        if (u > 0)
            named_sync(kBwdDqEmpty + wg, kSync);
        else if constexpr (Cfg::kDsBuffers == 1)
            named_sync(kBwdDsOwnBarrier + wg, 128);
        const uint32_t at = smem_u32(sm.dq(wg)) + ((warp % 4) * 32 + lane) * 16;
#pragma unroll
        for (int m = 0; m < kMQ; ++m)
#pragma unroll
            for (int n = 0; n < kNQ; ++n)
                st_shared_f32x4(at + (m * kNQ + n) * 128 * 16, dQ[m][n]);
        fence_proxy_async_smem();  // the bulk reduction reads what these stores wrote
        named_arrive(kBwdDqFull + wg, kSync);
    }

    // kSplitD: dQ part h of block i of `head` (the CTA's block t) to the fp32 accumulator.
    // Without the deterministic order each thread adds its own (add_dq): through the writer,
    // four parts a block made the warpgroups wait for its bulk reductions (at d_head 64 and 128
    // the writer's are the faster: docs/results/2026-11-27-h200-hopper-backward-d256.md). With
    // the order the writer warp adds the parts in turn (store_dq).
    __device__ __forceinline__ void hand_dq(const float (&dQ)[kMQ][kNQ][4], int t, int head, int i,
                                            int h) const {
        if (prm.p.dq_semaphore != nullptr)
            store_dq(dQ, t * Cfg::kDqParts + h);
        else
            add_dq(dQ, head, i, h);
    }

    // dQ part h of block i of `head` added to the fp32 accumulator by this thread: 16-byte
    // reductions (a warp's 512 contiguous bytes), in the layout the writer's bulk reductions
    // give it (the part of warpgroup g at (g kDqParts + h) B_r 64 floats; n8 tile n of thread x
    // at float4 n 128 + x).
    __device__ __forceinline__ void add_dq(const float (&dQ)[kMQ][kNQ][4], int head, int i,
                                           int h) const {
        static_assert(Cfg::kSplitD && kMQ == 1, "kSplitD: one m64 tile, a part per warpgroup");
        const BwdParams& p = prm.p;
        float* at = p.dq_accum + w.padded_row(p, {head, i}) * Cfg::kDHead +
                    (wg * Cfg::kDqParts + h) * Cfg::kBr * 64 + ((warp % 4) * 32 + lane) * 4;
#pragma unroll
        for (int n = 0; n < kNQ; ++n)
            red_add_f32x4(at + n * 128 * 4, dQ[0][n]);
    }

    __device__ __forceinline__ static void red_add_f32x4(float* addr, const float (&v)[4]) {
        asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "f"(v[0]),
                     "f"(v[1]), "f"(v[2]), "f"(v[3])
                     : "memory");
    }

    __device__ __forceinline__ static void st_shared_f32x4(uint32_t addr, const float (&v)[4]) {
        asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(v[0]), "f"(v[1]),
                     "f"(v[2]), "f"(v[3])
                     : "memory");
    }

    // dK (scaled) and dV through the staging buffers and TMA stores (rows past seqlen_k and
    // columns past d_head are not written). kVarlen: at the sequence's first rows in the packed
    // tensors; a warpgroup whose rows end inside the sequence's last 64 copies them out of the
    // staging buffer itself (a TMA store would write the next sequence's rows), and a KV block
    // past the sequence's end writes nothing.
    __device__ __forceinline__ void write_dk_dv() {
        const BwdParams& p = prm.p;
        const float scale = p.softmax_scale;
#pragma unroll
        for (int t = 0; t < kNO; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                dK[t][e] *= scale;
        if (p.accumulate) {
            add_fp32(dV, p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride);
            add_fp32(dK, p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride);
            return;
        }
        const Epilogue<Cfg, Cfg::kBc, Cfg::kSplitD> epilogue{wg, warp, lane};
        const int row0 = w.k_start() + w.k_row0;
        if constexpr (Cfg::kVarlen) {
            const int wg_row = Cfg::kSplitD ? 0 : 64 * wg;  // the warpgroup's first row
            const int rows = w.seqlen_k(p) - w.k_row0 - wg_row;
            if (rows < 64) {
                const int64_t at = int64_t(row0 + wg_row);
                epilogue.stage(dV, sm.dv_staging());
                epilogue.copy_rows(
                    sm.dv_staging(),
                    static_cast<Elem*>(p.dv) + w.kv_head * p.dv_head_stride + at * p.dv_row_stride,
                    p.dv_row_stride, rows, p.d_head);
                epilogue.stage(dK, sm.dk_staging());
                epilogue.copy_rows(
                    sm.dk_staging(),
                    static_cast<Elem*>(p.dk) + w.kv_head * p.dk_head_stride + at * p.dk_row_stride,
                    p.dk_row_stride, rows, p.d_head);
                return;
            }
        }
        epilogue.store_tma(dV, sm.dv_staging(), &prm.tma_dv, row0, w.kv_head, w.map_batch());
        epilogue.store_tma(dK, sm.dk_staging(), &prm.tma_dk, row0, w.kv_head, w.map_batch());
    }

    // p.accumulate: this warpgroup's dK or dV added to the fp32 tensor `out` straight from the
    // registers (the wgmma accumulator layout: rows 16 w + lane / 4 and + 8 of the warpgroup's,
    // columns 8 t + 2 (lane % 4) of n8 tile t; kSplitD, the warpgroup's columns of all 64 rows).
    // A thread owns its elements in the call, so one fp32 reduction (RED, no result) per pair
    // gives a read-add-write's sum without its round trip: read-add-writes compile to one load
    // -> store chain after another (the stores may alias the next loads), 2 x 64 global round
    // trips a thread at the end of every CTA. (A reduction flushes subnormal sums to zero, as
    // the dQ reductions do.) Rows past the sequence's keys and columns past d_head are not
    // touched.
    __device__ __forceinline__ void add_fp32(const float (&acc)[kNO][4], void* out,
                                             int64_t batch_stride, int64_t head_stride,
                                             int64_t row_stride) const {
        const BwdParams& p = prm.p;
        const int row_w = (Cfg::kSplitD ? warp % 4 : warp) * 16 + lane / 4;
        const int col0 = (Cfg::kSplitD ? wg * kNO * 8 : 0) + 2 * (lane % 4);
        const int rows = w.seqlen_k(p) - w.k_row0;  // of this block inside the sequence
        float* base = static_cast<float*>(out) + int64_t(w.map_batch()) * batch_stride +
                      int64_t(w.kv_head) * head_stride +
                      int64_t(w.k_start() + w.k_row0) * row_stride;
#pragma unroll
        for (int t = 0; t < kNO; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row_w + 8 * h, col = col0 + 8 * t;
                if (row < rows && col < p.d_head)
                    bwd::red_add2(base + row * row_stride + col, acc[t][2 * h], acc[t][2 * h + 1]);
            }
    }
};

}  // namespace flash::sm90
