// The mainloop of the Hopper forward: what the producer loads for each tile (ForwardLoader) and
// what a consumer warpgroup computes from it (Consumer).
//
// A CTA owns B_r = 64 x kConsumerWGs query rows of one (batch, head); consumer warpgroup g owns
// rows 64g .. 64g + 63 end to end. Per KV block j (from the last to the first):
//   S_j = Q K_j^T -> softcap -> mask (key tail; window edges with kMask) -> online softmax
//   O += P_j V_j
// issued as S_j, then (O rescaled for block j-1 while S_j runs) P_{j-1} V_{j-1}, so that the
// tensor cores never wait on a warpgroup's softmax when there is work of the other one to do;
// with kOverlap the softmax of S_j runs while P_{j-1} V_{j-1} is still on the tensor cores.
//
// Pipeline: barriers k_full/v_full[s] complete when the TMA copies of stage s have landed (the
// producer arrives once with the byte count); k_empty/v_empty[s] complete when every consumer
// warp has finished the GEMM reading that stage. Use u of stage s waits for phase parity u & 1.
// With kCluster the two CTAs of a cluster take neighbouring query blocks of one (batch, head) and
// the same K/V blocks: each producer copies half of a block's rows and multicasts them to both
// CTAs (each full barrier still counts the whole block's bytes), and each consumer warp arrives
// on the empty barriers of both CTAs, so neither producer refills a stage the other still reads.
// With kTileOverlap a persistent CTA hands one tile to the next without draining: the next
// tile's S_0 is issued before the current tile's last P V (its Q in the second Q buffer), its
// softmax runs while that P V is on the tensor cores, and the epilogue follows.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/ldmatrix.cuh"
#include "../common/mask.cuh"
#include "../common/numeric.cuh"
#include "../common/params.h"
#include "../common/varlen.cuh"
#include "epilogue.cuh"
#include "forward_params.cuh"
#include "forward_smem_layout.cuh"
#include "forward_softmax.cuh"
#include "forward_tile.cuh"
#include "fp8_v_transpose.cuh"
#include "named_barriers.cuh"
#include "ptx.cuh"
#include "tma_loader.cuh"
#include "wgmma.cuh"

namespace flash::sm90 {

// The producer's side of the forward: Q of each tile, and its K/V blocks through the stage ring.
// K/V blocks are numbered across the CTA's tiles (g): block g goes to stage g % kStages, its use
// g / kStages of it.
template <class Cfg>
struct ForwardLoader : TmaLoader<Cfg> {
    const FwdKernelParams& prm;
    const SmemLayout<Cfg>& sm;

    // Q of tile use u (the CTA's u-th tile with work), once the S GEMMs of the tile that used its
    // buffer before are done.
    __device__ __forceinline__ void load_q(const ForwardTile<Cfg>& w, int u) const {
        if (Cfg::kPersistent && u >= Cfg::kQBuffers)
            mbar_wait(sm.q_empty(u), SmemLayout<Cfg>::q_phase(u) ^ 1);
        this->template load_tile<Cfg::kBr, /*kShared=*/false>(
            sm.q(u), &prm.tma_q, sm.q_full(u), w.block, w.head, w.map_batch(), w.q_start());
    }
    // Block i of the tile's visit order, pipeline block g, once its stage is released. Both CTAs
    // of a cluster visit the same K/V blocks: each copies half and multicasts it (kShared).
    __device__ __forceinline__ void load_k(const ForwardTile<Cfg>& w, int i, int g) const {
        const int s = g % Cfg::kStages;
        wait_buffer_free(sm.k_empty(s), g / Cfg::kStages);
        this->template load_tile<Cfg::kBc, /*kShared=*/true>(sm.k(s), &prm.tma_k, sm.k_full(s),
                                                             w.kv_block(i), w.kv_head,
                                                             w.map_batch(), w.k_start());
    }
    // FP8: into V raw, once the producer warps have transposed its previous tile (transpose_v).
    __device__ __forceinline__ void load_v(const ForwardTile<Cfg>& w, int i, int g) const {
        const int s = g % Cfg::kStages;
        if constexpr (Cfg::kFp8) {
            wait_buffer_free(sm.v_raw_empty(s), g / Cfg::kStages);
            this->template load_tile<Cfg::kBc, /*kShared=*/false>(
                sm.v_raw(s), &prm.tma_v, sm.v_raw_full(s), w.kv_block(i), w.kv_head, w.map_batch(),
                w.k_start());
        } else {
            wait_buffer_free(sm.v_empty(s), g / Cfg::kStages);
            this->template load_tile<Cfg::kBc, /*kShared=*/true>(sm.v(s), &prm.tma_v, sm.v_full(s),
                                                                 w.kv_block(i), w.kv_head,
                                                                 w.map_batch(), w.k_start());
        }
    }
    // FP8, every thread pt (0 .. 127) of the producer warpgroup: pipeline block g's V, once TMA
    // has landed it and the consumers have released the stage's transposed V, into that stage
    // (fp8_v_transpose.cuh), keys from `keep` on zeroed; then each warp releases V raw and
    // arrives on v_full.
    __device__ __forceinline__ void transpose_v(int g, int pt, int keep) const {
        const int s = g % Cfg::kStages, use = g / Cfg::kStages;
        mbar_wait(sm.v_raw_full(s), use & 1);
        wait_buffer_free(sm.v_empty(s), use);
        VTranspose<Cfg>::run(sm.v_raw(s), sm.v(s), pt, keep);
        fence_proxy_async_smem();  // the consumers' wgmma (async proxy) reads these stores
        __syncwarp();
        if (pt % 32 == 0) {
            mbar_arrive(sm.v_raw_empty(s));
            mbar_arrive(sm.v_full(s));
        }
    }
};

// One consumer warpgroup: its 64 query rows through every KV block.
template <class Cfg>
struct ForwardConsumer {
    using Elem = typename Cfg::Elem;
    static constexpr int kNS = Cfg::kNTilesS, kNO = Cfg::kNTilesO;
    // k16 steps (k32 with FP8: the same 32 bytes of a row per step)
    static constexpr int kStepsQK = Cfg::kDHead * Cfg::kElemBytes / 32;
    static constexpr int kStepsPV = Cfg::kBc * Cfg::kElemBytes / 32;

    const FwdKernelParams& prm;
    const SmemLayout<Cfg>& sm;
    const ForwardLoader<Cfg>& loader;
    const int wg, warp, lane;  // warpgroup among the consumers; warp among the consumer warps
    // The current tile: a copy with kTileOverlap (the next one is set up while the current one
    // ends), else the caller's (a pointer keeps ptxas from copying its fields).
    std::conditional_t<Cfg::kTileOverlap, ForwardTile<Cfg>, const ForwardTile<Cfg>*> work{};
    __device__ __forceinline__ const ForwardTile<Cfg>& tile() const {
        if constexpr (Cfg::kTileOverlap)
            return work;
        else
            return *work;
    }
    __device__ __forceinline__ void set_tile(const ForwardTile<Cfg>& w) {
        if constexpr (Cfg::kTileOverlap)
            work = w;
        else
            work = &w;
    }
    int g0 = 0;  // pipeline number of the tile's first K/V block
    int qu = 0;  // its Q use (SmemLayout::q)

    float O[kNO][4];
    float S[kNS][4];
    uint32_t P[kStepsPV][4];                     // P of the previous block as wgmma A fragments
    uint32_t Qf[Cfg::kQRegs ? kStepsQK : 1][4];  // kQRegs: the tile's Q as wgmma A fragments
    float corr[2];  // O's rescale factors for the previous block's softmax
    Softmax<Cfg> softmax;
    // FP8: the tile's descales, q's times k's (folded into the scores' scale) and v's (into O's
    // normalisation).
    float qk_descale = 1.f, v_descale = 1.f;

    __device__ __forceinline__ void load_descales(const ForwardTile<Cfg>& w) {
        if constexpr (Cfg::kFp8) {
            const FwdParams& p = prm.p;
            float d[3];
#pragma unroll
            for (int i = 0; i < 3; ++i)
                d[i] = p.descale[i] == nullptr ? 1.f
                                               : p.descale[i][w.batch * p.descale_batch_stride[i] +
                                                              w.kv_head * p.descale_head_stride[i]];
            qk_descale = d[0] * d[1];
            v_descale = d[2];
        }
    }
    // The scores' scale into exp2 (with a softcap the descale goes inside the tanh).
    __device__ __forceinline__ float scale_log2() const {
        return Cfg::kFp8 && !Cfg::kSoftcap ? prm.p.scale_log2 * qk_descale : prm.p.scale_log2;
    }

    // ---- GEMMs --------------------------------------------------------------------------------

    // S = Q K_i^T, K-major operands: Q rows of this warpgroup and K_i rows, 16 columns of d per
    // instruction (a 32-byte step inside the swizzled 128-byte row, then the next panel).
    // With kQRegs, A is Qf (load_q_regs()).
    __device__ __forceinline__ void issue_qk(int s) {
        const uint32_t q0 = smem_u32(sm.q(qu)) + wg * 64 * 128;
        const uint32_t k0 = smem_u32(sm.k(s));
#pragma unroll
        for (int kk = 0; kk < kStepsQK; ++kk) {
            const uint32_t step = (kk % 4) * 32;  // bytes into the 128-byte row
            const uint64_t b = desc_sw128(k0 + (kk / 4) * Cfg::kBc * 128 + step, 16, 1024);
            if constexpr (Cfg::kQRegs) {
                Wgmma<Cfg::kBc, Elem>::rs_k(S, Qf[kk], b, kk > 0 ? 1u : 0u);
            } else {
                const uint64_t a = desc_sw128(q0 + (kk / 4) * Cfg::kBr * 128 + step, 16, 1024);
                Wgmma<Cfg::kBc, Elem>::ss(S, a, b, kk > 0 ? 1u : 0u);
            }
        }
    }

    // kQRegs, once Q of the tile has landed: this warp's 16 rows, one ldmatrix.x4 per k16 step
    // (lanes 8i .. 8i + 7 address tile i: rows + 8 for odd i, the step's upper 8 columns for
    // i >= 2) from the swizzled panels. sQ is released once the first S GEMM that reads Qf has
    // completed (q_regs_consumed()), not here: an mbarrier arrive issued right after the
    // ldmatrix does not wait for its reads, and the producer's next TMA copy into sQ then
    // overwrote rows still being read (docs/results/2026-11-29-h200-q-release-race.md).
    __device__ __forceinline__ void load_q_regs() {
        const int r = (warp % 4) * 16 + lane % 8 + 8 * ((lane / 8) % 2);  // of the warpgroup
        const uint32_t q0 = smem_u32(sm.q(qu)) + (wg * 64 + r) * 128;
#pragma unroll
        for (int kk = 0; kk < kStepsQK; ++kk) {
            const int chunk = 2 * (kk % 4) + lane / 16;  // 16-byte chunk of the 128-byte row
            ldmatrix_x4(Qf[kk], q0 + (kk / 4) * Cfg::kBr * 128 + ((chunk ^ (r & 7)) * 16));
        }
    }

    // O += P V_i: B is V (kv rows x d) MN-major: 8-row groups 1024 bytes apart (SBO), 64-column
    // panels B_c x 128 bytes apart (LBO); 16 kv rows per instruction. FP8: V transposed (d rows
    // of B_c keys, K-major as K in issue_qk; at B_c 64 and 192 panels of 64 keys, d 64-byte
    // rows each), 32 keys per instruction.
    __device__ __forceinline__ void issue_pv(int s) {
        const uint32_t v0 = smem_u32(sm.v(s));
#pragma unroll
        for (int kk = 0; kk < kStepsPV; ++kk) {
            if constexpr (Cfg::kFp8) {
                // rows of B_c keys: 128 bytes (128-byte swizzle) or 64 (64-byte swizzle)
                const uint64_t b =
                    Cfg::kBc == 128
                        ? desc_sw128(v0 + kk * 32, 16, 1024)
                        : desc_sw64(v0 + (kk / 2) * Cfg::kDHead * 64 + (kk % 2) * 32, 16, 512);
                Wgmma<Cfg::kDHead, Elem>::rs_k(O, P[kk], b, 1u);
            } else {
                const uint64_t b = desc_sw128(v0 + kk * 16 * 128, Cfg::kBc * 128, 1024);
                Wgmma<Cfg::kDHead, Elem>::rs(O, P[kk], b, 1u);
            }
        }
    }

    // P (fp32 accumulators of S) -> A fragments of P V: 16-bit, or FP8 in place (the k32
    // fragment's register r holds 4 bytes of one row: n8 tiles 4kk + 2(r / 2) and + 1, row + 8
    // for odd r; fp8_v_transpose.cuh orders V's keys to match).
    __device__ __forceinline__ void convert_p() {
        if constexpr (Cfg::kFp8) {
#pragma unroll
            for (int kk = 0; kk < kStepsPV; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int t = 4 * kk + 2 * (r / 2), e = 2 * (r % 2);
                    P[kk][r] = pack4_e4m3(S[t][e], S[t][e + 1], S[t + 1][e], S[t + 1][e + 1]);
                }
        } else {
            to_a_fragments<Elem>(S, P);
        }
    }

    // ---- turns (ping-pong) and stage release --------------------------------------------------

    // Ping-pong: warpgroup wg issues its GEMMs after waiting on barrier kTurnBarrier + wg, which
    // the other warpgroup arrives on once it has issued its own; so the two warpgroups' GEMMs
    // alternate on the tensor cores and one's softmax runs under the other's GEMMs.
    __device__ __forceinline__ void wait_turn() const {
        if constexpr (Cfg::kPingPong)
            named_sync(kTurnBarrier + wg, 2 * 128);
    }
    __device__ __forceinline__ void pass_turn() const {
        if constexpr (Cfg::kPingPong)
            named_arrive(kTurnBarrier + (1 - wg), 2 * 128);
    }
    // Every consumer warp arrives once: the stage's GEMM reads are complete.
    __device__ __forceinline__ void release(uint64_t* bar) const {
        __syncwarp();
        if (lane == 0)
            mbar_arrive(bar);
    }
    // A K/V stage: with kCluster on the barrier of both CTAs (lane r arrives in CTA r).
    __device__ __forceinline__ void release_kv(uint64_t* bar) const {
        if constexpr (Cfg::kCluster) {
            __syncwarp();
            if (lane < Cfg::kClusterCtas)
                mbar_arrive_cluster(bar, lane);
        } else {
            release(bar);
        }
    }
    // Without a producer warpgroup, consumer thread 0 refills the stage it just released.
    __device__ __forceinline__ bool refills() const { return !Cfg::kWarpSpec && threadIdx.x == 0; }

    // S_i -> P_i: softcap, masks, softmax (corr: O's rescale factors for this block).
    template <bool kFirst>
    __device__ __forceinline__ void softmax_block(int i, float (&corr)[2]) {
        const FwdParams& p = prm.p;
        const ForwardTile<Cfg>& w = tile();
        const int j = w.kv_block(i);
        const int seqlen_k = w.seqlen_k(p);
        if constexpr (Cfg::kSoftcap) {
            const float softcap_scale = Cfg::kFp8 ? p.softcap_scale * qk_descale : p.softcap_scale;
#pragma unroll
            for (int t = 0; t < kNS; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    S[t][e] = tanh_mufu(S[t][e] * softcap_scale);
        }
        if (w.needs_mask(j, seqlen_k)) {
            float (&S3)[1][kNS][4] = reinterpret_cast<float (&)[1][kNS][4]>(S);
            const WindowMask<Cfg> mask(w.seqlen_q(p), seqlen_k, w.q_row0, warp * 16, lane);
            // Blocks on one edge check one bound (the right one also holds the key tail).
            const bool lo = Cfg::kMask && j < w.kv.full_first;
            const bool hi = !Cfg::kMask || j > w.kv.full_last;
            if (lo && hi)
                mask.template apply<true, true>(S3, j * Cfg::kBc, seqlen_k, p);
            else if (lo)
                mask.template apply<true, false>(S3, j * Cfg::kBc, seqlen_k, p);
            else
                mask.template apply<false, true>(S3, j * Cfg::kBc, seqlen_k, p);
        }
        softmax.template scores<kFirst>(S, scale_log2(), corr);
    }

    // kVarlen, before P V of visit i from stage s: the block that holds the sequence's last key
    // holds the next sequence's rows past it (the packed tensor's; TMA zero-fills only past its
    // end). P is 0 there, but 0 x inf or NaN is NaN, so this warpgroup zeroes those V rows (whole
    // 128-byte rows of every panel: the swizzle permutes chunks within a row). Both warpgroups
    // write the same zeros, each before its own GEMM reads them; the stage is refilled only after
    // both have released it. FP8: the producer's transpose zeroes those keys (transpose_v).
    __device__ __forceinline__ void clear_v_tail(int i, int s) const {
        if constexpr (Cfg::kVarlen && !Cfg::kFp8) {
            const ForwardTile<Cfg>& w = tile();
            const int j = w.kv_block(i), seqlen_k = w.seqlen_k(prm.p);
            if (!w.kv_tail(j, seqlen_k))
                return;
            const int keep = seqlen_k - j * Cfg::kBc;  // rows of the sequence, 1 .. B_c - 1
            zero_rows<Cfg::kBc, Cfg::kPanels>(sm.v(s), keep);
            fence_proxy_async_smem();             // the wgmma (async proxy) reads the zeros
            named_sync(kVTailBarrier + wg, 128);  // ... every thread of the warpgroup wrote
        }
    }

    // Pipeline block g lives in stage g % kStages; its use g / kStages of that stage waits for
    // phase parity (g / kStages) & 1.
    __device__ __forceinline__ static int stage(int g) { return g % Cfg::kStages; }
    __device__ __forceinline__ static uint32_t phase(int g) { return (g / Cfg::kStages) & 1; }

    // One tile: q_use counts the CTA's tiles with work before it (Q buffers and phases), g its
    // first pipeline block. One guard around the blocks (split guards cost ptxas 2.5% more SASS).
    __device__ __forceinline__ void run(const ForwardTile<Cfg>& w, int q_use, int g) {
        start(w, q_use, g);
        if (w.n_blocks > 0) {
            first_block();
            body();
            last_block();
        }
        finish();
    }

    __device__ __forceinline__ void clear_o() {
#pragma unroll
        for (int t = 0; t < kNO; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                O[t][e] = 0.f;
    }

    // A new tile: O cleared, the softmax state reset.
    __device__ __forceinline__ void start(const ForwardTile<Cfg>& w, int q_use, int g) {
        set_tile(w);
        load_descales(w);
        g0 = g;
        qu = q_use;
        clear_o();
        softmax.init();
        if constexpr (Cfg::kPingPong) {
            if (wg == 1)
                named_arrive(kTurnBarrier,
                             2 * 128);  // warpgroup 0 takes the first turn of the tile
        }
    }

    // Block 0: S_0 alone, and its softmax.
    __device__ __forceinline__ void first_block() {
        const int n = tile().n_blocks;
        mbar_wait(sm.q_full(qu), SmemLayout<Cfg>::q_phase(qu));  // Q has landed: sQ readable
        if constexpr (Cfg::kQRegs)
            load_q_regs();
        mbar_wait(sm.k_full(stage(g0)), phase(g0));  // K_0 has landed
        wait_turn();
        wgmma_fence();
        issue_qk(stage(g0));
        wgmma_commit();
        pass_turn();
        wgmma_wait<0>();  // S_0 is in registers: this warp is done with sK of stage g0
        fence_regs(S);
        release_kv(sm.k_empty(stage(g0)));
        q_regs_consumed();
        if (n == 1)
            s_gemms_done();
        if (refills() && Cfg::kStages < n)
            loader.load_k(tile(), Cfg::kStages, g0 + Cfg::kStages);
        softmax_block<true>(0, corr);
        convert_p();
    }

    // Blocks 1 .. n - 1: S_i with P_{i-1} V_{i-1}.
    __device__ __forceinline__ void body() {
        for (int i = 1; i < tile().n_blocks; ++i)
            step(i);
    }

    // P_{n-1} V_{n-1}.
    __device__ __forceinline__ void last_block() {
        const int gl = g0 + tile().n_blocks - 1;
        softmax.rescale(O, corr);
        mbar_wait(sm.v_full(stage(gl)), phase(gl));  // V_{n-1} has landed
        clear_v_tail(tile().n_blocks - 1, stage(gl));
        wait_turn();
        wgmma_fence();
        issue_pv(stage(gl));
        wgmma_commit();
        pass_turn();
        wgmma_wait<0>();  // O is complete in registers; sV of stage gl may be refilled
        fence_regs(O);
        release_kv(sm.v_empty(stage(gl)));
    }

    // O and LSE out.
    __device__ __forceinline__ void finish() {
        if constexpr (Cfg::kPingPong) {
            if (wg == 0)
                named_sync(kTurnBarrier,
                           2 * 128);  // the turn warpgroup 1 passed last; nothing waits on it
        }
        float inv[2], lse[2];
        softmax.totals(inv, lse, scale_log2());
        if constexpr (Cfg::kFp8)
            inv[0] *= v_descale, inv[1] *= v_descale;
        Softmax<Cfg>::normalize(O, inv);
        write_output(tile(), lse);
    }

    // kTileOverlap, in place of last_block() and finish() and the next tile's start() and
    // first_block() (q_use and g of it as for start()) when both tiles have KV blocks: the next S_0
    // is issued before P_{n-1} V_{n-1} and its softmax runs while that is on the tensor cores; then
    // this tile's O and LSE leave, and the next tile continues with body().
    __device__ __forceinline__ void end_into(const ForwardTile<Cfg>& next, int q_use, int g) {
        const ForwardTile<Cfg> w = work;  // for its output, after the tile moves on
        const int n = w.n_blocks;
        const int gl = g0 + n - 1, s = stage(g), sl = stage(gl);
        mbar_wait(sm.q_full(q_use), SmemLayout<Cfg>::q_phase(q_use));  // the next Q has landed
        qu = q_use;
        if constexpr (Cfg::kQRegs)
            load_q_regs();                  // the current tile's S GEMMs are complete
        mbar_wait(sm.k_full(s), phase(g));  // the next tile's K_0 has landed
        wgmma_fence();
        issue_qk(s);
        wgmma_commit();
        fence_regs(O);  // the rescale runs under the next tile's S_0
        softmax.rescale(O, corr);
        mbar_wait(sm.v_full(sl), phase(gl));  // this tile's V_{n-1} has landed
        clear_v_tail(n - 1, sl);
        wgmma_fence();
        issue_pv(sl);
        wgmma_commit();
        float inv[2], lse[2];
        softmax.totals(inv, lse, scale_log2());  // this tile's row sums are complete
        softmax.init();
        set_tile(next);
        g0 = g;
        wgmma_wait<1>();  // the next S_0 has landed; P_{n-1} V_{n-1} may still run
        fence_regs(S);
        q_regs_consumed();  // the next tile's Q
        softmax_block<true>(0, corr);
        // Released after the softmax (an address that depends on it; see step()).
        const int after = __float2int_rz((softmax.l[0] + softmax.l[1]) * 0.f);
        release_kv(sm.k_empty(s) + after);
        if (next.n_blocks == 1)
            s_gemms_done();
        wgmma_wait<0>();  // this tile's O is complete: V_{n-1} may be refilled
        fence_regs(O);
        release_kv(sm.v_empty(sl));
        Softmax<Cfg>::normalize(O, inv);
        write_output(w, lse);
        clear_o();
        convert_p();
    }

    // Persistent grid: this warp no longer reads the tile's Q (its S GEMMs are done, or with
    // kQRegs Q is in registers); sQ may take the next Q.
    __device__ __forceinline__ void release_q() const {
        if constexpr (Cfg::kPersistent)
            release(sm.q_empty(qu));
    }
    // kQRegs: the first S GEMM of the tile has completed, so Qf holds what ldmatrix read and
    // sQ may take the next Q.
    __device__ __forceinline__ void q_regs_consumed() const {
        if constexpr (Cfg::kQRegs)
            release_q();
    }
    // This warp's last S GEMM of the tile is done: sQ is released here unless
    // q_regs_consumed() released it already.
    __device__ __forceinline__ void s_gemms_done() const {
        if constexpr (!Cfg::kQRegs)
            release_q();
    }

    // Block i >= 1: S_i, then P_{i-1} V_{i-1} on the tensor cores (O rescaled for block i-1
    // while S_i runs), then the softmax of S_i (with kOverlap while P_{i-1} V_{i-1} runs).
    __device__ __forceinline__ void step(int i) {
        const int g = g0 + i, s = stage(g), sp = stage(g - 1);
        mbar_wait(sm.k_full(s), phase(g));  // K_i has landed
        wait_turn();                        // ping-pong: the other warpgroup has issued its GEMMs
        wgmma_fence();
        issue_qk(s);
        wgmma_commit();
        fence_regs(O);  // the rescale below is issued after S_i, so it runs under it
        softmax.rescale(O, corr);
        mbar_wait(sm.v_full(sp), phase(g - 1));  // V_{i-1} has landed
        clear_v_tail(i - 1, sp);
        wgmma_fence();  // O was rescaled by ordinary instructions
        issue_pv(sp);
        wgmma_commit();
        pass_turn();
        const int n = tile().n_blocks;
        if constexpr (Cfg::kOverlap) {
            wgmma_wait<1>();  // S_i has landed; P_{i-1} V_{i-1} may still run
            fence_regs(S);
            softmax_block<false>(i, corr);
            // K_i is released through an address that depends on the softmax's row sums (an
            // offset that is always 0): ptxas keeps memory operations in order with the wait
            // below but would otherwise schedule the softmax after it, off the P V GEMM.
            const int after = __float2int_rz((softmax.l[0] + softmax.l[1]) * 0.f);
            release_kv(sm.k_empty(s) + after);
            if (i == n - 1)
                s_gemms_done();
            wgmma_wait<0>();  // P_{i-1} V_{i-1} is done: V_{i-1} may be refilled
            fence_regs(O);
            release_kv(sm.v_empty(sp));
        } else {
            wgmma_wait<0>();  // S_i and O are in registers: K_i and V_{i-1} may be refilled
            fence_regs(S);
            fence_regs(O);
            release_kv(sm.k_empty(s));
            release_kv(sm.v_empty(sp));
            if (i == n - 1)
                s_gemms_done();
            softmax_block<false>(i, corr);
        }
        if (refills()) {
            if (i + Cfg::kStages < n)
                loader.load_k(tile(), i + Cfg::kStages, g + Cfg::kStages);
            if (i - 1 + Cfg::kStages < n)
                loader.load_v(tile(), i - 1 + Cfg::kStages, g - 1 + Cfg::kStages);
        }
        convert_p();
    }

    // O (normalised) and LSE. Rows past seqlen_q and columns past d_head are not written. O
    // leaves through the epilogue (kTmaStore: staged in sQ, whose S GEMMs are complete, or on a
    // persistent grid in O's own buffer, then TMA stores) or straight from registers; with
    // kVarlen a warpgroup whose rows cross its sequence's end copies them out of the staging
    // buffer itself (a TMA store would write the next sequence's rows).
    __device__ __forceinline__ void write_output(const ForwardTile<Cfg>& w, const float (&lse)[2]) {
        const FwdParams& p = prm.p;
        const int row_in_cta = warp * 16 + lane / 4;  // and + 8
        // kVarlen: the sequence read again (two loads that hit in cache), so that the consumers
        // keep only its key count in registers through the tile.
        int q_start = 0, seqlen_q = p.seqlen_q;
        if constexpr (Cfg::kVarlen) {
            const SeqSpan span = seq_span(p, w.batch);
            q_start = int(span.q_start);
            seqlen_q = span.seqlen_q;
        }
        if (p.lse != nullptr && lane % 4 == 0) {
            float* lse_out = p.lse + int64_t(w.batch) * p.lse_batch_stride +
                             int64_t(w.head) * p.lse_head_stride + q_start + w.q_row0;
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (w.q_row0 + row_in_cta + 8 * h < seqlen_q)
                    lse_out[row_in_cta + 8 * h] = lse[h];
        }
        using OutElem = typename Cfg::OutElem;
        OutElem* o = static_cast<OutElem*>(p.o) + int64_t(w.batch) * p.o_batch_stride +
                     int64_t(w.head) * p.o_head_stride + int64_t(q_start) * p.o_row_stride;
        if constexpr (Cfg::kTmaStore) {
            const Epilogue<Cfg> epilogue{wg, warp, lane};
            const int rows = seqlen_q - w.q_row0 - 64 * wg;  // of this warpgroup's 64
            // (A tile past its sequence's end stages too: skipping it made ptxas spill at d 256.)
            epilogue.stage(O, sm.o());
            if (!Cfg::kVarlen || rows >= 64)
                epilogue.issue_tma(sm.o(), &prm.tma_o, q_start + w.q_row0, w.head, w.map_batch());
            else
                epilogue.copy_rows(sm.o(), o + int64_t(w.q_row0 + 64 * wg) * p.o_row_stride,
                                   p.o_row_stride, rows, p.d_head);
        } else {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = w.q_row0 + row_in_cta + 8 * h;
                if (row >= seqlen_q)
                    continue;
                OutElem* o_row = o + int64_t(row) * p.o_row_stride;
#pragma unroll
                for (int t = 0; t < kNO; ++t) {
                    const int col = t * 8 + (lane % 4) * 2;
                    if (col < p.d_head)
                        *reinterpret_cast<uint32_t*>(o_row + col) =
                            pack2<OutElem>(O[t][2 * h], O[t][2 * h + 1]);
                }
            }
        }
    }
};

}  // namespace flash::sm90
