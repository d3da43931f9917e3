// FlashAttention-2 forward. One CTA owns B_r query rows of one (batch, head); each warp owns
// B_r / warps of those rows end to end (its Q fragments, its S/P, its O accumulators), so warps
// only meet at the barriers that guard the shared K and V tiles.
//
// Per KV block j (in the order the config asks):
//   S = Q K_j^T  ->  softcap (kSoftcap)  ->  mask keys past seqlen_k, or outside the window on
//   the window's edge blocks (kMask)  ->  online softmax (P, rescale O and l)
//   O += P V_j
// then O / l is written once, with LSE = m + log(l) if requested. With kMask only the KV blocks
// some row of the CTA can see are visited, and CTAs take query blocks from the last (the most
// keys under a causal mask) to the first, so the longest finish first.
//
// Varlen batches (FwdParams::cu_seqlens_q set) run the same code: a CTA finds its sequence's
// rows and lengths first (SeqSpan, common/varlen.cuh) and leaves at once when its query block is
// past them.
#pragma once

#include <cstdint>

#include "../common/mask.cuh"
#include "../common/params.h"
#include "../common/varlen.cuh"
#include "forward_gemm.cuh"
#include "forward_softmax.cuh"
#include "smem_tile.cuh"

namespace flash::sm80 {

template <class Cfg>
struct ForwardCta {
    using Elem = typename Cfg::Elem;

    const FwdParams& p;
    const int seqlen_k;  // of this CTA's sequence (seqlen_q is read again at the end: one
                         // register less across the KV loop)
    const int lane, warp_row0;
    const int q_row0;    // first query row of this CTA in its sequence
    const KvBlocks kv;   // kMask: the KV blocks this CTA visits and the ones it masks
    const int n_blocks;  // KV blocks this CTA visits: ceil(seqlen_k / B_c) without kMask
    const uint32_t sQ, sK, sV;
    const Elem* q;
    const Elem* k;
    const Elem* v;
    const TileCopy<Cfg, Cfg::kBr> q_copy;
    const TileCopy<Cfg, Cfg::kBc> k_copy, v_copy;
    const LdsmAddr<Cfg> q_at, k_at, v_at;

    float O[Cfg::kMTiles][Cfg::kNTilesO][4];
    float S[Cfg::kMTiles][Cfg::kNTilesS][4];
    OnlineSoftmax<Cfg> softmax;
    QBuffer<Cfg> qbuf;

    __device__ __forceinline__ ForwardCta(const FwdParams& params, const SeqSpan& span, int q_block,
                                          unsigned char* smem)
        : p(params),
          seqlen_k(span.seqlen_k),
          lane(threadIdx.x % 32),
          warp_row0((threadIdx.x / 32) * Cfg::kRowsPerWarp),
          q_row0(q_block * Cfg::kBr),
          kv(Cfg::kMask ? window_blocks<Cfg::kBr, Cfg::kBc>(params, span.seqlen_q, span.seqlen_k,
                                                            q_block * Cfg::kBr)
                        : KvBlocks{}),
          // Without masks at least one block, even with no key (a varlen sequence): its keys
          // are all masked as the tail, so O = 0 and LSE = -inf with no path of their own.
          n_blocks(Cfg::kMask
                       ? kv.count()
                       : (span.seqlen_k > 0 ? (span.seqlen_k + Cfg::kBc - 1) / Cfg::kBc : 1)),
          sQ(smem_addr(smem)),
          sK(sQ + Cfg::kQTileElems * sizeof(Elem)),
          sV(sK + Cfg::kKVTileElems * sizeof(Elem)),
          q_copy(threadIdx.x, params.q_row_stride, params.d_head),
          k_copy(threadIdx.x, params.k_row_stride, params.d_head),
          v_copy(threadIdx.x, params.v_row_stride, params.d_head),
          q_at(q_addr<Cfg>(sQ, warp_row0, lane)),
          k_at(k_addr<Cfg>(sK, lane)),
          v_at(v_addr<Cfg>(sV, lane)) {
        const int64_t batch = blockIdx.z, head = blockIdx.y;
        // 32-bit division: a 64-bit one compiles to a call of a slow subroutine.
        const int64_t kv_head = static_cast<int>(blockIdx.y) / params.heads_per_kv;
        const int64_t q_row = span.q_start + q_row0;
        q = static_cast<const Elem*>(params.q) + batch * params.q_batch_stride +
            head * params.q_head_stride + q_row * params.q_row_stride;
        k = static_cast<const Elem*>(params.k) + batch * params.k_batch_stride +
            kv_head * params.k_head_stride + span.k_start * params.k_row_stride;
        v = static_cast<const Elem*>(params.v) + batch * params.v_batch_stride +
            kv_head * params.v_head_stride + span.k_start * params.v_row_stride;
    }

    __device__ __forceinline__ int kv_block(int i) const {
        if constexpr (Cfg::kMask)
            return Cfg::kReverseKV ? kv.last - i : kv.first + i;
        return Cfg::kReverseKV ? n_blocks - 1 - i : i;
    }

    __device__ __forceinline__ int seqlen_q() const { return seq_span(p, blockIdx.z).seqlen_q; }
    __device__ __forceinline__ void copy_q() { q_copy.issue(sQ, q, seqlen_q() - q_row0); }
    __device__ __forceinline__ void copy_k(int j) {
        const int row0 = j * Cfg::kBc;
        k_copy.issue(sK, k + row0 * p.k_row_stride, seqlen_k - row0);
    }
    __device__ __forceinline__ void copy_v(int j) {
        const int row0 = j * Cfg::kBc;
        v_copy.issue(sV, v + row0 * p.v_row_stride, seqlen_k - row0);
    }

    // S = Q K_j^T; Q has landed and sK holds K_j. Resident Q fragments load on the first block.
    __device__ __forceinline__ void compute_scores(int i) {
        if constexpr (!Cfg::kSliceQ) {
            if (i == 0) {
#pragma unroll
                for (int s = 0; s < Cfg::kStepsQK; ++s)
                    load_q_slice<Cfg>(qbuf.slot(s), q_at, s);
            }
        }
        gemm_qk<Cfg>(S, qbuf, q_at, k_at);
    }

    // S -> P for block j: softcap, mask (the key tail; with kMask the window's edge blocks
    // too), then the online-softmax update of m, l and O.
    template <bool kFirst>
    __device__ __forceinline__ void softmax_block(int j) {
        const int kv_col0 = j * Cfg::kBc;
        if constexpr (Cfg::kSoftcap)
            OnlineSoftmax<Cfg>::softcap(S, p.softcap_scale);
        if constexpr (Cfg::kMask) {
            if (kv.needs_mask(j)) {  // uniform over the CTA: blocks seen whole pay nothing
                const SeqSpan span = seq_span(p, blockIdx.z);
                WindowMask<Cfg>(span.seqlen_q, span.seqlen_k, q_row0, warp_row0, lane)
                    .apply(S, kv_col0, span.seqlen_k, p);
            }
        } else if (kv_col0 + Cfg::kBc > seqlen_k) {
            OnlineSoftmax<Cfg>::mask_tail(S, kv_col0, seqlen_k, lane);
        }
        softmax.template update<kFirst>(S, O, p.scale_log2);
    }

    // Eager: V_j streams in under S = Q K_j^T, and K_{j+1} under softmax and P V_j.
    template <bool kFirst>
    __device__ __forceinline__ void block_eager(int i) {
        const int j = kv_block(i);
        copy_v(j);  // sV is free: the barrier closing the previous block ordered its last reads
        cp_async_commit();
        cp_async_wait<1>();  // Q (first block) and K_j have landed; V_j may still be in flight
        __syncthreads();     // ... for every thread's copies: sQ and sK are readable
        compute_scores(i);
        __syncthreads();  // every warp has finished reading sK: K_{j+1} may overwrite it
        const bool more = i + 1 < n_blocks;
        if (more) {
            copy_k(kv_block(i + 1));
            cp_async_commit();
        }
        softmax_block<kFirst>(j);
        if (more)
            cp_async_wait<1>();  // V_j has landed; K_{j+1} may still be in flight
        else
            cp_async_wait<0>();
        __syncthreads();  // sV holds V_j for every thread
        gemm_pv<Cfg>(O, S, v_at);
        __syncthreads();  // every warp has finished reading sV
    }

    // Plain: each tile is loaded when it is needed, and waited for at once.
    template <bool kFirst>
    __device__ __forceinline__ void block_plain(int i) {
        const int j = kv_block(i);
        copy_k(j);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();  // sQ and sK hold Q and K_j
        compute_scores(i);
        softmax_block<kFirst>(j);
        copy_v(j);  // sV is free: the barrier closing the previous block ordered its last reads
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();  // sV holds V_j
        gemm_pv<Cfg>(O, S, v_at);
        __syncthreads();  // sK and sV are free for the next block
    }

    template <bool kFirst>
    __device__ __forceinline__ void block(int i) {
        if constexpr (Cfg::kEagerKV)
            block_eager<kFirst>(i);
        else
            block_plain<kFirst>(i);
    }

    __device__ __forceinline__ void run(unsigned char* smem) {
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < Cfg::kNTilesO; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    O[mt][nt][e] = 0.f;
        softmax.init();

        if constexpr (Cfg::kMask) {
            if (n_blocks == 0) {  // no row sees a key: O = 0, LSE = -inf (no copy in flight)
                float lse[Cfg::kMTiles][2];
                softmax.finalize(O, lse, p.scale_log2);
                write_output(smem, lse);
                return;
            }
        }
        copy_q();
        if constexpr (Cfg::kEagerKV)
            copy_k(kv_block(0));
        cp_async_commit();

        int i = 0;
        if constexpr (Cfg::kOptSoftmax) {
            block<true>(0);  // peeled: no rescale of O and l on the first block
            i = 1;
        }
        for (; i < n_blocks; ++i)
            block<false>(i);

        float lse[Cfg::kMTiles][2];
        softmax.finalize(O, lse, p.scale_log2);
        write_output(smem, lse);
    }

    // O goes through this warp's own rows of sQ (no other warp reads them) so that global stores
    // are 16-byte and coalesced.
    __device__ __forceinline__ void write_output(unsigned char* smem,
                                                 const float (&lse)[Cfg::kMTiles][2]) {
        const SeqSpan span = seq_span(p, blockIdx.z);
        const int q_valid = span.seqlen_q - q_row0;
        const int64_t q_row = span.q_start + q_row0;
        const int64_t batch = blockIdx.z, head = blockIdx.y;
        float* lse_out = p.lse == nullptr ? nullptr
                                          : p.lse + batch * p.lse_batch_stride +
                                                head * p.lse_head_stride + q_row;
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = warp_row0 + mt * 16 + lane / 4 + 8 * h;
#pragma unroll
                for (int nt = 0; nt < Cfg::kNTilesO; ++nt) {
                    const uint32_t packed = pack2<Elem>(O[mt][nt][2 * h], O[mt][nt][2 * h + 1]);
                    *reinterpret_cast<uint32_t*>(smem + tile_offset<Cfg>(row, nt) +
                                                 (lane % 4) * 4) = packed;
                }
                if (lse_out != nullptr && lane % 4 == 0 && row < q_valid)
                    lse_out[row] = lse[mt][h];
            }
        __syncwarp();  // this warp's O rows are in smem
        Elem* o = static_cast<Elem*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride +
                  (q_row + warp_row0) * p.o_row_stride;
        store_warp_rows<Cfg>(smem, warp_row0, o, p.o_row_stride, q_valid - warp_row0, p.d_head,
                             lane);
    }
};

// Min one CTA per SM: ptxas may then use up to 255 registers. Without it, it capped some
// kernels at 128 registers to fit 4 CTAs and spilled instead.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParams params) {
    extern __shared__ __align__(128) unsigned char smem[];
    const SeqSpan span = seq_span(params, blockIdx.z);
    // With masks, query blocks run from the last (the most keys under a causal mask) down.
    const int q_blocks = (span.seqlen_q + Cfg::kBr - 1) / Cfg::kBr;
    const int q_block = Cfg::kMask ? q_blocks - 1 - int(blockIdx.x) : int(blockIdx.x);
    if (q_block < 0 || q_block >= q_blocks)
        return;  // past this sequence (varlen: the grid covers the longest)
    ForwardCta<Cfg> cta(params, span, q_block, smem);
    cta.run(smem);
}

}  // namespace flash::sm80
