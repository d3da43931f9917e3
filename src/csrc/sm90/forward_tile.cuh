// One tile of the Hopper forward: a query block of one (batch, head) (coordinates from the tile
// scheduler), its sequence's place in the tensors (varlen), its query rows, the KV blocks it
// visits, the order it visits them in, and which of them need a mask.
#pragma once

#include <type_traits>

#include "../common/mask.cuh"
#include "../common/params.h"
#include "../common/varlen.cuh"
#include "forward_params.cuh"
#include "forward_tile_scheduler.cuh"

namespace flash::sm90 {

struct NoSpan {};
// kVarlen: the tile's sequence, 32-bit (cu_seqlens are int32).
struct Span32 {
    int q_start, k_start, seqlen_q, seqlen_k;
};

template <class Cfg>
struct ForwardTile : TileCoord {  // block: the query block
    int q_row0;                   // first query row of the tile, in its sequence
    KvBlocks kv;
    int n_blocks;
    // kVarlen: where the sequence lies in the packed tensors and its lengths (else the call's:
    // the accessors below read FwdParams, so fixed-length kernels keep no copy).
    std::conditional_t<Cfg::kVarlen, Span32, NoSpan> span;

    // The grid's query blocks per (batch, head): of the longest sequence with kVarlen.
    __host__ __device__ __forceinline__ static int q_blocks(const FwdParams& p) {
        return (p.seqlen_q + Cfg::kBr - 1) / Cfg::kBr;
    }
    // Query blocks per (batch, head) in tile numbers: pairs with kCluster (the launcher's too).
    __host__ __device__ __forceinline__ static int tiles_per_head(const FwdParams& p) {
        return (q_blocks(p) + Cfg::kClusterCtas - 1) / Cfg::kClusterCtas;
    }
    __device__ __forceinline__ static int tiles(const FwdParams& p) {
        return tiles_per_head(p) * p.heads * p.batch;
    }

    ForwardTile() = default;
    // With a causal mask the last query block sees the most keys: heaviest last. A varlen tile
    // past its sequence's end has no KV blocks. (Its sequence's offsets come from global memory,
    // so ptxas keeps the KV loop and the wgmma descriptors built from it in per-thread
    // registers, as for any tile whose block count depends on its coordinates.)
    __device__ __forceinline__ ForwardTile(const FwdKernelParams& prm, int tile)
        : TileCoord(tile_coord<Cfg, /*kHeavyLast=*/true>(prm, tile, q_blocks(prm.p))) {
        const FwdParams& p = prm.p;
        if constexpr (Cfg::kVarlen)
            span = seq_span<Span32>(p, batch);
        q_row0 = block * Cfg::kBr;
        const int sq = seqlen_q(p), sk = seqlen_k(p);
        if constexpr (Cfg::kMask) {
            kv = window_blocks<Cfg::kBr, Cfg::kBc>(p, sq, sk, q_row0);
        } else {
            kv = KvBlocks{0, (sk + Cfg::kBc - 1) / Cfg::kBc - 1, 0, 0};
        }
        if (Cfg::kVarlen && q_row0 >= sq)
            kv = KvBlocks{0, -1, 0, -1};
        n_blocks = Cfg::kMask || Cfg::kVarlen ? kv.count() : kv.last + 1;
    }
    // The tile's sequence: its lengths, and its first rows in q/o and k/v.
    __device__ __forceinline__ int seqlen_q(const FwdParams& p) const {
        if constexpr (Cfg::kVarlen)
            return span.seqlen_q;
        return p.seqlen_q;
    }
    __device__ __forceinline__ int seqlen_k(const FwdParams& p) const {
        if constexpr (Cfg::kVarlen)
            return span.seqlen_k;
        return p.seqlen_k;
    }
    __device__ __forceinline__ int q_start() const {
        if constexpr (Cfg::kVarlen)
            return span.q_start;
        return 0;
    }
    __device__ __forceinline__ int k_start() const {
        if constexpr (Cfg::kVarlen)
            return span.k_start;
        return 0;
    }
    // The batch coordinate of the TMA maps: varlen maps hold every sequence in one batch.
    __device__ __forceinline__ int map_batch() const { return Cfg::kVarlen ? 0 : batch; }

    // Visit order: the i-th block visited is the last block but i (with a causal mask the last
    // holds the diagonal, so the row maxima are known early).
    __device__ __forceinline__ int kv_block(int i) const { return kv.last - i; }
    __device__ __forceinline__ bool needs_mask(int j, int seqlen_k) const {
        if constexpr (Cfg::kMask)
            return kv.needs_mask(j);
        return (j + 1) * Cfg::kBc > seqlen_k;
    }
    // kVarlen: block j holds the sequence's last keys and rows past them (the next sequence's,
    // in the packed tensors; TMA zero-fills only past the tensor's end).
    __device__ __forceinline__ bool kv_tail(int j, int seqlen_k) const {
        return Cfg::kVarlen && (j + 1) * Cfg::kBc > seqlen_k;
    }
};

}  // namespace flash::sm90
