// Varlen (packed) batches: where one sequence's rows lie in the packed tensors, read from
// FwdParams::cu_seqlens_q/k; for a fixed-length batch every sequence is the whole tensor. Any
// kernel that takes varlen batches (forward or backward) starts a CTA by finding its sequence.
#pragma once

#include <cstdint>

#include "params.h"

namespace flash {

// This CTA's sequence: where its rows start in q/o and k/v, and its lengths. Varlen offsets are
// clamped into [0, total] (they are checked on the host, except during CUDA graph capture when
// they cannot be read), so no offset can address outside the tensors.
struct SeqSpan {
    int64_t q_start, k_start;
    int seqlen_q, seqlen_k;
};

__device__ __forceinline__ int clamp_to(int x, int hi) {
    return x < 0 ? 0 : (x > hi ? hi : x);
}

// Params: FwdParams or BwdParams (both hold cu_seqlens_q/k, total_q/k and seqlen_q/k); Span: a
// struct of {q_start, k_start, seqlen_q, seqlen_k} (the backward keeps a 32-bit one in smem).
template <class Span = SeqSpan, class Params>
__device__ __forceinline__ Span seq_span(const Params& p, int batch) {
    if (p.cu_seqlens_q == nullptr)
        return Span{0, 0, p.seqlen_q, p.seqlen_k};
    const int q0 = clamp_to(p.cu_seqlens_q[batch], p.total_q);
    const int q1 = clamp_to(p.cu_seqlens_q[batch + 1], p.total_q);
    const int k0 = clamp_to(p.cu_seqlens_k[batch], p.total_k);
    const int k1 = clamp_to(p.cu_seqlens_k[batch + 1], p.total_k);
    return Span{q0, k0, q1 > q0 ? q1 - q0 : 0, k1 > k0 ? k1 - k0 : 0};
}

// seq_span with the lengths cut to Params::seqlen_q/k (varlen: max_seqlen_q/k, from which the
// backward's grid and buffers are sized). A longer sequence is invalid input, refused on the host
// except during CUDA graph capture, when cu_seqlens cannot be read; cut, it is its first
// max_seqlen_q rows and max_seqlen_k keys (masks aligned to those): no access outside any buffer
// and no wait for a KV block the grid does not have, but its other rows get dq = 0 and its other
// keys no dk or dv.
template <class Span = SeqSpan, class Params>
__device__ __forceinline__ Span seq_span_cut(const Params& p, int batch) {
    Span s = seq_span<Span>(p, batch);
    s.seqlen_q = s.seqlen_q < p.seqlen_q ? s.seqlen_q : p.seqlen_q;
    s.seqlen_k = s.seqlen_k < p.seqlen_k ? s.seqlen_k : p.seqlen_k;
    return s;
}

}  // namespace flash
