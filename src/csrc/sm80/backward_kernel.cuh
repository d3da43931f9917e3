// FlashAttention-2 backward, sm80 family (mma.sync, ldmatrix, cp.async; runs on sm_80+).
//
//   preprocess   D = rowsum(dO * O) - dLSE per query row (fp32); zero the dQ accumulator
//   main         one CTA per (KV block j of B_c keys, KV head, batch); for each query head of
//                the group and each query block i that sees block j:
//                  dP^T = V dO_i^T,  S^T = K Q_i^T  (softcap: t = tanh(S * scale / c))
//                  P^T = exp2(S^T * scale_log2 - LSE_i * log2 e)       (masked: 0)
//                  dS^T = P^T * (dP^T - D_i)     (softcap: times 1 - t^2)
//                  dV += P^T dO_i,  dK += dS^T Q_i,  dQ_i += dS K  (fp32 atomics)
//                then dK * scale and dV are written once.
//   convert      dQ = scale * dQ accumulator, in the input dtype
//
// Rows that see no key (LSE = -inf) and rows past seqlen_q get P = 0 through an LSE of +inf,
// so every gradient they touch is exactly 0. With BwdParams::dq_semaphore (deterministic) the
// KV blocks of a query block add their dQ in a fixed order (last KV block first), so the sums
// are bitwise reproducible.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/backward_common.cuh"
#include "../common/mask.cuh"
#include "../common/numeric.cuh"
#include "../common/params.h"
#include "../common/varlen.cuh"
#include "backward_config.cuh"
#include "backward_gemm.cuh"
#include "smem_tile.cuh"

namespace flash::sm80 {

// The pieces both backward families share (common/backward_common.cuh): the window, the dQ
// orders and turns, the conversions.
using namespace flash::bwd;

// This CTA's sequence (common/varlen.cuh's seq_span): where its rows start in q/dout/dq (and
// the fp32 row buffers) and in k/v/dk/dv, and its lengths; 32-bit starts, kept in smem.
struct BwdSpan {
    int q_start, k_start;
    int seqlen_q, seqlen_k;
};

// The CTA's span in shared memory: read where needed, so that none of it stays in registers
// across the main loop (the accumulators leave none to spare). Written by thread 0 before the
// first barrier of bwd_kernel.
__shared__ BwdSpan bwd_cta_span;

// The span of sequence `batch`, its lengths cut to BwdParams::seqlen_q/k (seq_span_cut: the
// grid, ceil(seqlen_k / B_c) KV blocks, and the deterministic order's turn counters,
// ceil(seqlen_q / B_r) per head, are sized from max_seqlen_q/k; uncut, a longer sequence would
// index past its turn counters and wait for the turn of a KV block the grid does not have, a
// hang). Its keys past the cut get no dk or dv (left unwritten).
__device__ __forceinline__ BwdSpan clamped_span(const BwdParams& p, int batch) {
    return seq_span_cut<BwdSpan>(p, batch);
}

// Two fp32 values from shared memory (addr 8-byte aligned). volatile: the address of a stage
// repeats across iterations, so the load must not be hoisted over the loop's barriers.
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}

// The query blocks [lo, hi] of this CTA's KV block that need no mask (lo > hi: none), set by
// thread 0 before the main loop's first barrier.
__shared__ int2 bwd_cta_unmasked;

// 4-byte async copy (the row vectors of a varlen sequence start at any row).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}

// ---- main kernel ------------------------------------------------------------------------------

template <class Cfg>
struct BackwardCta {
    using Elem = typename Cfg::Elem;
    using P1 = typename Cfg::Phase1;
    using P2 = typename Cfg::Phase2;
    using P3 = typename Cfg::Phase3;
    using PTile = typename Cfg::PTile;
    static constexpr int kBr = Cfg::kBr, kBc = Cfg::kBc;

    // One stage of query-block data in smem: Q, dO, LSE * log2(e) (+inf where P must be 0), D.
    struct Stage {
        uint32_t q, dout, lse, d;
    };

    const BwdParams& p;
    const int lane, warp;
    const int kv_block, k_row0;
    const int batch, kv_head;
    const uint32_t sStage0, sK, sV, sP, sdS;

    // dV (warps of the first half) or dK (the second half) of this warp's tile: each half of
    // the warps computes one of the two phase-2 products over the whole B_c x d_head tile.
    float dKV[P2::kMT][P2::kNT][4];

    __device__ __forceinline__ BackwardCta(const BwdParams& params, unsigned char* smem)
        : p(params),
          lane(threadIdx.x % 32),
          warp(threadIdx.x / 32),
          // Deterministic: the last KV block first, or first to last in the rotated order
          // (see accumulate_dq).
          kv_block(params.dq_semaphore != nullptr && params.dq_rotation == 0
                       ? int(gridDim.x - 1 - blockIdx.x)
                       : int(blockIdx.x)),
          k_row0(kv_block * kBc),
          batch(blockIdx.z),
          kv_head(blockIdx.y),
          sStage0(smem_addr(smem)),
          sK(sStage0 + Cfg::kQStages * Cfg::kStageBytes),
          sV(sK + Cfg::kKTileBytes),
          sP(sV + Cfg::kKTileBytes),
          sdS(sP + Cfg::kPTileBytes) {}

    __device__ __forceinline__ Stage stage(int buf) const {
        const uint32_t base = sStage0 + buf * Cfg::kStageBytes;
        return Stage{base, base + Cfg::kQTileBytes, base + 2 * Cfg::kQTileBytes,
                     base + 2 * Cfg::kQTileBytes + Cfg::kRowVecBytes};
    }
    // Shared addresses of the LSE and D of stage `buf` (32-bit: a generic pointer would hold
    // two registers across the loop).
    __device__ __forceinline__ uint32_t lse_of(int buf) const { return stage(buf).lse; }
    __device__ __forceinline__ uint32_t d_of(int buf) const { return stage(buf).d; }

    // This CTA's sequence (the whole call unless varlen) and its window.
    __device__ __forceinline__ const BwdSpan& span() const { return bwd_cta_span; }
    __device__ __forceinline__ Window win() const {
        return Window{bwd_cta_span.seqlen_k - bwd_cta_span.seqlen_q, p.window_left, p.window_right};
    }

    // Element offset of row 0 of this sequence and `head` in the fp32 row buffers (d_rows,
    // lse_log2, and in units of d_pad dq_accum): (batch, head, row) fixed-length; varlen
    // (head, token), the sequence starting at its first token.
    __device__ __forceinline__ int64_t vec_base(int64_t head) const {
        return p.cu_seqlens_q == nullptr ? (int64_t(batch) * p.heads + head) * p.seqlen_q_pad
                                         : head * p.seqlen_q_pad + span().q_start;
    }

    __device__ __forceinline__ void run() {
        if (k_row0 >= span().seqlen_k)
            return;  // past this sequence's keys (varlen: the grid covers the longest)
        zero(dKV);
        const int k_last = (k_row0 + kBc < span().seqlen_k ? k_row0 + kBc : span().seqlen_k) - 1;
        int64_t q_lo, q_hi;
        win().rows(k_row0, k_last, span().seqlen_q, q_lo, q_hi);
        if (q_hi >= q_lo) {  // else no query row sees these keys: dK = dV = 0
            const int i_first = static_cast<int>(q_lo / kBr);
            const int n_q = static_cast<int>(q_hi / kBr) - i_first + 1;
            const int n = n_q * p.heads_per_kv;  // (head, query block) pairs, head-major
            const int64_t head0 = kv_head * p.heads_per_kv;
            const int64_t k_row = int64_t(span().k_start) + k_row0;
            const Elem* k = static_cast<const Elem*>(p.k) + batch * p.k_batch_stride +
                            kv_head * p.k_head_stride + k_row * p.k_row_stride;
            const Elem* v = static_cast<const Elem*>(p.v) + batch * p.v_batch_stride +
                            kv_head * p.v_head_stride + k_row * p.v_row_stride;
            TileCopy<Cfg, kBc>(threadIdx.x, p.k_row_stride, p.d_head)
                .issue(sK, k, span().seqlen_k - k_row0);
            TileCopy<Cfg, kBc>(threadIdx.x, p.v_row_stride, p.d_head)
                .issue(sV, v, span().seqlen_k - k_row0);
            if (threadIdx.x == 0)
                bwd_cta_unmasked = unmasked_blocks();
            // (head, i) of block t and of block t + 1, stepped without divisions; i the place in
            // the head's cycle, at(i) the query block there (the rotated order starts each
            // head's blocks at kv_block r, cyclically).
            const int shift = p.dq_rotation * kv_block;
            const auto at = [&](int place) {
                const int b = place + shift;
                return b < i_first + n_q ? b : b - n_q;
            };
            issue_query_block(block_src(head0, i_first + shift), 0);  // at(i_first)
            cp_async_commit();  // K and V land with the first query block
            int64_t head = head0, next_head = head0;
            int i = i_first, next_i = i_first;
            for (int t = 0; t < n; ++t) {
                head = next_head;
                i = next_i;
                if (++next_i == i_first + n_q) {
                    next_i = i_first;
                    ++next_head;
                }
                const int buf = Cfg::kPrefetch ? t % 2 : 0;
                if (!Cfg::kPrefetch && t > 0) {
                    const BlockSrc src = block_src(head, at(i));
                    __syncthreads();  // every warp is done with block t - 1's stage
                    issue_query_block(src, 0);
                    cp_async_commit();
                }
                const BlockSrc next = block_src(next_head, at(next_i));  // (with prefetch)
                cp_async_wait<0>();  // block t (the only one in flight) has landed
                // Q_i, dO_i, LSE_i, D_i (K and V on the first) are in smem, and every warp is
                // done with block t - 1: its stage, sP and sdS are free.
                __syncthreads();
                if (Cfg::kPrefetch && t + 1 < n) {
                    // Block t + 1 streams into the other stage while this one computes.
                    issue_query_block(next, buf ^ 1);
                    cp_async_commit();
                }

                probabilities(at(i), stage(buf), lse_of(buf), d_of(buf));
                __syncthreads();  // P^T and dS^T are complete in smem

                accumulate_dk_dv(stage(buf));
                accumulate_dq(head, at(i));
            }
        }
        write_dk_dv();
    }

    // The query blocks that see all B_c keys of this CTA and lie whole inside the sequence.
    __device__ __forceinline__ int2 unmasked_blocks() const {
        return unmasked_query_blocks<kBr, kBc>(k_row0, span().seqlen_q, span().seqlen_k, win());
    }

    // Where query block i of `head` comes from: its Q and dO tiles, the offset of its rows in
    // the fp32 row buffers, and its rows inside the sequence. Reads the span (smem): the loop
    // calls it before a barrier, where the latency costs nothing.
    struct BlockSrc {
        const Elem* q;
        const Elem* dout;
        int64_t vec;     // offset of the block's first row in d_rows and lse_log2
        int valid_rows;  // rows inside the sequence (may exceed B_r)
    };
    __device__ __forceinline__ BlockSrc block_src(int64_t head, int i) const {
        const int q_row0 = i * kBr;
        const int64_t q_row = int64_t(span().q_start) + q_row0;
        return BlockSrc{static_cast<const Elem*>(p.q) + batch * p.q_batch_stride +
                            head * p.q_head_stride + q_row * p.q_row_stride,
                        static_cast<const Elem*>(p.dout) + batch * p.do_batch_stride +
                            head * p.do_head_stride + q_row * p.do_row_stride,
                        vec_base(head) + q_row0, span().seqlen_q - q_row0};
    }

    // Q, dO, LSE * log2(e) and D of a query block into stage `buf` (async copies; the caller
    // commits). Rows past seqlen_q are zero-filled; LSE and D are padded.
    __device__ __forceinline__ void issue_query_block(const BlockSrc& src, int buf) const {
        const Stage st = stage(buf);
        // The copies' per-thread offsets are recomputed here rather than kept in registers
        // across the loop.
        TileCopy<Cfg, kBr>(threadIdx.x, p.q_row_stride, p.d_head)
            .issue(st.q, src.q, src.valid_rows);
        TileCopy<Cfg, kBr>(threadIdx.x, p.do_row_stride, p.d_head)
            .issue(st.dout, src.dout, src.valid_rows);
        if (p.cu_seqlens_q == nullptr) {         // whole blocks of 16-byte chunks (rows padded)
            constexpr int kVecChunks = kBr / 4;  // 16-byte chunks of one row vector
            if (threadIdx.x < 2 * kVecChunks) {
                const int c = threadIdx.x % kVecChunks;
                const bool is_d = threadIdx.x >= kVecChunks;
                cp_async_16((is_d ? st.d : st.lse) + c * 16,
                            (is_d ? p.d_rows : p.lse_log2) + src.vec + c * 4);
            }
        } else {  // varlen: a sequence starts at any row; rows past it are masked in phase 1
            for (int t = threadIdx.x; t < 2 * kBr; t += Cfg::kThreads) {
                const int r = t % kBr;
                const bool is_d = t >= kBr;
                cp_async_4((is_d ? st.d : st.lse) + r * 4,
                           (is_d ? p.d_rows : p.lse_log2) + src.vec + r);
            }
        }
    }

    // Phase 1: P^T and dS^T of this (KV block, query block) into smem, as the input dtype. A
    // warp's query columns go in chunks of at most 32 (Cfg::kP1ChunkNT n8 tiles), so S^T and
    // dP^T hold at most 32 registers next to the resident dK or dV.
    __device__ __forceinline__ void probabilities(int i, const Stage& st, uint32_t sLse,
                                                  uint32_t sD) {
        // Masking is uniform over the CTA: only pairs of blocks on the window's edges or the
        // tails need it.
        const int2 unmasked = bwd_cta_unmasked;
        const bool masked = i < unmasked.x || i > unmasked.y;
        const int q_row0 = i * kBr;
        // Rows and keys of the block inside the sequence (masked blocks only).
        const int q_valid = span().seqlen_q - q_row0, k_valid = span().seqlen_k - k_row0;
#pragma unroll 1
        for (int chunk = 0; chunk < P1::kNT / Cfg::kP1ChunkNT; ++chunk)
            probabilities_chunk(q_row0, P1::col0(warp) + chunk * Cfg::kP1ChunkNT * 8,
                                masked ? q_valid : -1, k_valid, st, sLse, sD);
    }

    // q_valid < 0: a block seen whole (no element masked).
    __device__ __forceinline__ void probabilities_chunk(int q_row0, int c0, int q_valid,
                                                        int k_valid, const Stage& st, uint32_t sLse,
                                                        uint32_t sD) {
        constexpr int kMT = P1::kMT, kNT = Cfg::kP1ChunkNT, kSteps = Cfg::kDHead / 16;
        static_assert((kNT & (kNT - 1)) == 0 && kNT <= 8,
                      "the n8 tiles of a chunk are the low bits of its swizzled chunk index");
        const int r0 = P1::row0(warp);
        float dP[kMT][kNT][4];
        float S[kMT][kNT][4];
        zero(dP);
        warp_gemm<Elem, kSteps>(dP, LoadA<Cfg, kMT>(sV, r0, 0, lane),
                                LoadB<Cfg, kNT>(st.dout, c0, 0, lane));
        zero(S);
        warp_gemm<Elem, kSteps>(S, LoadA<Cfg, kMT>(sK, r0, 0, lane),
                                LoadB<Cfg, kNT>(st.q, c0, 0, lane));
        // One branch per chunk: the unmasked pass is straight-line code, not interleaved with
        // the masked one (a test per element compiles into a jump over the masked code in every
        // m16 x n8 tile).
        if (q_valid < 0)
            store_p_ds<false>(S, dP, r0, q_row0, c0, q_valid, k_valid, sLse, sD);
        else
            store_p_ds<true>(S, dP, r0, q_row0, c0, q_valid, k_valid, sLse, sD);
    }

    // P^T and dS^T of a chunk's S^T and dP^T into smem; kMasked: zero P where the key is past
    // the sequence, the query row past it, or the window hides the pair.
    template <bool kMasked, int kMT, int kNT>
    __device__ __forceinline__ void store_p_ds(float (&S)[kMT][kNT][4], float (&dP)[kMT][kNT][4],
                                               int r0, int q_row0, int c0, int q_valid, int k_valid,
                                               uint32_t sLse, uint32_t sD) {
        // kMasked: per key row of this thread, the query columns it keeps are a range, so each
        // element takes two compares with an immediate (its k = nt * 8 + e) and a select.
        // Column t + k (t: this thread's first) is visible from key `key` iff rel = B + key -
        // (t + k), B = k_row0 - q_row0 - off, lies in [-left, right], the column is below
        // q_valid and the key below k_valid (bounds clamped: clamp_mask_bound).
        const int t = c0 + 2 * (lane % 4);
        int lo_base = -kMaskBig, hi_base = kMaskBig;  // of k, before adding the key
        if constexpr (kMasked) {
            const int64_t b = int64_t(k_row0) - q_row0 - win().off - t;
            if (p.window_right >= 0)
                lo_base = clamp_mask_bound(b - p.window_right);
            if (p.window_left >= 0)
                hi_base = clamp_mask_bound(b + p.window_left);
        }
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
            // The two columns of this thread in the n8 tile: their LSE and D, read once for
            // every m16 tile.
            const int col0 = c0 + nt * 8 + 2 * (lane % 4);
            const float2 lse = ld_shared_f32x2(sLse + col0 * 4);
            const float2 dd = ld_shared_f32x2(sD + col0 * 4);
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                float pv[4], ds[4];
                int k_lo[2], k_hi[2];  // the visible k of this thread's two key rows
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int key = r0 + mt * 16 + lane / 4 + 8 * h;
                    k_lo[h] = key + lo_base;
                    const int hi =
                        key + hi_base < q_valid - 1 - t ? key + hi_base : q_valid - 1 - t;
                    k_hi[h] = key < k_valid ? hi : -1;
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float s = S[mt][nt][e];
                    float dtanh = 1.f;
                    if constexpr (Cfg::kSoftcap) {
                        s = tanh_fast(s * p.softcap_scale);
                        dtanh = 1.f - s * s;
                    }
                    float prob = fast_exp2(fmaf(s, p.scale_log2, -(e % 2 ? lse.y : lse.x)));
                    if (kMasked) {
                        const int k = nt * 8 + e % 2;
                        if (k < k_lo[e / 2] || k > k_hi[e / 2])
                            prob = 0.f;
                    }
                    pv[e] = prob;
                    ds[e] = prob * (dP[mt][nt][e] - (e % 2 ? dd.y : dd.x)) * dtanh;
                }
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    // c0 / 8 is a multiple of the chunk's n8 tiles (a power of 2), so chunk
                    // c0 / 8 + nt of a row sits at the swizzled place of chunk c0 / 8, XOR nt.
                    const int key = r0 + mt * 16 + lane / 4 + 8 * h;
                    const uint32_t off =
                        (tile_offset<PTile>(key, c0 / 8) + (lane % 4) * 4) ^ uint32_t(nt * 16);
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sP + off),
                                 "r"(pack2<Elem>(pv[2 * h], pv[2 * h + 1])));
                    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + off),
                                 "r"(pack2<Elem>(ds[2 * h], ds[2 * h + 1])));
                }
            }
        }
    }

    // The warps of the second half compute dK, those of the first dV; the place of a warp in
    // its half's grid.
    __device__ __forceinline__ bool owns_dk() const { return warp >= Cfg::kWarps / 2; }
    __device__ __forceinline__ int half_warp() const { return warp % (Cfg::kWarps / 2); }

    // Phase 2: dV += P^T dO_i (first half of the warps) or dK += dS^T Q_i (second half) over
    // the query block: one product per warp, on a tile twice as large as with both per warp
    // (fewer ldmatrix per MMA).
    __device__ __forceinline__ void accumulate_dk_dv(const Stage& st) {
        constexpr int kMT = P2::kMT, kNT = P2::kNT, kSteps = kBr / 16;
        const int r0 = P2::row0(half_warp()), c0 = P2::col0(half_warp());
        const bool dk = owns_dk();
        warp_gemm<Elem, kSteps>(dKV, LoadA<PTile, kMT>(dk ? sdS : sP, r0, 0, lane),
                                LoadBTrans<Cfg, kNT>(dk ? st.q : st.dout, c0 / 8, lane));
    }

    // Phase 3: dQ_i += dS K, added to the fp32 accumulator (in a fixed order when
    // deterministic). A warp's d_head columns go in chunks of Cfg::kP3ChunkNT n8 tiles.
    __device__ __forceinline__ void accumulate_dq(int64_t head, int i) {
        int* sem = nullptr;
        int turn = 0;
        if (p.dq_semaphore != nullptr) {  // uniform over the CTA
            // The last KV block first (bwd::dq_turn): under a causal mask each CTA trails the
            // one before by a single query block. With no mask where the launcher chose it,
            // the rotated order (bwd::rotated_dq_turn).
            sem = dq_turn_counter<kBr>(p, batch, head, i);
            turn = p.dq_rotation > 0
                       ? rotated_dq_turn(i / p.dq_rotation, kv_block, int(gridDim.x))
                       : dq_turn<kBr, kBc>(win(), span().seqlen_q, span().seqlen_k, i, kv_block);
            if (threadIdx.x == 0)
                while (ld_acquire(sem) != turn) {
                }
            __syncthreads();  // the previous KV block's additions are visible
        }
        // Rows of the accumulator are the variant's d_head long (p.d_pad == Cfg::kDHead): a
        // compile-time stride, so the reductions of a thread take immediate offsets.
        float* acc = p.dq_accum + (vec_base(head) + i * kBr) * Cfg::kDHead;
#pragma unroll 1
        for (int chunk = 0; chunk < P3::kNT / Cfg::kP3ChunkNT; ++chunk)
            dq_chunk(acc, P3::col0(warp) + chunk * Cfg::kP3ChunkNT * 8);
        if (sem != nullptr) {
            __threadfence();
            __syncthreads();  // every thread's additions are done and fenced
            if (threadIdx.x == 0)
                st_release(sem, turn + 1);
        }
    }

    __device__ __forceinline__ void dq_chunk(float* acc, int c0) {
        constexpr int kMT = P3::kMT, kNT = Cfg::kP3ChunkNT, kSteps = kBc / 16;
        const int r0 = P3::row0(warp);
        float dQ[kMT][kNT][4];
        zero(dQ);
        warp_gemm<Elem, kSteps>(dQ, LoadATrans<PTile, kMT>(sdS, r0 / 8, lane),
                                LoadBTrans<Cfg, kNT>(sK, c0 / 8, lane));
        if (p.dq_tiles) {
            // bwd::DqLayout's tile orders: in each block of 64 rows, n8 tile n at float 512 n,
            // its m16 tile w (rows 16 w ..) at + 128 w.
            static_assert(64 % P3::kRowsPerWarp == 0 || P3::kRowsPerWarp % 64 == 0,
                          "a warp's m16 tiles stay in one 64-row block or start one");
            float* const base =
                acc + (r0 / 64) * 64 * Cfg::kDHead + (r0 % 64) / 16 * 128 + (c0 / 8) * 512;
            const auto tile = [base](int mt, int nt) {
                return base + (mt / 4) * 64 * Cfg::kDHead + (mt % 4) * 128 + nt * 512;
            };
            if (p.dq_tiles == 2) {
                // kLaneTiles (sm_80-89, no vector reductions): a thread's float j at + 32 j +
                // lane, so that a warp's scalar reduction covers 128 contiguous bytes.
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            red_add1(tile(mt, nt) + 32 * j + lane, dQ[mt][nt][j]);
            } else {
                // kWgmmaTiles: a thread's 4 floats at + 4 lane, one 16-byte reduction.
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < kNT; ++nt)
                        red_add4(tile(mt, nt) + 4 * lane, dQ[mt][nt][0], dQ[mt][nt][1],
                                 dQ[mt][nt][2], dQ[mt][nt][3]);
            }
            return;
        }
        float* const at = acc + (r0 + lane / 4) * Cfg::kDHead + c0 + 2 * (lane % 4);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    red_add2(at + (mt * 16 + 8 * h) * Cfg::kDHead + nt * 8, dQ[mt][nt][2 * h],
                             dQ[mt][nt][2 * h + 1]);
    }

    // dK (scaled) and dV in the input dtype, or with p.accumulate added to the fp32 tensors (a
    // thread owns its elements: one fp32 reduction per pair, no result, gives a read-add-write's
    // sum without a load -> store chain per pair); rows past seqlen_k and columns past d_head
    // are not written.
    __device__ __forceinline__ void write_dk_dv() {
        const bool dk = owns_dk();
        const int64_t k_row = int64_t(span().k_start) + k_row0;
        const int64_t offset =
            dk ? batch * p.dk_batch_stride + kv_head * p.dk_head_stride + k_row * p.dk_row_stride
               : batch * p.dv_batch_stride + kv_head * p.dv_head_stride + k_row * p.dv_row_stride;
        const int64_t stride = dk ? p.dk_row_stride : p.dv_row_stride;
        const float scale = dk ? p.softmax_scale : 1.f;
        if (p.accumulate) {
            float* out = static_cast<float*>(dk ? p.dk : p.dv) + offset;
            for_each_pair([&](int row, int col, float x, float y) {
                red_add2(out + row * stride + col, x * scale, y * scale);
            });
            return;
        }
        Elem* out = static_cast<Elem*>(dk ? p.dk : p.dv) + offset;
        for_each_pair([&](int row, int col, float x, float y) {
            *reinterpret_cast<uint32_t*>(out + row * stride + col) =
                pack2<Elem>(x * scale, y * scale);
        });
    }

    // fn(row, col, x, y) for each pair of this thread's dK or dV values (columns col, col + 1 of
    // the row, relative to the CTA's first key row) inside the sequence's keys and d_head.
    template <class Fn>
    __device__ __forceinline__ void for_each_pair(Fn&& fn) const {
        const int r0 = P2::row0(half_warp()), c0 = P2::col0(half_warp());
#pragma unroll
        for (int mt = 0; mt < P2::kMT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = r0 + mt * 16 + lane / 4 + 8 * h;
                if (k_row0 + row >= span().seqlen_k)
                    continue;
#pragma unroll
                for (int nt = 0; nt < P2::kNT; ++nt) {
                    const int col = c0 + nt * 8 + 2 * (lane % 4);
                    if (col >= p.d_head)
                        continue;
                    fn(row, col, dKV[mt][nt][2 * h], dKV[mt][nt][2 * h + 1]);
                }
            }
    }
};

// One CTA per SM at most (8 warps, large tiles): ptxas may use up to 255 registers.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_kernel(const __grid_constant__ BwdParams params) {
    extern __shared__ __align__(128) unsigned char smem[];
    if (threadIdx.x == 0)
        bwd_cta_span = clamped_span(params, blockIdx.z);
    __syncthreads();  // the span is readable by every thread
    BackwardCta<Cfg> cta(params, smem);
    cta.run();
}

}  // namespace flash::sm80
