"""Helpers of the GPU tests: the accuracy rule (README.md, "Testing rule") and test inputs."""

from __future__ import annotations

import torch

from flash_attention.reference import attention_reference

ABS_FLOOR = 1e-5


def check_against_reference(out, q, k, v, softmax_scale=None, lse=None, what="", **features):
    """Pass when max|out - out_ref| <= 2 * max|out_pt - out_ref| + floor, where out_ref is the
    reference on fp32-upcast inputs and out_pt the same reference in the inputs' dtype, both
    with the call's features (causal, window_size, softcap). Also checks that every output
    element was written (no NaN left from the poison)."""
    assert torch.isfinite(out).all(), f"{what}: output has NaN/inf (unwritten or overflow)"
    out_ref, lse_ref = attention_reference(q, k, v, softmax_scale, **features)
    out_pt, _ = attention_reference(q, k, v, softmax_scale, upcast=False, **features)
    err = (out.float() - out_ref).abs().max().item()
    err_pt = (out_pt.float() - out_ref).abs().max().item()
    assert err <= 2 * err_pt + ABS_FLOOR, (
        f"{what}: max error {err:.3e} > 2 x low-precision reference error {err_pt:.3e}"
    )
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == lse_ref.shape
        empty = torch.isinf(lse_ref)  # rows that see no key: -inf exactly
        assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] < 0).all()), (
            f"{what}: LSE of rows without keys must be -inf (and only those)")
        torch.testing.assert_close(lse[~empty], lse_ref[~empty], atol=2e-3, rtol=1e-4,
                                   msg=f"{what}: LSE")
    return err, err_pt


def rand_inputs(batch, seqlen_q, seqlen_k, heads, kv_heads, d_head, dtype, layout="bshd"):
    """Random q, k, v on the GPU in one of several memory layouts (last dimension contiguous):
    bshd (contiguous), bhsd (transposed view), packed (slices of one qkv buffer)."""
    dev = "cuda"
    if layout == "bshd":
        q = torch.randn(batch, seqlen_q, heads, d_head, device=dev, dtype=dtype)
        k = torch.randn(batch, seqlen_k, kv_heads, d_head, device=dev, dtype=dtype)
        v = torch.randn(batch, seqlen_k, kv_heads, d_head, device=dev, dtype=dtype)
    elif layout == "bhsd":
        q = torch.randn(batch, heads, seqlen_q, d_head, device=dev, dtype=dtype).transpose(1, 2)
        k = torch.randn(batch, kv_heads, seqlen_k, d_head, device=dev, dtype=dtype).transpose(1, 2)
        v = torch.randn(batch, kv_heads, seqlen_k, d_head, device=dev, dtype=dtype).transpose(1, 2)
    elif layout == "packed":
        assert seqlen_q == seqlen_k and heads == kv_heads
        qkv = torch.randn(batch, seqlen_q, 3, heads, d_head, device=dev, dtype=dtype)
        q, k, v = qkv.unbind(2)
    else:
        raise ValueError(layout)
    return q, k, v


def poisoned_like(q):
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
