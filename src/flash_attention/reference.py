"""References, usable on CPU and GPU.

- :func:`attention_reference`: plain softmax attention, by default in fp32 on upcast inputs
  (the accuracy reference), or in the inputs' own dtype (the "what low precision costs" peer of
  the test rule), with causal / sliding-window masks and softcap as flash_attention applies them.
- :func:`kvcache_reference`: flash_attn_with_kvcache's semantics on a copy of the cache: new
  keys and values appended at each sequence's length (rotary on them and on q where given), a
  paged cache read through its block table, then attention over each sequence's keys.
- :func:`attention_reference_fp8`: FP8 attention's reference: the e4m3 inputs dequantised
  (times their descales) in fp32, and, as the peer of FP8's test rule, with P rounded to e4m3
  (scaled by 2^8, as the kernels do) before P V.
- :func:`emulate_blocks`: the kernel's algorithm block by block in Python: B_r query rows at a
  time, KV blocks of B_c in the config's order, online softmax in base 2 with running max m and
  sum l, P rounded to the input dtype before P V as the kernel does. With ``trace`` it records
  m and l after every (query block, KV block) step: the debugging aid for finding the first
  block where a kernel departs from the algorithm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .masks import block_mask, canonical_window, kv_blocks, visible
from .rotary import apply_rotary

LOG2E = math.log2(math.e)


def _scale(softmax_scale: float | None, d_head: int) -> float:
    return 1.0 / math.sqrt(d_head) if softmax_scale is None else float(softmax_scale)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, Hk, D) -> (B, S, H, D) for GQA/MQA: query head h reads kv head h // (H / Hk)."""
    kv_heads = t.shape[2]
    if kv_heads == heads:
        return t
    return t.repeat_interleave(heads // kv_heads, dim=2)


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    upcast: bool = True,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse): out (B, Sq, H, D) in q's dtype if not upcast else fp32; lse
    (B, H, Sq) fp32, natural log of the sum of exp(scores) over the keys a row sees, where
    scores = softcap * tanh(scale * q k^T / softcap) with a softcap, scale * q k^T without.
    A row that sees no key (none at all, or all masked): out 0, lse -inf."""
    _, seqlen_q, heads, d_head = q.shape
    seqlen_k = k.shape[1]
    scale = _scale(softmax_scale, d_head)
    dtype = torch.float32 if upcast else q.dtype
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    kf, vf = _expand_kv(kf, heads), _expand_kv(vf, heads)
    scores = _capped(torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale, softcap)
    left, right = canonical_window(causal, window_size, seqlen_q, seqlen_k)
    seen = visible(seqlen_q, seqlen_k, left, right, q.device)
    scores = scores.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(scores.float(), dim=-1)
    empty = ~seen.any(dim=-1)  # rows with no key: softmax would be NaN
    probs = torch.softmax(scores.masked_fill(empty[:, None], 0.0), dim=-1)
    probs = probs.masked_fill(empty[:, None], 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out, lse


def dequantize_fp8(x: torch.Tensor, descale: torch.Tensor | None) -> torch.Tensor:
    """float8 x (B, S, H, D) times its descale (B, H_k) (None: 1) in fp32; heads H > H_k share
    the descale of their KV head (h // (H / H_k))."""
    xf = x.float()
    if descale is None:
        return xf
    return xf * descale.float().repeat_interleave(x.shape[2] // descale.shape[1], dim=1)[
        :, None, :, None]


def quantize_cache(x: torch.Tensor, descale: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """x (B, S, Hk, D) over its descale (B, Hk) (None: 1) in fp32, clamped to the FP8 dtype's
    largest finite value and rounded to nearest: what the KV-cache append stores."""
    xf = x.float()
    if descale is not None:
        xf = xf / descale.float()[:, None, :, None]
    top = torch.finfo(dtype).max
    return xf.clamp(-top, top).to(dtype)


def attention_reference_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    round_p: bool = False,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32, lse) of float8_e4m3fn q, k, v dequantised in fp32 (the FP8 accuracy reference);
    with round_p, P = exp(s - rowmax) * 2^8 is rounded to e4m3 before P V (its row sum is not),
    as the FP8 kernels do: the low-precision peer of the test rule."""
    qf = dequantize_fp8(q, q_descale)
    kf, vf = dequantize_fp8(k, k_descale), dequantize_fp8(v, v_descale)
    if not round_p:
        return attention_reference(qf, kf, vf, softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap)
    _, seqlen_q, heads, d_head = q.shape
    seqlen_k = k.shape[1]
    kf, vf = _expand_kv(kf, heads), _expand_kv(vf, heads)
    scores = _capped(torch.einsum("bqhd,bkhd->bhqk", qf, kf) * _scale(softmax_scale, d_head),
                     softcap)
    left, right = canonical_window(causal, window_size, seqlen_q, seqlen_k)
    scores = scores.masked_fill(~visible(seqlen_q, seqlen_k, left, right, q.device), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - m.masked_fill(torch.isinf(m), 0.0)) * 256.0
    l_sum = p.sum(dim=-1, keepdim=True)
    p8 = p.to(torch.float8_e4m3fn).float()
    out = torch.einsum("bhqk,bkhd->bqhd", p8 / l_sum.clamp_min(1e-30), vf)
    return out, lse


@dataclass
class KVCacheResult:
    out: torch.Tensor  # (B, Sq, H, D): fp32 with upcast, else q's dtype
    lse: torch.Tensor  # (B, H, Sq) fp32
    k_cache: torch.Tensor  # the caches after the append (copies; the inputs are untouched)
    v_cache: torch.Tensor


def kvcache_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor = 0,
    cache_batch_idx: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    upcast: bool = True,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
) -> KVCacheResult:
    """flash_attn_with_kvcache's result, one sequence at a time. q (B, Sq, H, D); the caches
    (B_cache, S_cache, Hk, D), or with block_table (B, max_pages) int (num_pages, page_size, Hk,
    D) read row r of sequence b from page block_table[b, r // page_size]; k, v (B, S_new, Hk,
    D) or None, written at rows cache_seqlens[b] ... + S_new of sequence b's cache (row
    cache_batch_idx[b] of the cache when given). With rotary_cos/sin (seqlen_ro, rotary_dim /
    2) the new keys rotate at their rows' positions, q at cache_seqlens[b] + i when causal or
    the window bounds the left, else every row at cache_seqlens[b]. Then sequence b attends to
    its cache_seqlens[b] + S_new keys, masks aligned bottom-right (attention_reference).
    An FP8 cache (float8_e4m3fn / e5m2) holds values over k_descale / v_descale ((B, Hk) fp32,
    None: 1): new rows (rotated in fp32) are divided by them, clamped to the format's range and
    rounded; attention reads the cache times its descale, in fp32 (upcast) or q's dtype.
    cache_leftpad (B,) int (contiguous caches): sequence b's keys are its rows cache_leftpad[b]
    up to its length, masks aligned to them; the append and rotary positions are unchanged."""
    batch, seqlen_q = q.shape[:2]
    seqlens = torch.as_tensor(cache_seqlens, dtype=torch.int64).reshape(-1).expand(batch).cpu()
    s_new = 0 if k is None else k.shape[1]
    kc, vc = k_cache.clone(), v_cache.clone()
    fp8 = kc.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    # An FP8 cache is indexed and written through uint8 views (not every index op takes FP8).
    kc_rows, vc_rows = (kc.view(torch.uint8), vc.view(torch.uint8)) if fp8 else (kc, vc)
    if k is not None and fp8:  # quantised from fp32 (rotated in fp32), as the append does
        k, v = k.float(), v.float()
    if k is not None and rotary_cos is not None:
        pos = seqlens[:, None] + torch.arange(s_new)[None, :]
        k = apply_rotary(k, rotary_cos, rotary_sin, pos.to(k.device), rotary_interleaved)
    if k is not None and fp8:
        k = quantize_cache(k, k_descale, kc.dtype)
        v = quantize_cache(v, v_descale, vc.dtype)
    if rotary_cos is not None:
        left = window_size[0]
        pos = seqlens[:, None] + (torch.arange(seqlen_q)[None, :] if causal or left != -1
                                  else torch.zeros(1, seqlen_q, dtype=torch.int64))
        q = apply_rotary(q, rotary_cos, rotary_sin, pos.to(q.device), rotary_interleaved)
    outs, lses = [], []
    for b in range(batch):
        length = int(seqlens[b]) + s_new
        if block_table is None:
            row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
            rows_k, rows_v = kc_rows[row], vc_rows[row]  # views: the append writes the copy
        else:
            page = kc.shape[1]
            pages = block_table[b, : -(-length // page)].long().cpu()
            rows_k = kc_rows[pages].flatten(0, 1)  # (pages * page_size, Hk, D) copies ...
            rows_v = vc_rows[pages].flatten(0, 1)
        if k is not None:
            rows_k[int(seqlens[b]):length] = k[b].view(rows_k.dtype)
            rows_v[int(seqlens[b]):length] = v[b].view(rows_v.dtype)
            if block_table is not None:  # ... written back to their pages
                kc_rows[pages] = rows_k.unflatten(0, (len(pages), kc.shape[1]))
                vc_rows[pages] = rows_v.unflatten(0, (len(pages), vc.shape[1]))
        pad = 0 if cache_leftpad is None else int(cache_leftpad[b])
        keys, values = rows_k[None, pad:length], rows_v[None, pad:length]
        if fp8:
            keys = dequantize_fp8(keys.view(kc.dtype),
                                  None if k_descale is None else k_descale[b:b + 1])
            values = dequantize_fp8(values.view(vc.dtype),
                                    None if v_descale is None else v_descale[b:b + 1])
            if not upcast:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
        out, lse = attention_reference(q[b:b + 1], keys, values, softmax_scale, upcast, causal,
                                       window_size, softcap)
        outs.append(out)
        lses.append(lse)
    return KVCacheResult(torch.cat(outs), torch.cat(lses), kc, vc)


@dataclass
class BlockTrace:
    """m and l of every row of one query block after one KV block (scaled base-2 units)."""

    batch: int
    head: int
    q_block: int
    kv_block: int
    m: torch.Tensor  # (rows,)
    l: torch.Tensor  # (rows,)


@dataclass
class Emulation:
    out: torch.Tensor  # (B, Sq, H, D) fp32
    lse: torch.Tensor  # (B, H, Sq) fp32
    trace: list[BlockTrace] = field(default_factory=list)


def emulate_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_r: int = 128,
    block_c: int = 64,
    reverse_kv: bool = False,
    softmax_scale: float | None = None,
    round_p: bool = True,
    trace: bool = False,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> Emulation:
    """The FA2 forward algorithm, one (query block, KV block) step at a time, in fp32. With a
    causal or window mask it visits the KV blocks the kernel visits (masks.kv_blocks) and masks
    element-wise only the blocks the kernel masks; the rows past seqlen_q of a tail block, which
    the kernel computes and drops, are left out."""
    batch, seqlen_q, heads, d_head = q.shape
    seqlen_k = k.shape[1]
    scale = _scale(softmax_scale, d_head)
    left, right = canonical_window(causal, window_size, seqlen_q, seqlen_k)
    kx, vx = _expand_kv(k, heads), _expand_kv(v, heads)
    out = torch.zeros((batch, seqlen_q, heads, d_head), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
    result = Emulation(out, lse)
    for b in range(batch):
        for h in range(heads):
            for qb in range(-(-seqlen_q // block_r)):
                rows = slice(qb * block_r, min((qb + 1) * block_r, seqlen_q))
                blocks = kv_blocks(qb * block_r, block_r, block_c, seqlen_q, seqlen_k, left,
                                   right)
                order = range(blocks.first, blocks.last + 1)
                qt = q[b, rows, h].float()
                m = torch.full((qt.shape[0],), -math.inf, device=q.device)
                l = torch.zeros(qt.shape[0], device=q.device)
                o = torch.zeros((qt.shape[0], d_head), device=q.device)
                for j in reversed(order) if reverse_kv else order:
                    cols = slice(j * block_c, min((j + 1) * block_c, seqlen_k))
                    s = _capped((qt @ kx[b, cols, h].float().T) * scale, softcap) * LOG2E
                    if blocks.needs_mask(j):  # the kernel's element mask (WindowMask)
                        seen = block_mask(qb * block_r, j * block_c, s.shape[0], s.shape[1],
                                          seqlen_q, seqlen_k, left, right).to(s.device)
                        s = s.masked_fill(~seen, -math.inf)
                    m_new = torch.maximum(m, s.max(dim=1).values)
                    offset = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                    corr = torch.exp2(m - offset)
                    p = torch.exp2(s - offset[:, None])
                    l = l * corr + p.sum(dim=1)
                    p_mma = p.to(q.dtype).float() if round_p else p
                    o = o * corr[:, None] + p_mma @ vx[b, cols, h].float()
                    m = m_new
                    if trace:
                        result.trace.append(BlockTrace(b, h, qb, j, m.clone(), l.clone()))
                safe_l = torch.where(l > 0, l, torch.ones_like(l))
                out[b, rows, h] = torch.where(l[:, None] > 0, o / safe_l[:, None], 0.0)
                lse[b, h, rows] = torch.where(
                    l > 0, (m + torch.log2(safe_l)) / LOG2E, torch.full_like(l, -math.inf)
                )
    return result
