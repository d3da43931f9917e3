// Runtime arguments of the kernels. Plain C++: shared by the kernels (no torch) and the binding
// (torch). Every stride is a runtime value in elements and every offset is 64-bit, so any
// batch/head/sequence stride and tensors over 2^31 elements work; only the last dimension
// (d_head) must be contiguous.
//
// AttentionParams is the call as every kernel kind reads it (the tensors, shapes, scale, window,
// softcap, varlen offsets), filled by one binding function (binding/params.h); each direction's
// parameters add their own fields after it (FwdParams, BwdParams), so a field has one name and
// one place in every kind.
#pragma once

#include <cstdint>

namespace flash {

struct AttentionParams {
    const void* q;  // (batch, seqlen_q, heads, d_head)
    const void* k;  // (batch, seqlen_k, kv_heads, d_head)
    const void* v;  // (batch, seqlen_k, kv_heads, d_head)
    void* o;        // (batch, seqlen_q, heads, d_head): the forward's output (the backward's input)
    // (batch, heads, seqlen_q) fp32, natural log: written by the forward (nullptr when not
    // requested), read by the backward; rows contiguous, lse_batch/head_stride apart.
    float* lse;

    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int64_t lse_batch_stride, lse_head_stride;

    int batch;
    int heads;
    int heads_per_kv;  // heads / kv_heads (1 unless GQA/MQA)
    int seqlen_q;      // varlen: the largest sequence of q (the grid covers it)
    int seqlen_k;      // varlen: the largest sequence of k
    int d_head;        // of the tensors: a multiple of 8, at most the kernel's variant (kDHead)

    float scale_log2;  // softmax_scale * log2(e): scores go straight into exp2; with a softcap,
                       // softcap * log2(e) (the scale is applied inside the tanh)

    // Query i sees key j iff i + (seqlen_k - seqlen_q) - window_left <= j <= i + (seqlen_k -
    // seqlen_q) + window_right; -1 leaves that side unbounded. Causal is (-1, 0): the diagonal
    // aligned bottom-right. Forward kernels read it with kMask, backward kernels always.
    int window_left;
    int window_right;

    float softcap_scale;  // kernels with kSoftcap: softmax_scale / softcap, applied inside tanh

    // Varlen (packed) batches, when cu_seqlens_q != nullptr: q, o are (total_q, heads, d_head),
    // k, v (total_k, kv_heads, d_head), every batch stride 0, lse (heads, total_q); sequence b is
    // rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and o (and of each head's LSE row) and
    // [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v. Masks align per sequence.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    int total_q;
    int total_k;

    // FP8 tensors (the Hopper forward's q, k, v; the decode kernels' K/V cache): the fp32
    // descales of q, k and v (0, 1, 2) per (batch, KV head), element (b, h) at descale[i] + b *
    // descale_batch_stride[i] + h * descale_head_stride[i] (strides 0 for a per-tensor scale);
    // nullptr: 1.
    const float* descale[3];
    int64_t descale_batch_stride[3], descale_head_stride[3];
};

struct FwdParams : AttentionParams {
    // Kernels that schedule their tiles dynamically (FwdKernelEntry::tile_counter): an int of
    // device memory for this launch alone, which the launcher zeroes on the launch's stream.
    int* tile_counter;
};

// The backward kernels (preprocess, main, dQ conversion): the forward's call, its gradients and
// the operator's own fp32 buffers (lse_log2, d_rows, dq_accum: contiguous).
// Varlen calls of the Hopper backward: the per-row buffers hold each sequence from a multiple of
// this many rows (flash::bwd::varlen_row0 in backward_common.cuh).
constexpr int kBwdVarlenRowAlign = 128;

struct BwdParams : AttentionParams {
    const void* dout;  // dL/dout, like q
    void* dq;          // like q
    void* dk;          // like k
    void* dv;          // like v

    const float* dlse;  // dL/dlse like lse, or nullptr (no gradient flows into the LSE)
    // Written by the preprocess, (batch, heads, seqlen_q_pad) contiguous (varlen: (heads,
    // seqlen_q_pad) with seqlen_q_pad >= total_q + B_r): D = rowsum(dout * o) - dlse, and LSE *
    // log2(e) with +inf for rows that see no key and rows past seqlen_q (so their P is 0); both
    // whole query blocks, loaded with 16-byte copies.
    float* d_rows;
    float* lse_log2;
    // fp32 dQ accumulator, (batch, heads, seqlen_q_pad, d_pad) contiguous: seqlen_q rounded up
    // to the main kernel's B_r, d_head to its variant, so its atomics need no bounds checks.
    float* dq_accum;
    // deterministic: an int per (batch, head, query block), zeroed: the number of KV blocks
    // whose dQ contributions were added, so they are added in a fixed order. nullptr: atomics
    // in any order (the default).
    int* dq_semaphore;
    // The sm80 family's rotated deterministic order (bwd::rotated_dq_turn): r, the query blocks
    // per KV block, where its launcher chose it; 0 (the binding's value): the last KV block
    // first. The Hopper family keeps its own (sm90::BwdKernelParams).
    int dq_rotation;
    // The sm80 family's dQ accumulator order (bwd::DqLayout), chosen by the binding and
    // followed by its main kernel and conversion: 0 kRows (varlen), 1 kWgmmaTiles (fixed-length
    // calls on sm_90 and later: one 16-byte reduction per m16 x n8 tile and thread, a warp's on
    // 512 contiguous bytes), 2 kLaneTiles (fixed-length calls on sm_80-89: four scalar
    // reductions per tile and thread, a warp's on 128 contiguous bytes).
    int dq_tiles;

    int64_t do_batch_stride, do_row_stride, do_head_stride;
    int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

    int kv_heads;
    // true: dq, dk, dv are fp32 tensors (strides as above, in floats) the call's gradients are
    // added into, not 16-bit outputs: ring attention's per-block partials, summed over blocks
    // without a 16-bit rounding per block (flash_attention::bwd_accumulate).
    bool accumulate;
    // Rows of dq_accum per head (a multiple of the main kernel's B_r; varlen calls of the
    // Hopper family: each sequence from a multiple of kBwdVarlenRowAlign, so at least total_q
    // + kBwdVarlenRowAlign x batch).
    int seqlen_q_pad;
    int d_pad;  // columns of dq_accum: the kernel's d_head variant

    float softmax_scale;  // dq, dk = softmax_scale * (dS K, dS^T Q)
};

// The decode kernels (flash_attn_with_kvcache, varlen calls over a paged cache): the forward's
// call read through a KV cache. Query rows are packed per KV head (the heads_per_kv query heads
// of one KV head are rows of one tile), keys may be split over CTAs (num_splits > 1: each split
// writes a normalised partial output and its LSE, fp32, merged by the combine kernel).
struct DecParams : AttentionParams {
    // Keys of sequence b: seqused_k[b] when given (a KV cache's lengths after the append), else
    // cu_seqlens_k's difference (varlen), else seqlen_k. Read on the device only: a length
    // outside [0, capacity] is reported through `status` and gives NaN rows, never an access
    // outside the cache.
    const int* seqused_k;
    int seqused_add;  // added to seqused_k[b]: the rows the append before this kernel adds
    int capacity;     // keys a sequence may hold: the cache's seqlen, or pages per row x page_size

    // Paged caches (block_table != nullptr): k, v are (num_pages, page_size, kv_heads, d_head)
    // (k/v_batch_stride step pages, row strides rows of a page); key j of sequence b lies in
    // page block_table[b * block_table_stride + j / page_size] at row j % page_size.
    const int* block_table;
    int64_t block_table_stride;
    int page_size;
    int page_shift;  // log2(page_size) when a power of two, else -1
    int num_pages;

    // Contiguous caches: the cache row of sequence b (cache_batch_idx[b], else b), < cache_batch.
    const int* cache_batch_idx;
    int cache_batch;
    // Contiguous caches: sequence b's keys start at cache row leftpad_k[b] (flash_attn's
    // cache_leftpad; its seqused_k / lengths count from row 0); nullptr: at row 0.
    const int* leftpad_k;

    int kv_heads;
    int num_splits;    // key ranges per (sequence, KV head, row block); 1: no combine
    float* o_accum;    // (num_splits, heads, rows_total, d_head) fp32, when num_splits > 1
    float* lse_accum;  // (num_splits, heads, rows_total) fp32, natural log
    int rows_total;    // query rows over the batch: batch x seqlen_q, or total_q (varlen)

    // after_append: the launch before this kernel is the KV-cache append, which starts after
    // every earlier kernel in stream order and writes only q's rotated copy and each sequence's
    // last new_keys keys: the first stages' blocks of older keys are copied before the grid
    // dependency wait, under the append. false: nothing is read before that wait.
    bool after_append;
    int new_keys;

    // An int of device memory the kernels OR error bits into (decode::kStatus*); never cleared
    // by them. nullptr: none kept.
    int* status;
};

namespace decode {

// Error bits of DecParams::status (and of the KV-cache append's).
constexpr int kStatusSeqlen = 1;    // a sequence's key count (or append row) outside its cache
constexpr int kStatusPage = 2;      // a block-table entry outside [0, num_pages)
constexpr int kStatusCacheRow = 4;  // a cache_batch_idx entry outside [0, cache_batch)
constexpr int kStatusRotary = 8;    // a rotary position past the rows of cos / sin
constexpr int kStatusLeftpad = 16;  // a cache_leftpad entry outside [0, the sequence's keys]

}  // namespace decode

}  // namespace flash
