"""The fp32 reference and the block-by-block emulation agree (CPU)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flash_attention.masks import visible
from flash_attention.reference import attention_reference, emulate_blocks


def rand(*shape, dtype=torch.bfloat16, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype)


@pytest.mark.parametrize(
    "batch, sq, sk, heads, kv_heads",
    [(1, 113, 203, 2, 2), (2, 1, 300, 3, 3), (1, 77, 1, 2, 1), (1, 130, 64, 4, 2)],
)
@pytest.mark.parametrize("block_r, block_c, reverse", [(64, 32, False), (128, 64, True)])
def test_emulation_matches_reference(batch, sq, sk, heads, kv_heads, block_r, block_c, reverse):
    gen = torch.Generator().manual_seed(sq * 1000 + sk)
    q = rand(batch, sq, heads, 64, gen=gen)
    k = rand(batch, sk, kv_heads, 64, gen=gen)
    v = rand(batch, sk, kv_heads, 64, gen=gen)
    ref, ref_lse = attention_reference(q, k, v)
    emu = emulate_blocks(q, k, v, block_r, block_c, reverse, round_p=False)
    torch.testing.assert_close(emu.out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(emu.lse, ref_lse, atol=2e-5, rtol=1e-5)
    # Rounding P to bf16 before P V (as the kernel does) stays within bf16 accuracy.
    rounded = emulate_blocks(q, k, v, block_r, block_c, reverse, round_p=True)
    assert (rounded.out - ref).abs().max() < 2e-2


def test_reference_lse_is_logsumexp_and_default_scale():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (rand(1, 5, 1, 128, dtype=torch.float32, gen=gen) for _ in range(3))
    out, lse = attention_reference(q, k, v)
    s = (q[0, :, 0] @ k[0, :, 0].T) / math.sqrt(128)
    torch.testing.assert_close(lse[0, 0], torch.logsumexp(s, -1))
    torch.testing.assert_close(out[0, :, 0], torch.softmax(s, -1) @ v[0, :, 0])


def test_low_precision_reference_differs_but_is_close():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (rand(1, 64, 2, 64, gen=gen) for _ in range(3))
    ref, _ = attention_reference(q, k, v)
    low, _ = attention_reference(q, k, v, upcast=False)
    assert low.dtype == torch.bfloat16
    err = (low.float() - ref).abs().max().item()
    assert 0 < err < 5e-2


def test_gqa_matches_repeated_heads():
    gen = torch.Generator().manual_seed(2)
    q = rand(1, 16, 4, 64, gen=gen)
    k, v = rand(1, 9, 2, 64, gen=gen), rand(1, 9, 2, 64, gen=gen)
    out, lse = attention_reference(q, k, v)
    full, full_lse = attention_reference(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)


def test_empty_keys_give_zero_and_minus_inf():
    q = rand(1, 3, 2, 64)
    k = v = rand(1, 0, 2, 64)
    out, lse = attention_reference(q, k, v)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    emu = emulate_blocks(q, k, v)
    assert torch.all(emu.out == 0) and torch.all(emu.lse == -math.inf)


def test_trace_records_each_block_step():
    q, k, v = rand(1, 70, 1, 64), rand(1, 100, 1, 64), rand(1, 100, 1, 64)
    emu = emulate_blocks(q, k, v, block_r=64, block_c=32, reverse_kv=True, trace=True)
    assert [(t.q_block, t.kv_block) for t in emu.trace] == [
        (qb, j) for qb in range(2) for j in (3, 2, 1, 0)
    ]
    # The running max never decreases and the final one is the row max of the scaled scores.
    first_rows = [t for t in emu.trace if t.q_block == 0]
    for a, b in itertools.pairwise(first_rows):
        assert torch.all(b.m >= a.m)


def naive(q, k, v, scale, seen, softcap=0.0):
    """Row by row in float64, from the definitions."""
    b_, sq, h_, d = q.shape
    out = torch.zeros(b_, sq, h_, d, dtype=torch.float64)
    lse = torch.full((b_, h_, sq), -math.inf, dtype=torch.float64)
    group = h_ // k.shape[2]
    for b in range(b_):
        for h in range(h_):
            for i in range(sq):
                keys = seen[i].nonzero().flatten()
                if len(keys) == 0:
                    continue
                s = (k[b, keys, h // group].double() @ q[b, i, h].double()) * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                lse[b, h, i] = torch.logsumexp(s, 0)
                out[b, i, h] = torch.softmax(s, 0) @ v[b, keys, h // group].double()
    return out, lse


@pytest.mark.parametrize("sq, sk", [(7, 7), (5, 11), (11, 5), (1, 9)])
@pytest.mark.parametrize("causal, window, softcap",
                         [(True, (-1, -1), 0.0), (False, (2, 1), 0.0), (True, (3, -1), 0.0),
                          (False, (-1, -1), 5.0), (True, (-1, -1), 2.0), (False, (0, 0), 0.0)])
def test_reference_masks_and_softcap_match_the_definition(sq, sk, causal, window, softcap):
    gen = torch.Generator().manual_seed(sq * 31 + sk)
    q, k, v = rand(2, sq, 4, 16, gen=gen), rand(2, sk, 2, 16, gen=gen), rand(2, sk, 2, 16, gen=gen)
    out, lse = attention_reference(q, k, v, 0.3, causal=causal, window_size=window,
                                   softcap=softcap)
    left, right = window
    if causal:
        right = 0
    want, want_lse = naive(q, k, v, 0.3, visible(sq, sk, left, right), softcap)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sq, sk", [(200, 200), (130, 300), (300, 130), (1, 257), (77, 64)])
@pytest.mark.parametrize("causal, window, softcap",
                         [(True, (-1, -1), 0.0), (False, (40, 7), 0.0), (True, (100, -1), 30.0),
                          (False, (-1, -1), 20.0), (False, (0, 200), 0.0)])
@pytest.mark.parametrize("block_r, block_c, reverse", [(64, 32, False), (128, 64, True)])
def test_emulation_with_masks_matches_reference(sq, sk, causal, window, softcap, block_r,
                                                block_c, reverse):
    """The emulation visits only masks.kv_blocks' blocks and masks only their edge blocks: if
    that skipped a visible key or left an invisible one unmasked, it would differ here."""
    gen = torch.Generator().manual_seed(sq + 7 * sk)
    q, k, v = rand(1, sq, 2, 32, gen=gen), rand(1, sk, 1, 32, gen=gen), rand(1, sk, 1, 32, gen=gen)
    opts = {"causal": causal, "window_size": window, "softcap": softcap}
    ref, ref_lse = attention_reference(q, k, v, **opts)
    emu = emulate_blocks(q, k, v, block_r, block_c, reverse, round_p=False, **opts)
    torch.testing.assert_close(emu.out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(emu.lse, ref_lse, atol=2e-5, rtol=1e-5)
