"""What the KV-cache GPU tests share: the random decode calls of their grids (one draw order,
so a grid's cases stay the same when another grid changes) and rotary tables."""

from __future__ import annotations

import random

import torch

SHAPES = [(8, 8), (8, 2), (32, 8), (6, 1), (4, 4)]  # (heads, kv_heads): MHA, GQA, MQA


def draw_call(rng: random.Random, d_heads: list[int]) -> dict:
    """One decode call: d_head, heads, seqlen_q, new rows, cache rows, page size, mask, softcap,
    rotary style, splits and each sequence's cache length."""
    d = rng.choice(d_heads)
    heads, kv_heads = rng.choice(SHAPES)
    seqlen_q = rng.choice([1, 1, 1, 2, 5, 17])
    s_new = rng.choice([0, 1, 1, seqlen_q])
    s_cache = rng.choice([37, 128, 300, 1000])
    page = rng.choice([None, None, 1, 16, 7, 64])
    mask = rng.choice(["none", "causal", "local", "none"])
    window = (rng.choice([0, 5, 50]), rng.choice([-1, 0, 3])) if mask == "local" else (-1, -1)
    softcap = rng.choice([0.0, 0.0, 0.0, 20.0])
    rotary = rng.choice([None, None, "interleaved", "neox", "half"])
    num_splits = rng.choice([0, 0, 1, 3])
    batch = rng.choice([1, 2, 3])
    room = s_cache - s_new
    seqlens = [rng.choice([0, room, rng.randrange(0, room + 1)]) for _ in range(batch)]
    return dict(d=d, heads=heads, kv_heads=kv_heads, seqlen_q=seqlen_q, s_new=s_new,
                s_cache=s_cache, page=page, causal=mask == "causal", window=window,
                softcap=softcap, rotary=rotary, num_splits=num_splits, seqlens=seqlens)


def angles(seqlen: int, rd: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables (seqlen, rd / 2) of the usual rotary frequencies, on the GPU."""
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2, device="cuda").float() / rd))
    t = torch.arange(seqlen, device="cuda").float()[:, None] * inv[None, :]
    return t.cos().to(dtype), t.sin().to(dtype)
