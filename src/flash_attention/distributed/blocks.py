"""One call of the ring: attention of a query chunk's rows over a slice of keys (the whole block,
or masked by a window (left, right) aligned bottom-right: causal on the diagonal, or a sliding
window's band shifted onto the slices, layout.band_slice) and its backward given the merged
output and LSE. CUDA tensors run the package's operators (flash_attention::attention and
::bwd); CPU tensors run the same math in fp32 (reference.attention_reference and its gradient
below), so the ring's communication and merging are tested over gloo on machines without a
GPU. The backward adds its gradients into fp32 sums (flash_attention::bwd_accumulate)."""

from __future__ import annotations

import math

import torch

from ..masks import visible
from ..reference import _expand_kv, attention_reference


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  window: tuple[int, int], softcap: float, varlen=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Sq, H, D), lse (B, H, Sq) fp32) of q over k, v, masked by window (left, right;
    -1 unbounded; (-1, 0) is causal) aligned bottom-right. varlen: (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k) of a pack (batch 1), masks per sequence."""
    left, right = window
    if varlen is not None:
        if q.is_cuda:
            from .. import ops

            ops.require()
            o, lse = torch.ops.flash_attention.attention.default(
                q[0], k[0], v[0], *varlen, scale, False, left, right, float(softcap), True, "")
            return o[None], lse[None]
        return _per_sequence(lambda qs, ks, vs: attention_reference(
            qs, ks, vs, scale, True, False, window, softcap), varlen, (q, k, v), (1, 2))
    if q.is_cuda:
        from .. import ops

        ops.require()
        return torch.ops.flash_attention.attention.default(
            q, k, v, None, None, 0, 0, scale, False, left, right, float(softcap), True, "")
    return attention_reference(q, k, v, scale, True, False, window, softcap)


def _per_sequence(fn, varlen, tensors, cat_dims):
    """fn over each sequence of a pack (batch-1 tensors; the first is cut by cu_seqlens_q, the
    others by cu_seqlens_k, a trailing LSE-like (1, H, rows) by cu_seqlens_q on dim 2), its
    outputs concatenated along cat_dims (one per output)."""
    cu_q, cu_k = varlen[0].tolist(), varlen[1].tolist()
    outs = []
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        args = [t[:, rq] if j == 0 else t[:, rk] for j, t in enumerate(tensors[:3])]
        args += [t[:, rq] for t in tensors[3:5]] + [t[:, :, rq] for t in tensors[5:]]
        outs.append(fn(*args))
    return tuple(torch.cat(parts, dim=d) for parts, d in zip(zip(*outs), cat_dims))


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, scale: float, window: tuple[int, int],
                   softcap: float, deterministic: bool, varlen,
                   sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Adds dq, dk, dv of this block's share of the loss, from the merged out and lse of q's
    rows (P = exp(scores - lse) is then the block's slice of the full softmax), into `sums`
    (fp32 tensors shaped like q, k, v: the kernels add their fp32 results, so a key's gradient
    is rounded once, after the last block, however many blocks add into it). window and varlen
    as in block_forward."""
    left, right = window
    lse = lse.contiguous()
    if q.is_cuda:
        from .. import ops

        ops.require()
        cu = (None, None, 0, 0) if varlen is None else varlen
        squeeze = (lambda t: t[0]) if varlen is not None else (lambda t: t)
        torch.ops.flash_attention.bwd_accumulate.default(
            squeeze(dout), squeeze(q), squeeze(k), squeeze(v), squeeze(out), squeeze(lse), *cu,
            scale, False, left, right, float(softcap), deterministic,
            *(squeeze(t) for t in sums), "")
        return
    if varlen is not None:  # per sequence: (q, k, v, dout, out, lse) cut as _per_sequence cuts them
        grads = _per_sequence(
            lambda qs, ks, vs, ds, os_, ls: _reference_backward(ds, qs, ks, vs, os_, ls, scale,
                                                                window, softcap),
            varlen, (q, k, v, dout, out, lse), (1, 1, 1))
    else:
        grads = _reference_backward(dout, q, k, v, out, lse, scale, window, softcap)
    for total, g in zip(sums, grads):
        total.add_(g)


def _reference_backward(dout, q, k, v, out, lse, scale, window, softcap):
    heads, kv_heads = q.shape[2], k.shape[2]
    qf, dof, of = q.float(), dout.float(), out.float()
    kf, vf = _expand_kv(k.float(), heads), _expand_kv(v.float(), heads)
    raw = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap > 0:
        t = torch.tanh(raw / softcap)
        scores = softcap * t
    else:
        scores = raw
    if window != (-1, -1):
        scores = scores.masked_fill(~visible(q.shape[1], k.shape[1], *window), -math.inf)
    finite = torch.isfinite(lse)[..., None]
    p = torch.where(finite, torch.exp(scores - torch.where(finite, lse[..., None], 0.0)), 0.0)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, vf)
    rows = (dof * of).sum(-1).transpose(1, 2)  # D = rowsum(dout * out): (B, H, Sq)
    ds = p * (dp - rows[..., None])
    if softcap > 0:
        ds = ds * (1 - t * t)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    group = heads // kv_heads
    if group > 1:  # the query heads of a KV head add into its gradient
        dk = dk.unflatten(2, (kv_heads, group)).sum(3)
        dv = dv.unflatten(2, (kv_heads, group)).sum(3)
    return dq, dk, dv  # fp32
