// The decode kernel (DecConfig): attention of a few query rows per sequence over a long KV
// cache, contiguous or paged, bound by the bandwidth of reading K and V.
//
// Packed GQA: the heads_per_kv query heads of one KV head and the seqlen_q positions of one
// sequence are the packed rows R = i * heads_per_kv + g (position i, head kv_head *
// heads_per_kv + g); a CTA owns B_r (16 or 32) of them, so K and V of a KV head are read once
// per B_r packed rows, not once per query head.
// Split-KV: blockIdx.x = row_block * num_splits + split; the visible KV blocks of the tile are
// cut into num_splits ranges, one per CTA; with num_splits > 1 each CTA writes its normalised
// partial output and LSE (fp32) and decode_combine.cuh merges them.
// Inside a CTA each warp takes every kWarps-th KV block of the range and streams it through its
// own kStages-deep cp.async pipeline, with the forward's GEMMs and online softmax on B_r rows
// (one or two m16 tiles); at the end the warps' (m, l, O) are merged through shared memory.
// Paged caches: a block's rows are addressed from the block-table entries of its pages, read one
// iteration before its copy (one entry when the page size is a multiple of B_c, one per 16-row
// group of the block when it is a multiple of 16); other page sizes gather a block that
// straddles pages row by row.
//
// Bad cache metadata (a length outside the cache, a page outside the pool, a cache row outside
// the batch) never leads to an access outside the tensors: the copy is skipped, the sequence's
// rows are written as NaN and the error bit is ORed into DecParams::status.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/params.h"
#include "../common/programmatic_launch.cuh"
#include "../common/varlen.cuh"
#include "decode_config.cuh"
#include "decode_fp8.cuh"
#include "forward_gemm.cuh"
#include "forward_softmax.cuh"
#include "smem_tile.cuh"

namespace flash::sm80 {

// Sequence b as the decode kernels read it: its query rows, its keys and where they start.
struct DecSeq {
    int64_t q_start;  // first row of q (varlen), else 0
    int seqlen_q;
    int seqlen_k;
    int64_t k_off, v_off;  // contiguous caches: element offset of key 0 of this KV head
    int bad;               // decode::kStatus* bits of this sequence
};

__device__ __forceinline__ DecSeq dec_seq(const DecParams& p, int b, int kv_head) {
    DecSeq s{0, p.seqlen_q, p.seqlen_k, 0, 0, 0};
    if (p.cu_seqlens_q != nullptr) {
        const int q0 = clamp_to(p.cu_seqlens_q[b], p.total_q);
        const int q1 = clamp_to(p.cu_seqlens_q[b + 1], p.total_q);
        s.q_start = q0;
        s.seqlen_q = q1 > q0 ? q1 - q0 : 0;
    }
    int capacity = p.capacity;
    int64_t k_start = 0;
    if (p.cu_seqlens_k != nullptr && p.block_table == nullptr) {  // a packed (varlen) K/V
        const int k0 = clamp_to(p.cu_seqlens_k[b], p.total_k);
        const int k1 = clamp_to(p.cu_seqlens_k[b + 1], p.total_k);
        k_start = k0;
        capacity = k1 > k0 ? k1 - k0 : 0;
        s.seqlen_k = capacity;
    } else if (p.cu_seqlens_k != nullptr) {  // paged varlen: lengths from cu_seqlens_k
        s.seqlen_k = p.cu_seqlens_k[b + 1] - p.cu_seqlens_k[b];
    }
    if (p.seqused_k != nullptr)
        s.seqlen_k = p.seqused_k[b] + p.seqused_add;
    if (s.seqlen_k < 0 || s.seqlen_k > capacity) {
        s.bad |= decode::kStatusSeqlen;
        s.seqlen_k = 0;
    }
    if (p.leftpad_k != nullptr && p.block_table == nullptr) {  // keys [pad, seqlen_k) of the row
        const int pad = p.leftpad_k[b];
        if (pad < 0 || pad > s.seqlen_k) {
            s.bad |= decode::kStatusLeftpad;
            s.seqlen_k = 0;
        } else {
            k_start += pad;
            s.seqlen_k -= pad;
        }
    }
    if (p.block_table == nullptr) {
        int row = b;
        if (p.cache_batch_idx != nullptr) {
            row = p.cache_batch_idx[b];
            if (row < 0 || row >= p.cache_batch) {
                s.bad |= decode::kStatusCacheRow;
                row = 0;
                s.seqlen_k = 0;
            }
        }
        s.k_off = row * p.k_batch_stride + k_start * p.k_row_stride + kv_head * p.k_head_stride;
        s.v_off = row * p.v_batch_stride + k_start * p.v_row_stride + kv_head * p.v_head_stride;
    } else {
        s.k_off = kv_head * p.k_head_stride;
        s.v_off = kv_head * p.v_head_stride;
    }
    return s;
}

__device__ __forceinline__ int clamp_key(int64_t v, int lo, int hi) {
    return static_cast<int>(v < lo ? lo : (v > hi ? hi : v));
}

template <class Cfg>
struct DecodeCta {
    using Elem = typename Cfg::Elem;
    using CacheElem = typename Cfg::CacheElem;
    static constexpr int kRowsPerPass = 32 / Cfg::kCacheChunksPerRow;  // K/V rows per copy pass
    static constexpr int kPasses = Cfg::kBc / kRowsPerPass;
    // A block's 16-row groups: over pages of a multiple of 16 rows each lies inside one page.
    static constexpr int kGroups = Cfg::kBc / 16;
    static_assert(16 % kRowsPerPass == 0, "a copy pass's rows lie in one 16-row group");

    // The block-table entries a block's copy is addressed from (all 0 for a contiguous cache):
    // its first key's page, and with group_pages() each later 16-row group's.
    struct BlockPages {
        int page[kGroups];
    };

    // Chunk c of row r of a K or V tile.
    __device__ __forceinline__ static uint32_t kv_offset(int r, int c) {
        if constexpr (Cfg::kFp8Cache)
            return fp8_tile_offset<Cfg>(r, c);
        else
            return tile_offset<Cfg>(r, c);
    }

    const DecParams& p;
    const int lane, warp, batch, kv_head, split, row0;
    const DecSeq seq;
    const int rows;  // packed rows of this sequence: seqlen_q x heads_per_kv
    const uint32_t sQ, sPipe;
    int blk_begin, blk_end;  // this CTA's KV blocks [begin, end)
    int full_lo, full_hi;    // keys every row of the tile sees: blocks inside need no mask
    // Keys this thread's rows see: two per m16 tile (lane / 4 and lane / 4 + 8).
    int key_lo[Cfg::kMTiles][2], key_hi[Cfg::kMTiles][2];
    int bad;  // decode::kStatus* bits met by this thread
    // An FP8 cache's descales of this (sequence, KV head), 1 otherwise: k's scales the scores,
    // v's the output.
    float k_descale, v_descale;

    float O[Cfg::kMTiles][Cfg::kNTilesO][4];
    float S[Cfg::kMTiles][Cfg::kNTilesS][4];
    OnlineSoftmax<Cfg> softmax;
    QBuffer<Cfg> qbuf;

    __device__ __forceinline__ DecodeCta(const DecParams& params, unsigned char* smem)
        : p(params),
          lane(threadIdx.x % 32),
          warp(threadIdx.x / 32),
          batch(blockIdx.z),
          kv_head(blockIdx.y),
          split(static_cast<int>(blockIdx.x) % params.num_splits),
          row0((static_cast<int>(blockIdx.x) / params.num_splits) * Cfg::kBr),
          seq(dec_seq(params, blockIdx.z, blockIdx.y)),
          rows(seq.seqlen_q * params.heads_per_kv),
          sQ(smem_addr(smem)),
          sPipe(smem_addr(smem) + Cfg::kQTileBytes),
          bad(0),
          k_descale(descale_of(params, 1, blockIdx.z, blockIdx.y)),
          v_descale(descale_of(params, 2, blockIdx.z, blockIdx.y)) {
        const int group = p.heads_per_kv;
        const int sk = seq.seqlen_k;
        const int64_t off = int64_t(sk) - seq.seqlen_q;
        const int64_t i_first = row0 / group;
        const int64_t i_last = ((row0 + Cfg::kBr < rows ? row0 + Cfg::kBr : rows) - 1) / group;
        const bool left = p.window_left >= 0, right = p.window_right >= 0;
        const int64_t lo = left ? i_first + off - p.window_left : 0;
        const int64_t hi = right ? i_last + off + p.window_right : sk - 1;
        const int key_first = clamp_key(lo, 0, sk), key_last = clamp_key(hi, -1, sk - 1);
        int n = 0, first = 0;
        if (key_last >= key_first && sk > 0) {
            first = key_first / Cfg::kBc;
            n = key_last / Cfg::kBc - first + 1;
        }
        const int per = (n + p.num_splits - 1) / p.num_splits;
        blk_begin = first + split * per;
        blk_end = first + n < blk_begin + per ? first + n : blk_begin + per;
        full_lo = clamp_key(left ? i_last + off - p.window_left : 0, 0, sk);
        full_hi = clamp_key(right ? i_first + off + p.window_right : sk - 1, -1, sk - 1);
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = row0 + mt * 16 + lane / 4 + 8 * h;
                const int64_t i = (r < rows ? r : rows - 1) / group;
                key_lo[mt][h] = clamp_key(left ? i + off - p.window_left : 0, 0, sk);
                key_hi[mt][h] = clamp_key(right ? i + off + p.window_right : sk - 1, -1, sk - 1);
            }
    }

    __device__ __forceinline__ static float descale_of(const DecParams& p, int i, int b, int h) {
        if (!Cfg::kFp8Cache || p.descale[i] == nullptr)
            return 1.f;
        return p.descale[i][b * p.descale_batch_stride[i] + h * p.descale_head_stride[i]];
    }

    // Packed row R's row in the split-KV buffers: over the batch (fixed length) or the packed
    // rows of q (varlen).
    __device__ __forceinline__ int64_t global_row(int R) const {
        const int64_t q_row = seq.q_start + position(R);
        return p.cu_seqlens_q != nullptr ? q_row : int64_t(batch) * p.seqlen_q + position(R);
    }

    // Packed row R of this sequence: its position and query head.
    __device__ __forceinline__ int position(int R) const { return R / p.heads_per_kv; }
    __device__ __forceinline__ int head(int R) const {
        return kv_head * p.heads_per_kv + R % p.heads_per_kv;
    }

    // Q's B_r packed rows, zero-filled past the sequence's rows and the tensor's d_head.
    __device__ __forceinline__ void copy_q() const {
        const Elem* q = static_cast<const Elem*>(p.q);
        for (int idx = threadIdx.x; idx < Cfg::kBr * Cfg::kChunksPerRow; idx += Cfg::kThreads) {
            const int r = idx / Cfg::kChunksPerRow, c = idx % Cfg::kChunksPerRow;
            const int R = row0 + r;
            const bool valid = R < rows && c * Cfg::kChunkElems < p.d_head;
            const Elem* src = q;
            if (valid)
                src = q + batch * p.q_batch_stride + (seq.q_start + position(R)) * p.q_row_stride +
                      head(R) * p.q_head_stride + c * Cfg::kChunkElems;
            cp_async_16(sQ + tile_offset<Cfg>(r, c), src, valid);
        }
    }

    __device__ __forceinline__ uint32_t stage_k(int stage) const {
        return sPipe + warp * Cfg::kWarpStageBytes + stage * 2 * Cfg::kKVTileBytes;
    }

    // Pages of a multiple of 16 rows but not of B_c: a block's 16-row groups may lie in
    // different pages, each addressed from its own entry. Read from the parameters where it is
    // needed (a member would hold a register through the key loop).
    __device__ __forceinline__ bool group_pages() const {
        return kGroups > 1 && p.block_table != nullptr && p.page_size % 16 == 0 &&
               p.page_size % Cfg::kBc != 0;
    }

    // From a 16-row group's first row (block-table column `index`, row `in_page` of its page)
    // to the next group's: pages of 16 rows or more are crossed at most once per step.
    __device__ __forceinline__ void next_group(int& index, int& in_page) const {
        in_page += 16;
        if (in_page >= p.page_size) {
            in_page -= p.page_size;
            ++index;
        }
    }

    // The block-table column of key `key`: key / page_size (a shift for page sizes that are
    // powers of two, the common ones).
    __device__ __forceinline__ int page_index(int key) const {
        return p.page_shift >= 0 ? key >> p.page_shift : key / p.page_size;
    }

    // The block-table entries of block `blk` (BlockPages): read one iteration before the
    // block's copy is issued, so their latency hides under compute. A group past the
    // sequence's keys reuses the first entry (its rows are not copied).
    __device__ __forceinline__ BlockPages block_page(int blk) const {
        BlockPages pages;
#pragma unroll
        for (int g = 0; g < kGroups; ++g)
            pages.page[g] = 0;
        if (p.block_table == nullptr)
            return pages;
        const int* table = p.block_table + batch * p.block_table_stride;
        const int k0 = blk * Cfg::kBc;
        int index = page_index(k0), in_page = k0 - index * p.page_size;
        pages.page[0] = table[index];
#pragma unroll
        for (int g = 1; g < kGroups; ++g) {
            next_group(index, in_page);
            pages.page[g] =
                group_pages() && k0 + 16 * g < seq.seqlen_k ? table[index] : pages.page[0];
        }
        return pages;
    }

    // This warp's K and V rows of KV block `blk` into pipeline stage `stage`: rows past the
    // sequence's keys (and columns past d_head) are zero-filled. A paged block inside one page
    // (page sizes that are multiples of B_c) is addressed from its page's table entry, one over
    // pages of a multiple of 16 rows from each 16-row group's (`pages`, block_page's); a block
    // across pages of other sizes finds its rows through the block table one by one. Each of
    // the three is a pass loop of its own: the row-by-row branch inside the others' loops made
    // the FP8 d_head 256 kernel far slower, contiguous and paged
    // (results/2026-12-02-h200-decode-page-groups.md).
    __device__ __forceinline__ void copy_kv(int blk, int stage, const BlockPages& pages) {
        const CacheElem* k = static_cast<const CacheElem*>(p.k);
        const CacheElem* v = static_cast<const CacheElem*>(p.v);
        const uint32_t sK = stage_k(stage), sV = sK + Cfg::kKVTileBytes;
        const int c = lane % Cfg::kCacheChunksPerRow;
        const bool col_ok = c * Cfg::kCacheChunkElems < p.d_head;
        const int k0 = blk * Cfg::kBc;
        const int64_t k_col = seq.k_off + c * Cfg::kCacheChunkElems;
        const int64_t v_col = seq.v_off + c * Cfg::kCacheChunkElems;
        // Row r of the block (the pass's row of this lane) into the stage, or zeros.
        const auto issue = [&](int r, bool valid, int64_t k_at, int64_t v_at) {
            const uint32_t at = kv_offset(r, c);
            cp_async_16(sK + at, valid ? k + k_at : k, valid);
            cp_async_16(sV + at, valid ? v + v_at : v, valid);
        };
        if (p.block_table == nullptr) {  // contiguous: a loop of its own, the common case
            const int64_t k_base = k_col + int64_t(k0) * p.k_row_stride;
            const int64_t v_base = v_col + int64_t(k0) * p.v_row_stride;
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
                const int r = lane / Cfg::kCacheChunksPerRow + pass * kRowsPerPass;
                issue(r, col_ok && k0 + r < seq.seqlen_k, k_base + int64_t(r) * p.k_row_stride,
                      v_base + int64_t(r) * p.v_row_stride);
            }
            return;
        }
        const int last = (k0 + Cfg::kBc < seq.seqlen_k ? k0 + Cfg::kBc : seq.seqlen_k) - 1;
        const int index = page_index(k0);
        if (!group_pages() && page_index(last) != index) {  // rows in several pages: one by one
            const int* table = p.block_table + batch * p.block_table_stride;
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
                const int r = lane / Cfg::kCacheChunksPerRow + pass * kRowsPerPass;
                const int key = k0 + r;
                bool valid = col_ok && key < seq.seqlen_k;
                const int row_index = page_index(key);
                int row_page = valid ? table[row_index] : 0;
                if (row_page < 0 || row_page >= p.num_pages) {
                    bad |= decode::kStatusPage;
                    valid = false;
                    row_page = 0;
                }
                const int64_t row = key - row_index * p.page_size;
                issue(r, valid, k_col + row_page * p.k_batch_stride + row * p.k_row_stride,
                      v_col + row_page * p.v_batch_stride + row * p.v_row_stride);
            }
            return;
        }
        // Group g's rows are at k_base[g] + r * row stride (r: the row in the block); its first
        // row's place in its page walked 16 rows at a time (inside one page without
        // group_pages()).
        int64_t k_base[kGroups], v_base[kGroups];
        bool page_ok[kGroups];
        int group_index = index, in_page = k0 - index * p.page_size;
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
            if (g > 0)
                next_group(group_index, in_page);
            int page = pages.page[g];
            page_ok[g] = page >= 0 && page < p.num_pages;
            if (!page_ok[g]) {
                bad |= decode::kStatusPage;
                page = 0;
            }
            const int64_t row = in_page - 16 * g;
            k_base[g] = k_col + page * p.k_batch_stride + row * p.k_row_stride;
            v_base[g] = v_col + page * p.v_batch_stride + row * p.v_row_stride;
        }
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
            const int g = pass * kRowsPerPass / 16;  // compile-time: the pass is unrolled
            const int r = lane / Cfg::kCacheChunksPerRow + pass * kRowsPerPass;
            issue(r, col_ok && page_ok[g] && k0 + r < seq.seqlen_k,
                  k_base[g] + int64_t(r) * p.k_row_stride, v_base[g] + int64_t(r) * p.v_row_stride);
        }
    }

    __device__ __forceinline__ int warp_blocks() const {
        const int n = blk_end - blk_begin - warp;
        return n > 0 ? (n + Cfg::kWarps - 1) / Cfg::kWarps : 0;
    }
    __device__ __forceinline__ int block_of(int t) const {
        return blk_begin + warp + t * Cfg::kWarps;
    }

    // Scores outside each row's keys -> -inf (blocks not seen whole by every row).
    __device__ __forceinline__ void mask(int blk) {
        const int k0 = blk * Cfg::kBc;
        if (k0 >= full_lo && k0 + Cfg::kBc - 1 <= full_hi)
            return;
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
            for (int nt = 0; nt < Cfg::kNTilesS; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = k0 + nt * 8 + (lane % 4) * 2 + (e % 2);
                    if (col < key_lo[mt][e / 2] || col > key_hi[mt][e / 2])
                        S[mt][nt][e] = -INFINITY;
                }
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

        const int n_mine = warp_blocks();
        // After the append, the first stages' blocks of keys it does not write are copied while
        // it runs; Q (maybe its rotated copy) and the rest wait for its end. Block t's copy stays
        // the (t + 1)-th or (t + 2)-th group committed, as the main loop's waits count.
        int st = 0;
        if (p.after_append) {
            const int old_keys = seq.seqlen_k - p.new_keys;
            for (;
                 st < Cfg::kStages - 1 && st < n_mine && (block_of(st) + 1) * Cfg::kBc <= old_keys;
                 ++st) {
                copy_kv(block_of(st), st, block_page(block_of(st)));
                cp_async_commit();
            }
            grid_dependency_wait();  // the append wrote q's rotated copy, the cache's new rows
        }
        copy_q();
        cp_async_commit();
        for (; st < Cfg::kStages - 1; ++st) {
            if (st < n_mine)
                copy_kv(block_of(st), st, block_page(block_of(st)));
            cp_async_commit();
        }
        // The pages of the next block to issue, read one iteration ahead.
        BlockPages next_pages = {};
        if (Cfg::kStages - 1 < n_mine)
            next_pages = block_page(block_of(Cfg::kStages - 1));
        if (p.after_append)
            cp_async_wait<0>();  // Q has landed (behind the early blocks' groups)
        else
            cp_async_wait<Cfg::kStages - 1>();  // Q has landed (its group is the oldest)
        __syncthreads();                        // ... for every thread's copies
        const LdsmAddr<Cfg> q_at = q_addr<Cfg>(sQ, 0, lane);
        QFp8Order<Cfg> q8;              // an FP8 cache's Q fragments (decode_fp8.cuh), else unused
        float score_scale = k_descale;  // what the raw scores are multiplied by
        if constexpr (Cfg::kFp8Cache) {
            if constexpr (std::is_same_v<Elem, __nv_bfloat16>)
                score_scale *= scale_q_to_fp16<Cfg>(sQ);  // the products run in fp16
            q8.load_all(sQ, lane);
        } else if constexpr (!Cfg::kSliceQ) {
#pragma unroll
            for (int s = 0; s < Cfg::kStepsQK; ++s)
                load_q_slice<Cfg>(qbuf.slot(s), q_at, s);
        }
        const bool softcap = p.softcap_scale > 0.f;
        // An FP8 cache's k descale (and Q's fp16 scale) multiply the raw scores: inside the
        // tanh with a softcap, else in the exp2 scale.
        const float softcap_scale = p.softcap_scale * score_scale;
        const float scale_log2 = softcap ? p.scale_log2 : p.scale_log2 * score_scale;
        for (int t = 0; t < n_mine; ++t) {
            const int ahead = t + Cfg::kStages - 1;
            if (ahead < n_mine) {
                copy_kv(block_of(ahead), ahead % Cfg::kStages, next_pages);
                if (ahead + 1 < n_mine)
                    next_pages = block_page(block_of(ahead + 1));
            }
            cp_async_commit();
            cp_async_wait<Cfg::kStages - 1>();  // block t has landed (this thread's rows)
            __syncwarp();                       // ... and every lane's
            const uint32_t sK = stage_k(t % Cfg::kStages);
            if constexpr (Cfg::kFp8Cache)
                gemm_qk_fp8<Cfg>(S, q8, sQ, sK, lane);
            else
                gemm_qk<Cfg>(S, qbuf, q_at, k_addr<Cfg>(sK, lane));
            if (softcap)
                OnlineSoftmax<Cfg>::softcap(S, softcap_scale);
            mask(block_of(t));
            softmax.template update<false>(S, O, scale_log2);
            if constexpr (Cfg::kFp8Cache)
                gemm_pv_fp8<Cfg>(O, S, sK + Cfg::kKVTileBytes, lane);
            else
                gemm_pv<Cfg>(O, S, v_addr<Cfg>(sK + Cfg::kKVTileBytes, lane));
            __syncwarp();  // every lane has read this stage before it is refilled
        }
        cp_async_wait<0>();
        grid_dependents_launch();  // the combine may be scheduled (it waits for this grid's end)
        merge_and_write(smem);
    }

    // The warps' (m, l, O) merged through smem (the pipeline's buffers, free now), then the
    // output: O / l and the LSE, final or one split's partial.
    __device__ __forceinline__ void merge_and_write(unsigned char* smem) {
        const int bad_seq = seq.bad | bad;
        const bool nan_out = __syncthreads_or(bad_seq != 0);  // also: every warp left its stages
        if (bad_seq != 0 && p.status != nullptr)
            atomicOr(p.status, bad_seq);
        float* sO = reinterpret_cast<float*>(smem + Cfg::kQTileBytes);
        float* sM = sO + Cfg::kWarps * Cfg::kBr * Cfg::kDHead;
        float* sL = sM + Cfg::kWarps * Cfg::kBr;
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float l = softmax.l[mt][h];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                const int r = mt * 16 + lane / 4 + 8 * h;
                if (lane % 4 == 0) {
                    sM[warp * Cfg::kBr + r] = softmax.m[mt][h];
                    sL[warp * Cfg::kBr + r] = l;
                }
            }
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = mt * 16 + lane / 4 + 8 * h;
                float mx = -INFINITY;
#pragma unroll
                for (int w = 0; w < Cfg::kWarps; ++w)
                    mx = fmaxf(mx, sM[w * Cfg::kBr + r]);
                const float mine = softmax.m[mt][h];
                const float f = mine == -INFINITY ? 0.f : fast_exp2(mine - mx);
                if constexpr (Cfg::kFp8Cache) {  // tiles 2c, 2c+1: d chunk c's even, odd dims
                    float* row = sO + (warp * Cfg::kBr + r) * Cfg::kDHead + (lane % 4) * 4;
#pragma unroll
                    for (int nt = 0; nt < Cfg::kNTilesO; nt += 2)
                        *reinterpret_cast<float4*>(row + nt * 8) =
                            make_float4(O[mt][nt][2 * h] * f, O[mt][nt + 1][2 * h] * f,
                                        O[mt][nt][2 * h + 1] * f, O[mt][nt + 1][2 * h + 1] * f);
                } else {
                    float* row = sO + (warp * Cfg::kBr + r) * Cfg::kDHead + (lane % 4) * 2;
#pragma unroll
                    for (int nt = 0; nt < Cfg::kNTilesO; ++nt)
                        *reinterpret_cast<float2*>(row + nt * 8) =
                            make_float2(O[mt][nt][2 * h] * f, O[mt][nt][2 * h + 1] * f);
                }
            }
        __syncthreads();

        constexpr int kQuads = Cfg::kDHead / 4;
        for (int idx = threadIdx.x; idx < Cfg::kBr * kQuads; idx += Cfg::kThreads) {
            const int r = idx / kQuads, c = (idx % kQuads) * 4;
            const int R = row0 + r;
            if (R >= rows || c >= p.d_head)
                continue;
            float mx = -INFINITY;
#pragma unroll
            for (int w = 0; w < Cfg::kWarps; ++w)
                mx = fmaxf(mx, sM[w * Cfg::kBr + r]);
            float l = 0.f;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int w = 0; w < Cfg::kWarps; ++w) {
                const float m = sM[w * Cfg::kBr + r];
                if (m != -INFINITY)
                    l += sL[w * Cfg::kBr + r] * fast_exp2(m - mx);
                const float4 o =
                    *reinterpret_cast<const float4*>(sO + (w * Cfg::kBr + r) * Cfg::kDHead + c);
                acc.x += o.x;
                acc.y += o.y;
                acc.z += o.z;
                acc.w += o.w;
            }
            const float inv = nan_out ? NAN : (l > 0.f ? v_descale / l : 0.f);
            const float lse =
                nan_out ? NAN : (l > 0.f ? (mx + log2f(l)) * 0.69314718055994531f : -INFINITY);
            acc.x *= inv;
            acc.y *= inv;
            acc.z *= inv;
            acc.w *= inv;
            const int i = position(R), hd = head(R);
            const int64_t q_row = seq.q_start + i;
            if (p.num_splits == 1) {
                Elem* o = static_cast<Elem*>(p.o) + batch * p.o_batch_stride +
                          q_row * p.o_row_stride + hd * p.o_head_stride + c;
                uint2 packed;
                packed.x = pack2<Elem>(acc.x, acc.y);
                packed.y = pack2<Elem>(acc.z, acc.w);
                *reinterpret_cast<uint2*>(o) = packed;
                if (c == 0 && p.lse != nullptr)
                    p.lse[batch * p.lse_batch_stride + hd * p.lse_head_stride + q_row] = lse;
            } else {
                const int64_t at = (int64_t(split) * p.heads + hd) * p.rows_total + global_row(R);
                *reinterpret_cast<float4*>(p.o_accum + at * p.d_head + c) = acc;
                if (c == 0)
                    p.lse_accum[at] = lse;
            }
        }
    }
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) dec_kernel(const __grid_constant__ DecParams p) {
    extern __shared__ __align__(128) unsigned char smem[];
    // The kernel before this one may write q or the cache: nothing is read before its end, but
    // after the KV-cache append, which writes only q's rotated copy and the new keys (run()).
    if (!p.after_append)
        grid_dependency_wait();
    DecodeCta<Cfg> cta(p, smem);
    if (cta.row0 >= cta.rows) {  // past this sequence's rows (varlen: the grid covers the longest)
        if (p.after_append)
            grid_dependency_wait();  // this grid ends after the append, as run() does
        return;
    }
    cta.run(smem);
}

}  // namespace flash::sm80
