// The kernels' parameters from a call's checked tensors: the layout block every kernel kind reads
// (common/params.h AttentionParams), filled here for the forward and the backward alike.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>

#include "../common/params.h"
#include "validation.h"

namespace flash::binding {

// A tensor's strides by role: (batch, row, head) of (batch, seq, heads, d_head); a varlen
// tensor (tokens, heads, d_head) has no batch dimension (batch stride 0).
struct RoleStrides {
    int64_t batch, row, head;
};

inline RoleStrides role_strides(const at::Tensor& t, bool varlen) {
    return varlen ? RoleStrides{0, t.stride(0), t.stride(1)}
                  : RoleStrides{t.stride(0), t.stride(1), t.stride(2)};
}

// Fills p from q, k, v, o as the kernels address them, lse (nullptr: the forward does not write
// one; its rows contiguous: (batch, heads, seqlen_q), varlen (heads, total_q)), the call's
// shape and varlen offsets, and its scale, window (canonical: causal folded in) and softcap.
inline void set_attention_params(flash::AttentionParams& p, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
                                 float* lse, const Varlen& vl, const CallShape& s,
                                 double softmax_scale, int64_t window_left, int64_t window_right,
                                 double softcap) {
    const bool varlen = vl.cu_q != nullptr;
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.o = o.data_ptr();
    p.lse = lse;
    const RoleStrides qs = role_strides(q, varlen), ks = role_strides(k, varlen),
                      vs = role_strides(v, varlen), os = role_strides(o, varlen);
    p.q_batch_stride = qs.batch;
    p.q_row_stride = qs.row;
    p.q_head_stride = qs.head;
    p.k_batch_stride = ks.batch;
    p.k_row_stride = ks.row;
    p.k_head_stride = ks.head;
    p.v_batch_stride = vs.batch;
    p.v_row_stride = vs.row;
    p.v_head_stride = vs.head;
    p.o_batch_stride = os.batch;
    p.o_row_stride = os.row;
    p.o_head_stride = os.head;
    p.lse_batch_stride = varlen ? 0 : s.heads * s.seqlen_q;
    p.lse_head_stride = varlen ? q.size(0) : s.seqlen_q;
    p.batch = static_cast<int>(s.batch);
    p.heads = static_cast<int>(s.heads);
    p.heads_per_kv = static_cast<int>(s.heads / s.kv_heads);
    p.seqlen_q = static_cast<int>(s.seqlen_q);
    p.seqlen_k = static_cast<int>(s.seqlen_k);
    p.d_head = static_cast<int>(s.d_head);
    // With a softcap, scores become softcap * tanh(scale * s / softcap): the kernel applies
    // scale / softcap inside the tanh and folds softcap into the exp2 scale.
    p.scale_log2 = static_cast<float>((softcap > 0 ? softcap : softmax_scale) * M_LOG2E);
    p.softcap_scale = static_cast<float>(softcap > 0 ? softmax_scale / softcap : 0.0);
    p.window_left = static_cast<int>(window_left);
    p.window_right = static_cast<int>(window_right);
    if (varlen) {
        p.cu_seqlens_q = vl.cu_q->data_ptr<int32_t>();
        p.cu_seqlens_k = vl.cu_k->data_ptr<int32_t>();
        p.total_q = static_cast<int>(q.size(0));
        p.total_k = static_cast<int>(k.size(0));
    }
}

}  // namespace flash::binding
