"""The fp32 reference and the block-by-block emulation agree (CPU)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

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
