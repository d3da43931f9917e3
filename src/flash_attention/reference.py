"""References, usable on CPU and GPU.

- :func:`attention_reference`: plain softmax attention, by default in fp32 on upcast inputs
  (the accuracy reference), or in the inputs' own dtype (the "what low precision costs" peer of
  the test rule).
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

LOG2E = math.log2(math.e)


def _scale(softmax_scale: float | None, d_head: int) -> float:
    return 1.0 / math.sqrt(d_head) if softmax_scale is None else float(softmax_scale)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, Hk, D) -> (B, S, H, D) for GQA/MQA: query head h reads kv head h // (H / Hk)."""
    kv_heads = t.shape[2]
    if kv_heads == heads:
        return t
    return t.repeat_interleave(heads // kv_heads, dim=2)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse): out (B, Sq, H, D) in q's dtype if not upcast else fp32; lse
    (B, H, Sq) fp32, natural log of the sum of exp(scaled scores). No keys: out 0, lse -inf."""
    batch, seqlen_q, heads, d_head = q.shape
    scale = _scale(softmax_scale, d_head)
    dtype = torch.float32 if upcast else q.dtype
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    kf, vf = _expand_kv(kf, heads), _expand_kv(vf, heads)
    if k.shape[1] == 0:
        out = torch.zeros(q.shape, dtype=dtype, device=q.device)
        lse = torch.full((batch, heads, seqlen_q), -math.inf, device=q.device)
        return out, lse
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    lse = torch.logsumexp(scores.float(), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)
    return out, lse


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
) -> Emulation:
    """The FA2 forward algorithm, one (query block, KV block) step at a time, in fp32."""
    batch, seqlen_q, heads, d_head = q.shape
    seqlen_k = k.shape[1]
    scale_log2 = _scale(softmax_scale, d_head) * LOG2E
    kx, vx = _expand_kv(k, heads), _expand_kv(v, heads)
    out = torch.zeros((batch, seqlen_q, heads, d_head), dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), -math.inf, dtype=torch.float32, device=q.device)
    result = Emulation(out, lse)
    n_kv = -(-seqlen_k // block_c)
    order = range(n_kv - 1, -1, -1) if reverse_kv else range(n_kv)
    for b in range(batch):
        for h in range(heads):
            for qb in range(-(-seqlen_q // block_r)):
                rows = slice(qb * block_r, min((qb + 1) * block_r, seqlen_q))
                qt = q[b, rows, h].float()
                m = torch.full((qt.shape[0],), -math.inf, device=q.device)
                l = torch.zeros(qt.shape[0], device=q.device)
                o = torch.zeros((qt.shape[0], d_head), device=q.device)
                for j in order:
                    cols = slice(j * block_c, min((j + 1) * block_c, seqlen_k))
                    s = (qt @ kx[b, cols, h].float().T) * scale_log2
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
