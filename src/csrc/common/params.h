// Runtime arguments of the forward kernel. Plain C++: shared by the kernels (no torch) and the
// binding (torch). Every stride is a runtime value in elements and every offset is 64-bit, so any
// batch/head/sequence stride and tensors over 2^31 elements work; only the last dimension
// (d_head) must be contiguous.
#pragma once

#include <cstdint>

namespace flash {

struct FwdParams {
    const void* q;  // (batch, seqlen_q, heads, d_head)
    const void* k;  // (batch, seqlen_k, kv_heads, d_head)
    const void* v;  // (batch, seqlen_k, kv_heads, d_head)
    void* o;        // (batch, seqlen_q, heads, d_head)
    float* lse;     // rows contiguous, lse_batch/head_stride apart; nullptr when not requested

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

    // Kernels with kMask: query i sees key j iff i + (seqlen_k - seqlen_q) - window_left <= j
    // <= i + (seqlen_k - seqlen_q) + window_right; -1 leaves that side unbounded. Causal is
    // (-1, 0): the diagonal aligned bottom-right.
    int window_left;
    int window_right;

    float softcap_scale;  // kernels with kSoftcap: softmax_scale / softcap, applied inside tanh

    // Varlen (packed) batches, when cu_seqlens_q != nullptr: q, o are (total_q, heads, d_head),
    // k, v (total_k, kv_heads, d_head), every batch stride 0; sequence b is rows
    // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and o (and of each head's LSE row) and
    // [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v. Masks align per sequence.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    int total_q;
    int total_k;

    // Kernels that schedule their tiles dynamically (FwdKernelEntry::tile_counter): an int of
    // device memory for this launch alone, which the launcher zeroes on the launch's stream.
    int* tile_counter;
};

}  // namespace flash
