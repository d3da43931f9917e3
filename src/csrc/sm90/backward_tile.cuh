// What a CTA of the Hopper backward works on and where (the algorithm: backward_config.cuh):
// the kernel's argument (BwdKernelParams), its shared memory and mbarriers (BwdSmem), and its
// tile (BackwardTile): the KV block, the (query head, query block) pairs it visits, and the
// deterministic order's turns.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/backward_common.cuh"
#include "../common/params.h"
#include "../common/varlen.cuh"
#include "backward_config.cuh"
#include "fast_div.cuh"
#include "ptx.cuh"
#include "tensor_map.h"

namespace flash::sm90 {

// The kernel's argument: the call's BwdParams and the TMA maps, 4-D (d_head, seqlen, heads,
// batch), 128-byte swizzled: Q and dO in boxes of 64 columns x B_r rows, K and V x B_c rows, dK
// and dV x 64 rows (one warpgroup's, stores).
struct BwdKernelParams {
    BwdParams p;
    CUtensorMap tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv;
    // The KV block of CTA x: kv_block0 + kv_block_step * x (0, 1; the deterministic order:
    // the last KV block first). Affine in kernel parameters, so that ptxas rematerialises it
    // rather than keep it in a register.
    int kv_block0, kv_block_step;
    // The rotated deterministic order (bwd::rotated_dq_turn; no mask, KV blocks first to last):
    // over rotated_kv_blocks KV blocks, KV block j visiting each head's query blocks from
    // j * rotation.d on, cyclically; rotation_step = rotation.d, or 0 where the order is not
    // rotated.
    int rotated_kv_blocks, rotation_step;
    FastDiv rotation;
};

// Shared memory (offsets: BwdConfig) and its mbarriers (S = kStages, D = kDoStages):
//   0 kv_full | 1 .. S q_full | 1+S .. do_full | 1+S+D .. q_empty | 1+2S+D .. do_empty
template <class Cfg>
struct BwdSmem {
    unsigned char* base;  // 1024-byte aligned

    __device__ __forceinline__ static BwdSmem aligned(unsigned char* raw) {
        return BwdSmem{swizzle_aligned(raw)};
    }
    __device__ __forceinline__ unsigned char* k() const { return base + Cfg::kSK; }
    __device__ __forceinline__ unsigned char* v() const { return base + Cfg::kSV; }
    __device__ __forceinline__ unsigned char* q(int s) const {
        return base + Cfg::kSQ + s * Cfg::kQBytes;
    }
    __device__ __forceinline__ unsigned char* dout(int s) const {
        return base + Cfg::kSdO + s * Cfg::kQBytes;
    }
    __device__ __forceinline__ unsigned char* ds(int b) const {
        return base + Cfg::kSdS + b * Cfg::kDSBytes;
    }
    __device__ __forceinline__ unsigned char* p(int b) const {  // kSplitD
        return base + Cfg::kSP + b * Cfg::kDSBytes;
    }
    // Consumer warpgroup g's dQ part (BackwardConsumer::store_dq's order).
    __device__ __forceinline__ float* dq(int g) const {
        return reinterpret_cast<float*>(base + Cfg::kSdQ) +
               g * (Cfg::kDqBytes / 4 / Cfg::kConsumerWGs);
    }
    __device__ __forceinline__ float* lse(int s) const {
        return reinterpret_cast<float*>(base + Cfg::kSLse + s * Cfg::kVecBytes);
    }
    __device__ __forceinline__ float* d(int s) const {
        return reinterpret_cast<float*>(base + Cfg::kSD + s * Cfg::kVecBytes);
    }
    // At the end: the staging buffers of dV and dK (B_c x d_head each), over the Q and dO stages.
    __device__ __forceinline__ unsigned char* dv_staging() const { return base + Cfg::kSQ; }
    __device__ __forceinline__ unsigned char* dk_staging() const { return base + Cfg::kSdO; }

    __device__ __forceinline__ uint64_t* bar(int i) const {
        return reinterpret_cast<uint64_t*>(base + Cfg::kSBarriers) + i;
    }
    static constexpr int kS = Cfg::kStages, kD = Cfg::kDoStages;
    __device__ __forceinline__ uint64_t* kv_full() const { return bar(0); }
    __device__ __forceinline__ uint64_t* q_full(int s) const { return bar(1 + s); }
    __device__ __forceinline__ uint64_t* do_full(int s) const { return bar(1 + kS + s); }
    __device__ __forceinline__ uint64_t* q_empty(int s) const { return bar(1 + kS + kD + s); }
    __device__ __forceinline__ uint64_t* do_empty(int s) const { return bar(1 + 2 * kS + kD + s); }
    static_assert((1 + 2 * kS + 2 * kD) * 8 <= Cfg::kBarrierBytes && kD <= kS,
                  "mbarriers do not fit");

    // One thread, before any other uses them. kv_full takes two arrivals (K's copies and V's,
    // each with its byte count), q_full two (Q's copies, then LSE's and D's), do_full one;
    // do_empty one per consumer warp (dO is read by wgmma alone), q_empty one per consumer
    // thread (each reads LSE and D with its own loads, which its own arrival releases).
    __device__ __forceinline__ void init_barriers() const {
        mbar_init(kv_full(), 2);
        for (int s = 0; s < kS; ++s) {
            mbar_init(q_full(s), 2);
            if (s < kD)
                mbar_init(do_full(s), 1);
            mbar_init(q_empty(s), 128 * Cfg::kConsumerWGs);
            if (s < kD)
                mbar_init(do_empty(s), Cfg::kConsumerWarps);
        }
        fence_barrier_init();
    }
};

// The CTA's work: a KV block of (KV head blockIdx.y, batch blockIdx.z), and the query blocks
// that see it, i_first .. i_first + n_q - 1, for each query head of the group: n (head, block)
// pairs, head-major (each head's blocks in the order block_at gives). Blocks unmasked.x ..
// unmasked.y need no mask. The KV block is blockIdx.x
// (causal: the longest query range first), or with the deterministic order (dq_semaphore) the
// last KV block first, as dq_turn adds them. kVarlen: batch is a sequence (its place in the
// packed tensors and its lengths, cut to max_seqlen_q/k as seq_span_cut says, in `span`); a KV
// block past its end has no work and no rows.
struct BwdSpan32 {
    int q_start, k_start, seqlen_q, seqlen_k;
};
// The tile's sequence (kVarlen), a base so that fixed-length tiles hold nothing of it (an empty
// base), initialised before the fields that read it.
template <bool kVarlen>
struct BwdTileSpan {};
template <>
struct BwdTileSpan<true> {
    BwdSpan32 span;
};

template <class Cfg>
struct BackwardTile : BwdTileSpan<Cfg::kVarlen> {
    int kv_block, kv_head, batch, k_row0;
    int i_first, n_q, n;
    int2 unmasked;
    bwd::Window win;

    __device__ __forceinline__ explicit BackwardTile(const BwdKernelParams& prm)
        : BackwardTile(prm.p, prm.kv_block0 + prm.kv_block_step * int(blockIdx.x)) {}
    __device__ __forceinline__ BackwardTile(const BwdParams& p, int kv_block_)
        : BwdTileSpan<Cfg::kVarlen>(span_of(p)),
          kv_block(kv_block_),
          kv_head(blockIdx.y),
          batch(blockIdx.z),
          k_row0(kv_block * Cfg::kBc),
          win{seqlen_k(p) - seqlen_q(p), p.window_left, p.window_right} {
        const int sq = seqlen_q(p), sk = seqlen_k(p);
        const int k_last = (k_row0 + Cfg::kBc < sk ? k_row0 + Cfg::kBc : sk) - 1;
        int64_t q_lo, q_hi;
        win.rows(k_row0, k_last, sq, q_lo, q_hi);
        if (Cfg::kVarlen && k_row0 >= sk)
            q_hi = -1;  // past the sequence's keys
        i_first = q_hi >= q_lo ? static_cast<int>(q_lo / Cfg::kBr) : 0;
        n_q = q_hi >= q_lo ? static_cast<int>(q_hi / Cfg::kBr) - i_first + 1 : 0;
        n = n_q * p.heads_per_kv;
        unmasked = bwd::unmasked_query_blocks<Cfg::kBr, Cfg::kBc>(k_row0, sq, sk, win);
    }
    __device__ __forceinline__ static BwdTileSpan<Cfg::kVarlen> span_of(const BwdParams& p) {
        if constexpr (Cfg::kVarlen)
            return {seq_span_cut<BwdSpan32>(p, int(blockIdx.z))};
        else
            return {};
    }

    // The tile's sequence: its lengths, and its first rows in q/dO and k/v (kVarlen; else the
    // call's, read from BwdParams so that fixed-length kernels keep no copy).
    __device__ __forceinline__ int seqlen_q(const BwdParams& p) const {
        if constexpr (Cfg::kVarlen)
            return this->span.seqlen_q;
        return p.seqlen_q;
    }
    __device__ __forceinline__ int seqlen_k(const BwdParams& p) const {
        if constexpr (Cfg::kVarlen)
            return this->span.seqlen_k;
        return p.seqlen_k;
    }
    __device__ __forceinline__ int q_start() const {
        if constexpr (Cfg::kVarlen)
            return this->span.q_start;
        return 0;
    }
    __device__ __forceinline__ int k_start() const {
        if constexpr (Cfg::kVarlen)
            return this->span.k_start;
        return 0;
    }
    // The batch coordinate of the TMA maps: varlen maps hold every sequence in one batch.
    __device__ __forceinline__ int map_batch() const { return Cfg::kVarlen ? 0 : batch; }

    // (query head, query block) of pair t, stepped without divisions by the caller.
    struct Pair {
        int head, i;
    };
    __device__ __forceinline__ Pair first(int heads_per_kv) const {
        return Pair{kv_head * heads_per_kv, i_first};
    }
    // The first row of pair x in the preprocess's padded per-row buffers (LSE * log2(e), D, and
    // the dQ accumulator, d_head floats per row): whole blocks, seqlen_q_pad rows per head.
    // kVarlen: the sequence's rows from bwd::varlen_row0 of each head's.
    __device__ __forceinline__ int64_t padded_row(const BwdParams& p, Pair x) const {
        if constexpr (Cfg::kVarlen)
            return int64_t(x.head) * p.seqlen_q_pad + bwd::varlen_row0(this->span.q_start, batch) +
                   int64_t(x.i) * Cfg::kBr;
        return (int64_t(batch) * p.heads + x.head) * p.seqlen_q_pad + int64_t(x.i) * Cfg::kBr;
    }
    // The query block of the i-th place of a head's cycle (i_first .. i_first + n_q - 1): i, or
    // with the rotated order i + kv_block * r, cyclically (the KV block from blockIdx, as
    // rematerialisable as the kernel parameters: held in no register).
    __device__ __forceinline__ int block_at(const BwdKernelParams& prm, int i) const {
        const int kv = prm.kv_block0 + prm.kv_block_step * int(blockIdx.x);
        const int b = i + kv * prm.rotation_step;
        return b < i_first + n_q ? b : b - n_q;
    }
    // The deterministic order (bwd::dq_turn, the sm80 family's): pair x's turn counter, and
    // the number of KV blocks whose dQ additions to it come before this CTA's. Worked out from
    // the kernel's parameters, not the tile's fields: the writer warp runs it within the
    // producer's 24 registers.
    // kVarlen: the sequence's lengths read again (loads that hit in cache).
    __device__ __forceinline__ static int* dq_turn(const BwdKernelParams& prm, Pair x, int& turn) {
        const BwdParams& p = prm.p;
        int sq = p.seqlen_q, sk = p.seqlen_k;
        if constexpr (Cfg::kVarlen) {
            const BwdSpan32 sp = seq_span_cut<BwdSpan32>(p, int(blockIdx.z));
            sq = sp.seqlen_q;
            sk = sp.seqlen_k;
        }
        const bwd::Window win{sk - sq, p.window_left, p.window_right};
        const int kv_block = prm.kv_block0 + prm.kv_block_step * int(blockIdx.x);
        if (prm.rotation_step > 0)
            turn = bwd::rotated_dq_turn(prm.rotation.div(x.i), kv_block, prm.rotated_kv_blocks);
        else
            turn = bwd::dq_turn<Cfg::kBr, Cfg::kBc>(win, sq, sk, x.i, kv_block);
        return bwd::dq_turn_counter<Cfg::kBr>(p, blockIdx.z, x.head, x.i);
    }
    __device__ __forceinline__ void advance(Pair& x) const {
        if (++x.i == i_first + n_q) {
            x.i = i_first;
            ++x.head;
        }
    }
};

}  // namespace flash::sm90
