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
    float* lse;     // (batch, heads, seqlen_q), contiguous; nullptr when not requested

    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;

    int batch;
    int heads;
    int heads_per_kv;  // heads / kv_heads (1 unless GQA/MQA)
    int seqlen_q;
    int seqlen_k;

    float scale_log2;  // softmax_scale * log2(e): scores go straight into exp2; with a softcap,
                       // softcap * log2(e) (the scale is applied inside the tanh)

    // Kernels with kMask: query i sees key j iff i + (seqlen_k - seqlen_q) - window_left <= j
    // <= i + (seqlen_k - seqlen_q) + window_right; -1 leaves that side unbounded. Causal is
    // (-1, 0): the diagonal aligned bottom-right.
    int window_left;
    int window_right;

    float softcap_scale;  // kernels with kSoftcap: softmax_scale / softcap, applied inside tanh
};

}  // namespace flash
