// Runtime arguments of the backward kernels (preprocess, main, dQ conversion). Plain C++, shared
// by the kernels and the binding. Strides are in elements, offsets 64-bit, only d_head is
// contiguous; the fp32 buffers (lse, d_rows, dq_accum) are the operator's own, contiguous.
#pragma once

#include <cstdint>

namespace flash {

struct BwdParams {
    const void* q;     // (batch, seqlen_q, heads, d_head)
    const void* k;     // (batch, seqlen_k, kv_heads, d_head)
    const void* v;     // (batch, seqlen_k, kv_heads, d_head)
    const void* o;     // the forward's output, like q
    const void* dout;  // dL/dout, like q
    void* dq;          // like q
    void* dk;          // like k
    void* dv;          // like v

    const float* lse;   // the forward's natural-log LSE, (batch, heads, seqlen_q) contiguous
    const float* dlse;  // dL/dlse like lse, or nullptr (no gradient flows into the LSE)
    // Written by the preprocess, (batch, heads, seqlen_q_pad) contiguous: D = rowsum(dout * o)
    // - dlse, and LSE * log2(e) with +inf for rows that see no key and rows past seqlen_q (so
    // their P is 0); both whole query blocks, loaded with 16-byte copies.
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

    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    int64_t do_batch_stride, do_row_stride, do_head_stride;
    int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

    int batch;
    int heads;
    int heads_per_kv;  // heads / kv_heads
    int kv_heads;
    int seqlen_q;
    int seqlen_k;
    int seqlen_q_pad;  // rows of dq_accum per head (a multiple of the main kernel's B_r)
    int d_head;        // of the tensors: a multiple of 8, at most the kernel's variant
    int d_pad;         // columns of dq_accum: the kernel's d_head variant

    float scale_log2;     // as FwdParams: softmax_scale * log2(e), or softcap * log2(e)
    float softcap_scale;  // kernels with kSoftcap: softmax_scale / softcap
    float softmax_scale;  // dq, dk = softmax_scale * (dS K, dS^T Q)

    // Varlen batches (cu_seqlens_q != nullptr), as FwdParams: q, o, dout, dq are (total_q,
    // heads, d_head), k, v, dk, dv (total_k, kv_heads, d_head), every batch stride 0; sequence
    // b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and [cu_seqlens_k[b], ...); seqlen_q/k
    // are the longest; lse and dlse are (heads, total_q); the fp32 row buffers are (heads,
    // seqlen_q_pad) with seqlen_q_pad >= total_q + B_r.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    int total_q;
    int total_k;

    // As FwdParams: query i sees key j iff i + off - window_left <= j <= i + off + window_right,
    // off = seqlen_k - seqlen_q, -1 leaving a side unbounded; causal is (-1, 0).
    int window_left;
    int window_right;
};

}  // namespace flash
