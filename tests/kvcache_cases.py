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


ABS_FLOOR = 1e-5  # the rule's absolute floor: |out - ref| <= 2 |low - ref| + ABS_FLOOR


def random_pages(batch: int, s_cache: int, page: int, gen) -> tuple[torch.Tensor, int]:
    """A block table (batch, pages per sequence) int32 on the GPU over a pool 3 pages larger
    than the sequences need, the pages in a random order (gen), and the pool's page count."""
    per_seq = -(-s_cache // page)
    pages = batch * per_seq + 3
    table = torch.randperm(pages, generator=gen)[:batch * per_seq].view(batch, per_seq)
    return table.to(torch.int32).cuda(), pages


def paged_copy(cache: torch.Tensor, page: int, table: torch.Tensor, pages: int) -> torch.Tensor:
    """The contiguous cache (batch, S, Hk, D) as a pool of `pages` pages of `page` rows, sequence
    b's rows in pages table[b]; random values (random bytes for an FP8 cache, copied as bytes)
    in the pages no sequence owns."""
    batch, s, hk, d = cache.shape
    per_seq = table.shape[1]
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    if cache.element_size() == 1:
        pool = torch.randint(0, 120, (pages, page, hk, d), dtype=torch.uint8, device="cuda")
    else:
        pool = torch.randn(pages, page, hk, d, device="cuda").to(cache.dtype)
    padded = torch.zeros(batch, per_seq * page, hk, d, dtype=raw.dtype, device="cuda")
    padded[:, :s] = raw
    pool[table.long().flatten()] = padded.view(batch * per_seq, page, hk, d)
    return pool.view(cache.dtype)


def check_step(out: torch.Tensor, lse: torch.Tensor, ref, low, what: str) -> None:
    """A decode step's out and LSE against kvcache_reference's fp32 result (ref) by
    FlashAttention's rule (low: the same reference in q's dtype): finite, error at most twice
    low's plus ABS_FLOOR; -inf LSE exactly where the reference's, the rest within 2e-3."""
    assert torch.isfinite(out).all(), what
    err = (out.float() - ref.out.float()).abs().max().item()
    err_pt = (low.out.float() - ref.out.float()).abs().max().item()
    assert err <= 2 * err_pt + ABS_FLOOR, f"{what}: error {err:.3e} > 2 x {err_pt:.3e}"
    empty = torch.isinf(ref.lse)
    assert torch.equal(torch.isinf(lse), empty), what
    torch.testing.assert_close(lse[~empty], ref.lse[~empty].float(), atol=2e-3, rtol=1e-4,
                               msg=what)


def cache_copies(kc: torch.Tensor, vc: torch.Tensor, page: int | None, gen):
    """The caches a step runs on, (k, v, block table or None): copies of kc and vc, or with a
    page size their rows in a random pool of pages (random_pages, paged_copy)."""
    if not page:
        return kc.clone(), vc.clone(), None
    table, pages = random_pages(kc.shape[0], kc.shape[1], page, gen)
    return paged_copy(kc, page, table, pages), paged_copy(vc, page, table, pages), table
