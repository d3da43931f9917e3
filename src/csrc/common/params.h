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
};

struct FwdParams : AttentionParams {
    // Kernels that schedule their tiles dynamically (FwdKernelEntry::tile_counter): an int of
    // device memory for this launch alone, which the launcher zeroes on the launch's stream.
    int* tile_counter;
};

// The backward kernels (preprocess, main, dQ conversion): the forward's call, its gradients and
// the operator's own fp32 buffers (lse_log2, d_rows, dq_accum: contiguous).
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
    int seqlen_q_pad;  // rows of dq_accum per head (a multiple of the main kernel's B_r)
    int d_pad;         // columns of dq_accum: the kernel's d_head variant

    float softmax_scale;  // dq, dk = softmax_scale * (dS K, dS^T Q)
};

}  // namespace flash
