"""FP8 attention on Hopper: float8_e4m3fn q, k, v with fp32 descales per (batch, KV head), fp32
softmax, bf16 out (the Hopper forward's e4m3 kernels: fwd_sm90_e4m3_...; no backward).

    import flash_attention.fp8 as fp8
    q8, q_descale = fp8.quantize(q, kv_heads)  # per (batch, KV head) scales; k, v alike
    out = fp8.attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale, causal=True)
    # or flash_attn's (FlashAttention 3's) names:
    from flash_attention.interface import flash_attn_func
    out = flash_attn_func(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    # varlen (packed) batches: q8 (total_q, heads, d_head), descales (sequences, kv_heads)
    out = fp8.attention_fp8(q8, k8, v8, qd, kd, vd, cu_seqlens_q=cu, cu_seqlens_k=cu,
                            max_seqlen_q=m, max_seqlen_k=m)

out = softmax(q k^T * softmax_scale) v over the dequantised inputs (q * q_descale, ...): the
kernel folds q's and k's descales into the softmax scale and v's into O's normalisation. A
descale is an fp32 (batch, kv_heads) tensor (for q: of the KV head its query heads share);
a per-tensor scale is ``s.expand(batch, kv_heads)``; None means 1.
"""

from __future__ import annotations

import torch

from . import ops
from .validation import (
    check_inputs,
    check_scale,
    check_softcap,
    check_varlen_inputs,
    check_window,
)

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def quantize(x: torch.Tensor, scale_heads: int | None = None,
             per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (batch, seq, heads, d_head) -> (x / descale as float8_e4m3fn, descale fp32 (batch,
    scale_heads)), the amax of each (batch, group of heads / scale_heads heads) mapped to 448.
    scale_heads defaults to heads; for q under GQA pass the KV heads (query heads h share KV
    head h // (heads / kv_heads), and so their descale). per_tensor: one scale, expanded."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError("x must be a (batch, seq, heads, d_head) tensor")
    b, _, h, _ = x.shape
    groups = h if scale_heads is None else scale_heads
    if groups <= 0 or h % groups:
        raise ValueError(f"scale_heads ({groups}) must divide heads ({h})")
    xf = x.float()
    tiny = torch.finfo(torch.float32).tiny
    if per_tensor:
        descale = (xf.abs().amax() / E4M3_MAX).clamp_min(tiny)
        scaled, descale = xf / descale, descale.expand(b, groups)
    else:
        amax = xf.unflatten(2, (groups, h // groups)).abs().amax(dim=(1, 3, 4))
        descale = (amax / E4M3_MAX).clamp_min(tiny)
        scaled = xf / descale.repeat_interleave(h // groups, dim=1)[:, None, :, None]
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), descale


def attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    config: str | None = None,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int = 0,
    max_seqlen_k: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FP8 attention: q (batch, seqlen_q, heads, d_head), k, v (batch, seqlen_k, kv_heads,
    d_head), float8_e4m3fn on an sm_90 GPU, d_head a multiple of 16 from 96 to 256 (the d_head
    128 and 256 kernels). Masks, softcap and the LSE as flash_attention.attention;
    out is bf16. config names an FP8 kernel (fwd_sm90_e4m3_...). With cu_seqlens_q/k (int32
    (sequences + 1,) offsets) and max_seqlen_q/k, a varlen batch as attention_varlen's: q
    (total_q, heads, d_head), k, v (total_k, kv_heads, d_head), descales (sequences, kv_heads),
    lse (heads, total_q)."""
    if not ops.LOADED:
        ops.require()  # the extension loaded, its operators (and this one's fake) registered
    kernel = config or ""
    left, right = window_size
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    try:
        o, lse = torch.ops.flash_attention.attention_fp8.default(
            q, k, v, *varlen, q_descale, k_descale, v_descale, softmax_scale, causal, left,
            right, float(softcap), return_lse, kernel)
    except Exception:
        _check_call(q, k, v, q_descale, k_descale, v_descale, causal, window_size, softcap,
                    softmax_scale, varlen)
        raise  # the Python checks pass: the operator's own error stands
    return (o, lse) if return_lse else o


def _check_call(q, k, v, q_descale, k_descale, v_descale, causal, window_size, softcap,
                softmax_scale, varlen=(None, None, 0, 0)):
    """The checks that name the argument (TypeError / ValueError), as the operator runs them;
    varlen: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), cu_seqlens None for a
    fixed-length call."""
    if any(getattr(t, "requires_grad", False) for t in (q, k, v)):
        raise ValueError("FP8 attention has no backward: q, k and v must not require grad")
    if (varlen[0] is None) != (varlen[1] is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together (a varlen call) or not at "
                         "all")
    if varlen[0] is not None:
        prob = check_varlen_inputs(q, k, v, *varlen, dtypes=(torch.float8_e4m3fn,))
    else:
        prob = check_inputs(q, k, v, dtypes=(torch.float8_e4m3fn,))
    if prob.d_head % 16:
        raise ValueError(f"FP8 attention needs d_head a multiple of 16, got {prob.d_head}")
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale),
                    ("v_descale", v_descale)):
        if d is None:
            continue
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float32 or tuple(d.shape) != (
                prob.batch, prob.kv_heads) or d.device != q.device:
            raise ValueError(
                f"{name} must be an fp32 (batch, kv_heads) = ({prob.batch}, {prob.kv_heads}) "
                "tensor on q's device (a per-tensor scale: s.expand(batch, kv_heads)), got "
                + (f"{d.dtype} {tuple(d.shape)} on {d.device}" if isinstance(d, torch.Tensor)
                   else type(d).__name__))
    check_scale(softmax_scale, prob.d_head)
    check_window(causal, tuple(window_size))
    check_softcap(softcap)
    return prob


def attention_fp8_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       q_descale, k_descale, v_descale, softmax_scale, causal, window_left,
                       window_right, softcap, return_lse, kernel):
    """flash_attention::attention_fp8 under tracing: the Python checks, then out (bf16, like q)
    and lse ((batch, heads, seqlen_q), varlen (heads, total_q), or empty)."""
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_call(q, k, v, q_descale, k_descale, v_descale, causal, (window_left, window_right),
                softcap, softmax_scale, varlen)
    if kernel and kernel not in ops.BUILT_NAMES:
        raise ValueError(f"kernel {kernel} is not in this build")
    out = q.new_empty(q.shape, dtype=torch.bfloat16)
    lse_shape = ((q.shape[1], q.shape[0]) if cu_seqlens_q is not None
                 else (q.shape[0], q.shape[2], q.shape[1]))
    lse = q.new_empty(lse_shape if return_lse else (0,), dtype=torch.float32)
    return out, lse

