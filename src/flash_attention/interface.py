"""FlashAttention-compatible functions: the names, argument names, defaults and return
conventions of ``flash_attn`` (v2), on this package's kernels (forward and backward).

    from flash_attention.interface import flash_attn_func        # instead of flash_attn's

Supported as in flash_attn: softmax_scale, causal (aligned bottom-right), window_size,
softcap, GQA/MQA, varlen (packed) batches, return_attn_probs (returns out, softmax_lse, None:
no attention matrix is ever materialised), and the backward pass through autograd (the
packed functions give the gradient of the packed tensor); ``deterministic=True`` makes the
backward bitwise reproducible (the forward always is), fixed-length and varlen. Inference over
a KV cache: flash_attn_with_kvcache (flash_attention.kvcache), and flash_attn_varlen_func with
block_table (a paged cache of any page size) or seqused_k (per-sequence key counts), on the
decode kernels. Not supported, refused with an error naming the argument rather than silently
ignored: dropout_p > 0 and alibi_slopes.
"""

from __future__ import annotations

import torch

from .api import attention, attention_varlen
from .kvcache import FP8_CACHES, flash_attn_with_kvcache, varlen_decode

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _check_unsupported(dropout_p: float, alibi_slopes: object) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p={dropout_p}: flash_attention has no dropout; pass dropout_p=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: flash_attention has no ALiBi bias; pass None")


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """q: (batch, seqlen_q, heads, d_head); k, v: (batch, seqlen_k, kv_heads, d_head).
    Returns out (batch, seqlen_q, heads, d_head), or with return_attn_probs
    (out, softmax_lse (batch, heads, seqlen_q) fp32, None). float8_e4m3fn q, k, v (Hopper)
    take FlashAttention 3's q_descale, k_descale, v_descale (fp32 (batch, kv_heads)) and
    return bf16 (flash_attention.fp8)."""
    _check_unsupported(dropout_p, alibi_slopes)
    if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
        from .fp8 import attention_fp8

        res = attention_fp8(q, k, v, q_descale, k_descale, v_descale, causal=causal,
                            window_size=window_size, softcap=softcap,
                            softmax_scale=softmax_scale, return_lse=return_attn_probs)
        return (*res, None) if return_attn_probs else res
    if any(d is not None for d in (q_descale, k_descale, v_descale)):
        raise ValueError("q_descale, k_descale and v_descale are for float8_e4m3fn q, k, v; got "
                         f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    if return_attn_probs:
        out, lse = attention(q, k, v, causal=causal, window_size=window_size,
                             softcap=softcap, softmax_scale=softmax_scale, return_lse=True,
                             deterministic=deterministic)
        return out, lse, None
    return attention(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                     softmax_scale=softmax_scale, deterministic=deterministic)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """qkv: (batch, seqlen, 3, heads, d_head); q, k and v are read in place (strided views)."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError("qkv must be a 5-D tensor (batch, seqlen, 3, heads, d_head), got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv)}")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """q: (batch, seqlen_q, heads, d_head); kv: (batch, seqlen_k, 2, kv_heads, d_head)."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError("kv must be a 5-D tensor (batch, seqlen_k, 2, kv_heads, d_head), got "
                         f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv)}")
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    *,
    seqused_k: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """q: (total_q, heads, d_head); k, v: (total_k, kv_heads, d_head); cu_seqlens_q/k: int32
    (batch + 1,) offsets of the sequences; max_seqlen_q/k: the longest of each. Returns out
    (total_q, heads, d_head), or with return_attn_probs (out, softmax_lse (heads, total_q)
    fp32, None). Masks align per sequence. With block_table (batch, max_pages) int32, k and v
    are a paged cache (num_pages, page_size, kv_heads, d_head) of any page size, sequence b's
    keys its cu_seqlens_k difference (or seqused_k[b]); seqused_k (batch,) int32 alone cuts
    each sequence to its first seqused_k[b] keys. FP8 k and v (float8_e4m3fn, float8_e5m2; a
    paged cache or packed rows) with a 16-bit q take k_descale, v_descale (fp32 (batch,
    kv_heads); None: 1). Those run the decode kernels (no backward). float8_e4m3fn q, k, v
    (Hopper) take q_descale, k_descale, v_descale (fp32 (batch, kv_heads)) and return bf16
    (flash_attention.fp8, the FP8 forward's varlen kernels)."""
    _check_unsupported(dropout_p, alibi_slopes)
    if isinstance(q, torch.Tensor) and q.dtype == torch.float8_e4m3fn:
        if block_table is not None or seqused_k is not None:
            raise ValueError("float8_e4m3fn q runs the FP8 forward over packed k and v: no "
                             "block_table or seqused_k (an FP8 KV cache takes a 16-bit q)")
        from .fp8 import attention_fp8

        res = attention_fp8(q, k, v, q_descale, k_descale, v_descale, causal=causal,
                            window_size=window_size, softcap=softcap,
                            softmax_scale=softmax_scale, return_lse=return_attn_probs,
                            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        return (*res, None) if return_attn_probs else res
    if q_descale is not None:
        raise ValueError("q_descale is for float8_e4m3fn q (the FP8 forward); a 16-bit q over "
                         f"an FP8 cache takes k_descale and v_descale alone, got q {q.dtype}")
    fp8_keys = k.dtype in FP8_CACHES and q.dtype in (torch.float16, torch.bfloat16)
    descales = k_descale is not None or v_descale is not None  # refused there unless FP8
    if block_table is not None or seqused_k is not None or fp8_keys or descales:
        out, lse = varlen_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, softmax_scale, causal, window_size, softcap,
                                 return_attn_probs, block_table, seqused_k,
                                 k_descale=k_descale, v_descale=v_descale)
        return (out, lse, None) if return_attn_probs else out
    if return_attn_probs:
        out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal=causal, window_size=window_size,
                                    softcap=softcap, softmax_scale=softmax_scale,
                                    return_lse=True, deterministic=deterministic)
        return out, lse, None
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            causal=causal, window_size=window_size, softcap=softcap,
                            softmax_scale=softmax_scale, deterministic=deterministic)
