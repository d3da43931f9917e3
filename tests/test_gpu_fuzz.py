"""Property-based tests on the GPU (hypothesis): random shapes, features and memory layouts
against the fp32 reference, refused outs leaving the process healthy, the strided views of the
misaligned-address report as named regressions, and non-finite inputs against SDPA's math.

    pytest tests/test_gpu_fuzz.py --hypothesis-show-statistics          # bounded profile
    FA_FUZZ_PROFILE=long pytest tests/test_gpu_fuzz.py --hypothesis-show-statistics

The strategies and the harness are in fuzz_strategies.py (their invariants are checked on CPU
in test_fuzz_strategies.py). A failing example prints as a FixedCase / VarlenCase, which
rebuilds the same tensors from its seed: run_fixed_case(case, API, "cuda") reproduces it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attention as fa
from flash_attention import interface
from flash_attention.reference import attention_reference

from .fuzz_strategies import (
    Poison,
    assert_cuda_healthy,
    build_refused,
    contiguous_copy,
    cuda_guard,
    expected_nonfinite,
    fixed_cases,
    fuzz_settings,
    poison_inputs,
    refused_out_cases,
    run_fixed_case,
    run_varlen_case,
    v_dont_care,
    varlen_cases,
)
from .gpu_support import check_against_reference, poisoned_like

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

API = SimpleNamespace(
    attention=lambda *a, **kw: fa.attention(*a, **kw),
    attention_varlen=lambda *a, **kw: fa.attention_varlen(*a, **kw),
    flash_attn_func=interface.flash_attn_func,
    flash_attn_kvpacked_func=interface.flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func=interface.flash_attn_qkvpacked_func,
    flash_attn_varlen_func=interface.flash_attn_varlen_func,
)

# Examples per test in the bounded profile (x10 with FA_FUZZ_PROFILE=long): 600 + 200 + 40 =
# 840 in all (230 of them ran in 4 s on an H100), 8400 in the long profile.
FIXED_EXAMPLES, VARLEN_EXAMPLES, REFUSED_EXAMPLES = 600, 200, 40


@fuzz_settings(FIXED_EXAMPLES)
@given(case=fixed_cases())
def test_fuzz_fixed_length(require_extension, case):
    """fa.attention (out= of every kind: fresh, strided/misaligned views, q or k itself, q
    shifted by a few elements) and the flash_attn_* functions (separate, kv-packed and
    qkv-packed inputs) on any strides, against the fp32 reference."""
    with cuda_guard(lambda: repr(case)), torch.no_grad():
        run_fixed_case(case, API, "cuda")


@fuzz_settings(VARLEN_EXAMPLES)
@given(case=varlen_cases())
def test_fuzz_varlen(require_extension, case):
    """attention_varlen / flash_attn_varlen_func with empty and one-token sequences, loose
    max_seqlen, any strides: each sequence against the reference on it alone."""
    with cuda_guard(lambda: repr(case)), torch.no_grad():
        run_varlen_case(case, API, "cuda")


@fuzz_settings(REFUSED_EXAMPLES)
@given(case=refused_out_cases())
def test_fuzz_out_sharing_memory_is_refused(require_extension, case):
    """An out whose elements overlap (expanded, or a stride inside another dimension's span)
    is refused with ValueError, by the Python check and by the operator's own; out is left
    untouched, the process stays healthy, and the next call is correct."""
    with cuda_guard(lambda: repr(case)):
        q, k, v, out, buffer = build_refused(case, "cuda", sentinel=3.0)
        with pytest.raises(ValueError, match="share memory"):
            if case.via_op:
                torch.ops.flash_attention.fwd(q, k, v, out, None, "", 0.1, -1, -1, 0.0)
            else:
                fa.attention(q, k, v, out=out, causal=True)
        assert_cuda_healthy(repr(case))
        assert torch.all(buffer == 3.0), f"{case}: a refused call wrote to out"
        result = fa.attention(q, k, v, causal=True)
        check_against_reference(result, contiguous_copy(q), contiguous_copy(k),
                                contiguous_copy(v), what=f"after {case}", causal=True)


# ---------------------------------------------------------------------------------------------
# Named regressions: the views of the misaligned-address report (each crashed the process).


def _issue_views(view: str, dtype: torch.dtype):
    """(q, k, v, out): the reported views, with their strides and alignment asserted, and an
    out of the same kind (a poisoned view) for the out= call."""
    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    def nan_view(width, start, d):
        return torch.full((2, 513, 8, width), math.nan, device="cuda",
                          dtype=dtype)[..., start:start + d]

    if view == "b136":  # b[..., :128], b[..., 8:136], b[..., 4:132] of one (2,513,8,136)
        b = randn(2, 513, 8, 136)
        q, k, v = b[..., :128], b[..., 8:136], b[..., 4:132]
        assert q.stride() == (513 * 8 * 136, 8 * 136, 136, 1)
        assert (v.data_ptr() % 16, k.data_ptr() % 16) == (8, 0)
        out = nan_view(136, 4, 128)
    elif view == "rows132":  # head rows 132 elements apart: 264 bytes, not a 16-byte multiple
        q, k, v = (randn(2, 513, 8, 132)[..., :128] for _ in range(3))
        assert q.stride() == (513 * 1056, 1056, 132, 1)
        assert (q.stride(2) * q.element_size()) % 16 == 8
        assert (q.stride(1) * q.element_size()) % 16 == 0
        out = nan_view(132, 0, 128)
    elif view == "offset1":  # q = b[..., 1:129]: 2 bytes past a 16-byte boundary
        b = randn(2, 513, 8, 136)
        q, k, v = b[..., 1:129], b[..., 8:136], b[..., :128]
        assert q.storage_offset() == 1 and q.data_ptr() % 16 == 2
        out = nan_view(136, 1, 128)
    else:  # "d64_rows72": d_head 64 views of 72-wide rows
        b = randn(2, 513, 8, 72)
        q, k, v = b[..., :64], b[..., 8:72], b[..., 4:68]
        assert q.shape[-1] == 64 and q.stride() == (513 * 8 * 72, 8 * 72, 72, 1)
        assert v.data_ptr() % 16 == 8
        out = nan_view(72, 4, 64)
    assert out.data_ptr() % 16 != 0 or (out.stride(2) * out.element_size()) % 16 != 0
    return q, k, v, out


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("view", ["b136", "rows132", "offset1", "d64_rows72"])
def test_reported_misaligned_views(require_extension, view, causal, dtype):
    torch.manual_seed(26)
    q, k, v, out = _issue_views(view, DTYPES[dtype])
    refs = [x.contiguous() for x in (q, k, v)]
    result, lse = fa.attention(q, k, v, causal=causal, return_lse=True)
    assert_cuda_healthy(view)
    check_against_reference(result, *refs, lse=lse, what=f"{view} causal={causal}",
                            causal=causal)
    assert fa.attention(q, k, v, causal=causal, out=out) is out
    assert_cuda_healthy(f"{view} out=")
    check_against_reference(out, *refs, what=f"{view} out= causal={causal}", causal=causal)
    assert torch.equal(out, result), "out= and a fresh output differ"
    for x, ref in zip((q, k, v), refs):
        assert torch.equal(x, ref), "the call modified an input"


@pytest.mark.parametrize("target", ["q", "k", "qkv_slice"])
def test_out_overlapping_inputs_gets_the_result(require_extension, target):
    """out=q, out=k and out a slice of the packed qkv buffer (overlapping all three) get the
    attention of the inputs as they were before the call."""
    torch.manual_seed(27)
    qkv = torch.randn(2, 300, 3, 4, 136, device="cuda", dtype=torch.bfloat16)[..., 1:129]
    q, k, v = qkv.unbind(2)
    refs = [contiguous_copy(x) for x in (q, k, v)]
    out = {"q": q, "k": k, "qkv_slice": qkv.flatten(2, 3)[:, :, 2:6]}[target]  # q and k heads
    assert out.shape == q.shape and out.data_ptr() % 16 == 2
    assert out.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert fa.attention(q, k, v, out=out, causal=True) is out
    assert_cuda_healthy(target)
    check_against_reference(out, *refs, what=f"out={target}", causal=True)


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_expanded_out_is_refused(require_extension, dim):
    q = torch.randn(2, 70, 4, 64, device="cuda", dtype=torch.float16)
    shape = list(q.shape)
    shape[dim] = 1
    out = torch.full(shape, 5.0, device="cuda", dtype=q.dtype).expand(q.shape)
    with pytest.raises(ValueError, match="share memory"):
        fa.attention(q, q, q, out=out)
    with pytest.raises(ValueError, match="share memory"):
        torch.ops.flash_attention.fwd(q, q, q, out, None, "", 0.125, -1, -1, 0.0)
    assert_cuda_healthy(f"expanded out dim {dim}")
    assert torch.all(out == 5.0)


def test_expanded_kv_is_read_in_place(require_extension):
    """k/v expanded over the batch and the heads (stride 0) give the attention of the
    materialized tensors."""
    torch.manual_seed(28)
    q = torch.randn(3, 200, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 333, 1, 128, device="cuda", dtype=torch.bfloat16).expand(3, 333, 4, 128)
    v = torch.randn(3, 333, 1, 128, device="cuda", dtype=torch.bfloat16).expand(3, 333, 4, 128)
    assert k.stride(0) == 0 and k.stride(2) == 0 and v.stride(2) == 0
    out, lse = fa.attention(q, k, v, causal=True, return_lse=True)
    assert_cuda_healthy("expanded kv")
    check_against_reference(out, q, k.contiguous(), v.contiguous(), lse=lse,
                            what="expanded kv", causal=True)


# ---------------------------------------------------------------------------------------------
# Non-finite inputs, against SDPA's math backend

NONFINITE = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}
# (where, causal): every tensor without a mask; q and k with the causal mask.
NONFINITE_CASES = [("q", False), ("k", False), ("v", False), ("q", True), ("k", True),
                   ("v", True)]


def _sdpa_math(q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(group, 2),
                                              v.repeat_interleave(group, 2)))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("value", sorted(NONFINITE))
@pytest.mark.parametrize("where, causal", NONFINITE_CASES,
                         ids=[f"{w}-{'causal' if c else 'full'}" for w, c in NONFINITE_CASES])
def test_nonfinite_input_like_sdpa(require_extension, where, causal, value, dtype):
    """One NaN or +/-inf in q, k or v (batch 1, the middle of the sequence, GQA heads): the
    output's NaN and +/-inf elements are exactly those of expected_nonfinite (a NaN key
    poisons every row that sees it; an inf score gives inf - inf = NaN in the softmax; a NaN
    or inf value reaches column c of every row that weighs it), every other element is finite
    and passes the accuracy rule, and the LSE of unpoisoned rows matches the reference.

    Against SDPA's math backend the non-finite masks must be equal without a mask, and for a
    poisoned q also with the causal mask. With the causal mask and a poisoned k, SDPA's math
    adds -inf to masked scores (NaN + -inf = NaN, +inf + -inf = NaN), so it also poisons rows
    that do not see the key; the kernel, like the reference, excludes masked keys, which is
    what is asserted there. A poisoned v with the causal mask: column c of rows that do not
    see the key is not asserted (the kernel multiplies P = 0 by it when the key's block is
    loaded for other rows, 0 * NaN = NaN, as SDPA does for every row). The LSE of poisoned rows
    is not asserted."""
    torch.manual_seed(100 * NONFINITE_CASES.index((where, causal))
                      + 10 * sorted(NONFINITE).index(value) + sorted(DTYPES).index(dtype))
    batch, seqlen, heads, kv_heads, d_head = 2, 300, 4, 2, 64
    q, k, v = (torch.randn(batch, seqlen, n, d_head, device="cuda", dtype=DTYPES[dtype])
               for n in (heads, kv_heads, kv_heads))
    head = 3 if where == "q" else 1  # kv head 1: query heads 2 and 3
    poison = Poison(where, NONFINITE[value], b=1, row=150, head=head, c=5)
    poison_inputs(q, k, v, poison)
    out, lse = fa.attention(q, k, v, causal=causal, return_lse=True)
    assert_cuda_healthy("non-finite input")

    nan, pos, neg = expected_nonfinite(q, k, poison, causal)
    skip = v_dont_care(q, k, poison, causal)
    care = ~skip
    assert nan.any() or pos.any() or neg.any(), "the case poisons nothing (test is vacuous)"
    for name, got, want in (("NaN", out.isnan(), nan), ("+inf", out == math.inf, pos),
                            ("-inf", out == -math.inf, neg)):
        wrong = (got != want) & care
        assert not wrong.any(), (
            f"{name} mask differs at {wrong.sum().item()} elements, first "
            f"{wrong.nonzero()[0].tolist()}: got {got[wrong][0].item()}")
    if not causal or where == "q":
        sdpa = _sdpa_math(q, k, v, causal)
        assert torch.equal(out.isnan(), sdpa.isnan()), "NaN mask differs from SDPA math"
        assert torch.equal(out.isinf(), sdpa.isinf()), "inf mask differs from SDPA math"
        assert torch.equal(out[out.isinf()], sdpa[sdpa.isinf()]), "inf signs differ from SDPA"

    finite = care & ~nan & ~pos & ~neg
    assert finite.any()
    out_ref, lse_ref = attention_reference(q, k, v, causal=causal)
    out_pt, _ = attention_reference(q, k, v, causal=causal, upcast=False)
    err = (out.float() - out_ref)[finite].abs().max().item()
    err_pt = (out_pt.float() - out_ref)[finite].abs().max().item()
    assert err <= 2 * err_pt + 1e-5, f"finite elements: error {err:.3e} > 2 x {err_pt:.3e}"
    rows_ok = ~nan.any(-1) & ~pos.any(-1) & ~neg.any(-1)  # (B, Sq, H)
    if where == "v":  # the LSE does not depend on v
        rows_ok = torch.ones_like(rows_ok)
    rows_ok = rows_ok.transpose(1, 2)  # (B, H, Sq) like the LSE
    torch.testing.assert_close(lse[rows_ok], lse_ref[rows_ok], atol=2e-3, rtol=1e-4)


def test_nan_query_of_a_row_without_keys_gives_zero(require_extension):
    """Causal with seqlen_q > seqlen_k: rows 0..199 of 300 see no key; a NaN in one of them
    (and in a whole query block of them) changes nothing: out 0, LSE -inf; other rows correct."""
    torch.manual_seed(29)
    q = torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 100, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    q[0, 50, 1, 7] = math.nan
    q[0, 130:190, 0, :] = math.nan
    out, lse = fa.attention(q, k, v, out=poisoned_like(q), causal=True, return_lse=True)
    assert_cuda_healthy("NaN query without keys")
    assert torch.all(out[:, :200] == 0) and torch.all(lse[:, :, :200] == -math.inf)
    # Rows 200.. against keys 0..: the same diagonal as a 100 x 100 causal problem.
    check_against_reference(out[:, 200:], q[:, 200:], k, v, lse=lse[:, :, 200:],
                            what="rows with keys", causal=True)
