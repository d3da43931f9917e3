"""The CPU reference of flash_attn_with_kvcache (reference.kvcache_reference) and the rotary
embedding it applies (rotary.apply_rotary): the formulas of both rotary styles, the append at
each sequence's length, paged caches of any page size read and written through their block
table as the contiguous cache is, cache_batch_idx, and where q is rotated. These are what the
KV-cache kernels will be checked against (issue 44)."""

from __future__ import annotations

import math

import pytest
import torch

from flash_attention.reference import attention_reference, kvcache_reference
from flash_attention.rotary import apply_rotary


def _angles(seqlen: int, rd: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    t = torch.arange(seqlen).float()[:, None] * inv[None, :]
    return t.cos(), t.sin()


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_matches_its_formula(interleaved):
    torch.manual_seed(0)
    x = torch.randn(1, 1, 1, 8)
    cos, sin = _angles(10, 4)  # rotary_dim 4 of d 8: features 4..7 pass through
    out = apply_rotary(x, cos, sin, torch.tensor([[7]]), interleaved)[0, 0, 0]
    c, s, v = cos[7], sin[7], x[0, 0, 0]
    pairs = [(0, 1), (2, 3)] if interleaved else [(0, 2), (1, 3)]
    for i, (a, b) in enumerate(pairs):
        assert torch.allclose(out[a], v[a] * c[i] - v[b] * s[i], atol=1e-6)
        assert torch.allclose(out[b], v[a] * s[i] + v[b] * c[i], atol=1e-6)
    assert torch.equal(out[4:], v[4:])
    same = apply_rotary(x, cos, sin, torch.tensor([[0]]), interleaved)  # angle 0
    assert torch.allclose(same, x, atol=1e-6)
    assert torch.allclose(out.norm(), v.norm(), atol=1e-5)  # a rotation


def _case(batch=3, s_cache=40, s_new=2, seqlen_q=2, heads=4, kv_heads=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g)
    kc = torch.randn(batch, s_cache, kv_heads, d, generator=g)
    vc = torch.randn(batch, s_cache, kv_heads, d, generator=g)
    k = torch.randn(batch, s_new, kv_heads, d, generator=g) if s_new else None
    v = torch.randn(batch, s_new, kv_heads, d, generator=g) if s_new else None
    seqlens = torch.tensor([5, 0, 31][:batch], dtype=torch.int32)
    return q, kc, vc, k, v, seqlens


@pytest.mark.parametrize("causal", [False, True])
def test_append_then_attend_each_sequence(causal):
    q, kc, vc, k, v, seqlens = _case()
    before = kc.clone()
    r = kvcache_reference(q, kc, vc, k, v, cache_seqlens=seqlens, causal=causal)
    assert torch.equal(kc, before), "the inputs are untouched"
    for b, n in enumerate(seqlens.tolist()):
        assert torch.equal(r.k_cache[b, n:n + 2], k[b]) and torch.equal(r.v_cache[b, n:n + 2],
                                                                         v[b])
        assert torch.equal(r.k_cache[b, :n], kc[b, :n])
        assert torch.equal(r.k_cache[b, n + 2:], kc[b, n + 2:])
        keys = torch.cat((kc[b, :n], k[b]))[None]
        vals = torch.cat((vc[b, :n], v[b]))[None]
        out, lse = attention_reference(q[b:b + 1], keys, vals, causal=causal)
        assert torch.allclose(r.out[b:b + 1], out, atol=1e-6)
        assert torch.allclose(r.lse[b:b + 1], lse, atol=1e-6)
    # causal, bottom-right: the last query row sees every key, the first all but the last
    r1 = kvcache_reference(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)
    r0 = kvcache_reference(q, kc, vc, k, v, cache_seqlens=seqlens)
    assert torch.allclose(r1.out[:, -1], r0.out[:, -1], atol=1e-6)
    assert not torch.allclose(r1.out[:, 0], r0.out[:, 0], atol=1e-4)


def test_an_empty_sequence_without_new_keys_gives_zero():
    q, kc, vc, _, _, seqlens = _case(s_new=0)
    r = kvcache_reference(q, kc, vc, cache_seqlens=seqlens)
    assert torch.equal(r.out[1], torch.zeros_like(r.out[1]))  # cache_seqlens 0, nothing new
    assert torch.isinf(r.lse[1]).all() and (r.lse[1] < 0).all()
    assert torch.equal(r.k_cache, kc)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_a_paged_cache_reads_and_writes_as_the_contiguous_one(page_size):
    """The contiguous cache's rows scattered over shuffled pages of any size, with a block
    table per sequence: the same result, and after the append the same rows."""
    q, kc, vc, k, v, seqlens = _case(s_cache=48)
    pages_per_seq = -(-48 // page_size)
    perm = torch.randperm(3 * pages_per_seq, generator=torch.Generator().manual_seed(1))
    table = perm.reshape(3, pages_per_seq).to(torch.int32)

    def paged(cache):
        out = torch.zeros(3 * pages_per_seq, page_size, *cache.shape[2:])
        flat = torch.zeros(3, pages_per_seq * page_size, *cache.shape[2:])
        flat[:, :48] = cache
        out[table.flatten().long()] = flat.reshape(3 * pages_per_seq, page_size, *cache.shape[2:])
        return out

    contiguous = kvcache_reference(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)
    r = kvcache_reference(q, paged(kc), paged(vc), k, v, cache_seqlens=seqlens,
                          block_table=table, causal=True)
    assert torch.allclose(r.out, contiguous.out, atol=1e-6)
    assert torch.allclose(r.lse, contiguous.lse, atol=1e-6)
    assert torch.equal(r.k_cache, paged(contiguous.k_cache))
    assert torch.equal(r.v_cache, paged(contiguous.v_cache))


def test_cache_batch_idx_picks_each_sequences_cache_row():
    q, kc, vc, k, v, seqlens = _case()
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    r = kvcache_reference(q, kc, vc, k, v, cache_seqlens=seqlens, cache_batch_idx=idx)
    want = kvcache_reference(q, kc[idx.long()], vc[idx.long()], k, v, cache_seqlens=seqlens)
    assert torch.allclose(r.out, want.out, atol=1e-6)
    assert torch.equal(r.k_cache[idx.long()], want.k_cache)


@pytest.mark.parametrize("causal", [False, True])
def test_cache_leftpad_drops_each_sequences_first_rows(causal):
    """cache_leftpad: sequence b attends to its rows pad[b] up to its length, as a cache whose
    rows start there would (masks aligned to those keys); the append lands at cache_seqlens."""
    q, kc, vc, k, v, seqlens = _case()
    pad = torch.minimum(torch.tensor([3, 0, 5]), seqlens)
    r = kvcache_reference(q, kc, vc, k, v, cache_seqlens=seqlens, causal=causal,
                          cache_leftpad=pad)
    plain = kvcache_reference(q, kc, vc, k, v, cache_seqlens=seqlens, causal=causal)
    assert torch.equal(r.k_cache, plain.k_cache) and torch.equal(r.v_cache, plain.v_cache)
    for b, (n, p) in enumerate(zip(seqlens.tolist(), pad.tolist(), strict=True)):
        shifted = kvcache_reference(q[b:b + 1], kc[b:b + 1, p:], vc[b:b + 1, p:], k[b:b + 1],
                                    v[b:b + 1], cache_seqlens=n - p, causal=causal)
        assert torch.allclose(r.out[b:b + 1], shifted.out, atol=1e-6)
        assert torch.allclose(r.lse[b:b + 1], shifted.lse, atol=1e-6)
    assert not torch.allclose(r.out[0], plain.out[0], atol=1e-4)  # the pad dropped keys


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_positions_of_the_new_keys_and_of_q(interleaved):
    """New key i of sequence b rotates at cache_seqlens[b] + i. q rotates the same way when
    causal; otherwise every query row at cache_seqlens[b]: two equal query rows then give equal
    outputs without the mask and different ones with it."""
    q, kc, vc, k, v, seqlens = _case(seqlen_q=2, d=32)
    cos, sin = _angles(64, 16)
    r = kvcache_reference(q, kc, vc, k, v, cos, sin, seqlens, rotary_interleaved=interleaved)
    for b, n in enumerate(seqlens.tolist()):
        pos = torch.tensor([[n, n + 1]])
        assert torch.allclose(r.k_cache[b, n:n + 2],
                              apply_rotary(k[b:b + 1], cos, sin, pos, interleaved)[0], atol=1e-6)
    same_rows = q.clone()
    same_rows[:, 1] = same_rows[:, 0]
    plain = kvcache_reference(same_rows, kc, vc, k, v, cos, sin, seqlens,
                              rotary_interleaved=interleaved)
    assert torch.allclose(plain.out[:, 0], plain.out[:, 1], atol=1e-6)
    masked = kvcache_reference(same_rows, kc, vc, k, v, cos, sin, seqlens, causal=True,
                               rotary_interleaved=interleaved)
    assert not torch.allclose(masked.out[:, 0], masked.out[:, 1], atol=1e-4)
    assert math.isfinite(float(masked.lse.max()))
