"""Varlen (packed) batches on the GPU: flash_attn_varlen_func against the reference per
sequence, lengths 0 and 1 included, masks aligned per sequence, and bad cu_seqlens refused
before any launch."""

from __future__ import annotations

import math

import pytest
import torch

import flash_attention as fa
from flash_attention.interface import flash_attn_varlen_func

from .gpu_support import check_against_reference

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def cu_seqlens(lengths):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device="cuda")


def packed(lengths_q, lengths_k, heads, kv_heads, d_head, dtype):
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, heads, d_head, device="cuda", dtype=dtype)
    k = torch.randn(tk, kv_heads, d_head, device="cuda", dtype=dtype)
    v = torch.randn(tk, kv_heads, d_head, device="cuda", dtype=dtype)
    return q, k, v, cu_seqlens(lengths_q), cu_seqlens(lengths_k)


def check_per_sequence(out, lse, q, k, v, lengths_q, lengths_k, what, **features):
    """Each sequence against the fixed-length reference of its own slices."""
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    q0 = k0 = 0
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        if nq:
            sl = slice(q0, q0 + nq)
            check_against_reference(out[None, sl], q[None, sl], k[None, k0:k0 + nk],
                                    v[None, k0:k0 + nk], lse=lse[None, :, sl],
                                    what=f"{what} sequence {b} ({nq} x {nk})", **features)
        q0, k0 = q0 + nq, k0 + nk


# (lengths_q, lengths_k): zero- and one-token sequences, tails, Sq != Sk per sequence.
LENGTHS = [
    ([5, 0, 1, 130, 64, 257], [5, 0, 1, 130, 64, 257]),
    ([1, 300, 77, 0, 128], [200, 300, 13, 9, 0]),
    ([1000, 3, 513], [1000, 700, 1]),
]
FEATURES = [{}, {"causal": True}, {"window_size": (32, 8)}, {"softcap": 3.0},
            {"causal": True, "window_size": (100, -1), "softcap": 2.0}]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d_head", [64, 96, 128, 256])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["equal", "unequal", "long"])
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: "-".join(f) or "plain")
def test_varlen_matches_reference_per_sequence(require_extension, dtype, d_head, lengths,
                                               features):
    torch.manual_seed(d_head + len(features))
    lq, lk = lengths
    q, k, v, cu_q, cu_k = packed(lq, lk, 4, 2, d_head, DTYPES[dtype])
    out, lse, none = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                            return_attn_probs=True, **features)
    assert none is None
    check_per_sequence(out, lse, q, k, v, lq, lk, f"varlen {dtype} d{d_head} {features}",
                       **features)
    again = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), **features)
    assert torch.equal(again, out), "a second run differs (race?)"


def test_varlen_sequence_without_keys_gives_zero_and_minus_inf(require_extension):
    q, k, v, cu_q, cu_k = packed([3, 4], [0, 5], 2, 2, 64, torch.bfloat16)
    out, lse = fa.attention_varlen(q, k, v, cu_q, cu_k, 4, 5, return_lse=True)
    assert torch.all(out[:3] == 0) and torch.all(lse[:, :3] == -math.inf)
    check_per_sequence(out, lse, q, k, v, [3, 4], [0, 5], "no keys")


def test_varlen_larger_max_seqlen_is_allowed(require_extension):
    """max_seqlen may exceed the longest sequence (the grid is larger, the result the same)."""
    q, k, v, cu_q, cu_k = packed([70, 9], [70, 9], 2, 2, 128, torch.float16)
    exact = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 70, causal=True)
    loose = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 500, 500, causal=True)
    assert torch.equal(exact, loose)


def bad_cu_seqlens_cases():
    ok = cu_seqlens([3, 4])
    return [
        (torch.tensor([0, 5, 4], dtype=torch.int32, device="cuda"), ValueError,
         "non-decreasing"),
        (torch.tensor([1, 3, 7], dtype=torch.int32, device="cuda"), ValueError, r"\[0\] must be 0"),
        (torch.tensor([0, 3, 6], dtype=torch.int32, device="cuda"), ValueError,
         "must equal the number of tokens, 7"),
        (ok.long(), TypeError, "must be int32"),
        (ok.cpu(), ValueError, "must be on cuda"),
        (ok[None], ValueError, "1-D"),
        (torch.tensor([0, 3, 5, 7], dtype=torch.int32, device="cuda")[::2], ValueError,
         "contiguous"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_bad_cu_seqlens_are_refused_before_any_launch(require_extension, case):
    cu, exc, message = bad_cu_seqlens_cases()[case]
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 64, torch.bfloat16)
    with pytest.raises(exc, match=message):
        flash_attn_varlen_func(q, k, v, cu, cu_k, 4, 4)
    with pytest.raises(exc, match=message):
        flash_attn_varlen_func(q, k, v, cu_q, cu, 4, 4)


def test_max_seqlen_below_a_sequence_is_refused(require_extension):
    q, k, v, cu_q, cu_k = packed([3, 40], [3, 40], 2, 2, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="longer than max_seqlen_q = 39"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 39, 40)
    with pytest.raises(ValueError, match="longer than max_seqlen_k = 16"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 16)


def test_modified_cu_seqlens_are_checked_again(require_extension):
    """The check of a cu_seqlens tensor is remembered only until the tensor is modified."""
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 64, torch.bfloat16)
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4)
    cu_q[1] = 5  # (0, 5, 7): sequence 0 is now 5 long, over max_seqlen_q
    with pytest.raises(ValueError, match="longer than max_seqlen_q"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4)


def test_varlen_in_a_cuda_graph(require_extension):
    lq = [100, 1, 0, 260]
    q, k, v, cu_q, cu_k = packed(lq, lq, 4, 4, 128, torch.bfloat16)
    eager = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 260, 260, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as torch recommends
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 260, 260, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 260, 260, causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    fresh = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 260, 260, causal=True)
    assert torch.equal(captured, fresh) and not torch.equal(captured, eager)
