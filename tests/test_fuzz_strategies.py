"""The fuzz tests' strategies and harness on CPU (no GPU, no extension): drawn cases are valid
(shapes, strides, divisibility, offsets, budgets), layouts address what they claim, every
feature the GPU fuzz tests are meant to reach is drawn, the harness passes a correct
implementation and fails wrong ones, and the expected NaN/inf masks of the non-finite tests
agree with the reference and with SDPA's math backend."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attention import interface
from flash_attention.reference import attention_reference

from .fuzz_strategies import (
    CPU_BUDGET,
    D_HEADS,
    GPU_BUDGET,
    MAX_WINDOW,
    OUT_KINDS,
    SLACK,
    FixedCase,
    Layout,
    Poison,
    VarlenCase,
    build_fixed,
    build_refused,
    build_varlen,
    expected_nonfinite,
    fixed_cases,
    kernel_addressable,
    layouts,
    poison_inputs,
    refused_out_cases,
    run_fixed_case,
    run_varlen_case,
    v_dont_care,
    varlen_cases,
)

CPU = settings(settings.get_profile("fa-fuzz-bounded"), max_examples=120)


def _valid_features(case) -> None:
    assert isinstance(case.causal, bool)
    assert all(-1 <= w <= MAX_WINDOW for w in case.window_size)
    assert case.softcap == 0.0 or 2.0 <= case.softcap <= 50.0
    assert case.softmax_scale is None or 0.05 <= case.softmax_scale <= 1.0


def _indices(t: torch.Tensor) -> torch.Tensor:
    """The storage index of every element of a view of a 1-D buffer."""
    base = torch.arange(t.untyped_storage().nbytes() // t.element_size())
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


# ---------------------------------------------------------------------------------------------
# Drawn cases are valid


@CPU
@given(case=fixed_cases())
def test_fixed_cases_are_valid(case):
    b, sq, sk, h, hk, d = (case.batch, case.seqlen_q, case.seqlen_k, case.heads,
                           case.kv_heads, case.d_head)
    assert d in D_HEADS and 1 <= b <= 3 and hk >= 1 and h % hk == 0
    assert 0 <= sq <= GPU_BUDGET.max_seqlen and 0 <= sk <= GPU_BUDGET.max_seqlen
    assert b * h * sq * sk <= GPU_BUDGET.max_scores
    assert b * h * sq * sk * d <= GPU_BUDGET.max_work
    assert b * h * max(sq, sk, 1) * d <= GPU_BUDGET.max_elems
    assert case.out in OUT_KINDS
    _valid_features(case)
    if case.source == "qkvpacked":
        assert sq == sk and h == hk
    if case.api in ("kvpacked", "qkvpacked"):
        assert case.source == case.api
    if case.api != "attention":
        assert case.out == "none"
    if case.out in ("alias_k", "alias_v"):
        assert (sq, h) == (sk, hk)
    t = build_fixed(case, "meta")
    assert t.q.shape == (b, sq, h, d) and t.k.shape == t.v.shape == (b, sk, hk, d)
    if case.source == "separate":
        for name, x in (("q", t.q), ("k", t.k), ("v", t.v)):
            layout = case.layout(name)
            assert x.stride() == layout.strides(tuple(x.shape))
            assert x.storage_offset() == layout.offset
            assert all(x.stride(dim) == 0 for dim in layout.expand)
    packed = t.qkv if t.qkv is not None else t.kv
    for x in (t.q, t.k, t.v, packed):
        if x is None or x.numel() == 0:
            continue
        last = x.storage_offset() + sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
        elems = x.untyped_storage().nbytes() // x.element_size()
        assert last + SLACK < elems, "a view reaches past its buffer's slack"
    assert all(t.q.stride(dim) != 0 or t.q.shape[dim] <= 1 for dim in range(4))


@CPU
@given(case=varlen_cases())
def test_varlen_cases_are_valid(case):
    n = len(case.lengths_q)
    assert 1 <= n <= 6 and len(case.lengths_k) == n
    assert min(case.lengths_q + case.lengths_k) >= 0
    scores = sum(a * b for a, b in zip(case.lengths_q, case.lengths_k))
    assert scores * case.heads <= GPU_BUDGET.max_scores
    assert scores * case.heads * case.d_head <= GPU_BUDGET.max_work
    assert case.max_seqlen_q >= max(case.lengths_q) and case.max_seqlen_k >= max(case.lengths_k)
    assert case.d_head in D_HEADS and case.heads % case.kv_heads == 0
    _valid_features(case)
    if case.source == "packed":
        assert case.lengths_q == case.lengths_k and case.heads == case.kv_heads
    q, k, v = build_varlen(case, "meta")
    assert q.shape == (sum(case.lengths_q), case.heads, case.d_head)
    assert k.shape == v.shape == (sum(case.lengths_k), case.kv_heads, case.d_head)


@settings(CPU, max_examples=200)
@given(ndim=st.sampled_from([3, 4, 5]), data=st.data())
def test_layouts_address_what_they_claim(ndim, data):
    """On small shapes, with the storage index of every element: in bounds, distinct unless
    expanded (then repeated along exactly the expanded dimensions), the storage offset and
    the last dimension's step as drawn."""
    expandable = tuple(range(ndim - 1))
    layout = data.draw(layouts(ndim, expandable))
    shape = (*(data.draw(st.integers(0, 4)) for _ in range(ndim - 1)),
             data.draw(st.sampled_from([8, 16, 24])))
    assert sorted(layout.order or range(ndim)) == list(range(ndim))
    assert len(layout.pads) in (0, ndim) and layout.step in (1, 2) and layout.offset >= 0
    view, buffer = layout.make_with_buffer(shape, torch.float32, "cpu", None, fill=0.0)
    assert view.shape == shape and view.storage_offset() == layout.offset
    assert view.stride() == layout.strides(shape)
    if view.numel() == 0:
        return
    idx = _indices(view)
    assert int(idx.max()) + SLACK < buffer.numel()
    repeated = [d for d in layout.expand if shape[d] > 1]
    if repeated:
        assert idx.unique().numel() < idx.numel()
        assert all(view.stride(d) == 0 for d in layout.expand)
    else:
        assert idx.unique().numel() == idx.numel(), "distinct indices share an element"
    assert view.stride(-1) == (layout.step if layout.order[-1:] in ((), (ndim - 1,))
                               else view.stride(-1))
    if layout == Layout(expand=layout.expand):
        assert view.is_contiguous() or repeated or view.numel() <= 1


@CPU
@given(case=refused_out_cases())
def test_refused_outs_really_share_memory(case):
    q, k, _, out, buffer = build_refused(case, "meta")
    assert q.shape == out.shape and k.shape[2] == case.kv_heads
    assert out.stride() == case.out_strides()
    last = sum((n - 1) * s for n, s in zip(out.shape, out.stride()))
    assert last < buffer.numel()
    # Two indices of the expanded or overlapping dimension suffice (the inner ones whole).
    corner = out[:2, :2]
    idx = torch.arange(last + 1).as_strided(corner.shape, corner.stride())
    assert idx.unique().numel() < idx.numel(), "this out's elements are all distinct"


# ---------------------------------------------------------------------------------------------
# Every feature is reached


def _assert_reaches(strategy, features: dict, examples: int = 3000) -> None:
    """Draws (without shrinking) until every feature has been seen in some example."""
    missing = set(features)

    def record(case) -> bool:
        missing.difference_update([f for f in list(missing) if features[f](case)])
        return not missing

    try:
        find(strategy, record, settings=settings(max_examples=examples, database=None,
                                                 derandomize=True, phases=[Phase.generate]))
    except NoSuchExample:
        pytest.fail(f"in {examples} examples the strategy never drew: {sorted(missing)}")


@functools.lru_cache(maxsize=4)
def _fixed_tensors(case: FixedCase):
    t = build_fixed(case, "meta")
    return t.q, t.k, t.v


FIXED_FEATURES = {
    "q not 16-byte aligned": lambda c: _fixed_tensors(c)[0].storage_offset() % 8 != 0,
    "a stride not a multiple of 8 elements": lambda c: any(
        x.size(d) > 1 and x.stride(d) % 8 for x in _fixed_tensors(c) for d in range(3)),
    "a non-contiguous last dimension": lambda c: _fixed_tensors(c)[1].stride(-1) != 1,
    "the last dimension not innermost": lambda c: any(
        x.stride(-1) > x.stride(1) > 0 for x in _fixed_tensors(c)),
    "bhsd storage seen as bshd": lambda c: c.source == "separate"
    and c.layout("q").order == (0, 2, 1, 3) and c.seqlen_q > 1 and c.heads > 1,
    "k expanded over the batch": lambda c: c.batch > 1 and _fixed_tensors(c)[1].stride(0) == 0,
    "v expanded over the heads": lambda c: c.kv_heads > 1 and _fixed_tensors(c)[2].stride(2) == 0,
    "all inputs addressable in place": lambda c: all(
        kernel_addressable(x) for x in _fixed_tensors(c)) and c.seqlen_q > 64,
    "MQA": lambda c: c.kv_heads == 1 and c.heads >= 4,
    "GQA": lambda c: c.heads // c.kv_heads == 3 and c.kv_heads > 1,
    "seqlen_q 0": lambda c: c.seqlen_q == 0,
    "seqlen_k 0 with queries": lambda c: c.seqlen_k == 0 and c.seqlen_q > 0,
    "seqlen_q 1": lambda c: c.seqlen_q == 1 and c.seqlen_k > 100,
    "seqlen_k at a block edge + 1": lambda c: c.seqlen_k in (65, 129, 193, 257),
    "long sequences": lambda c: c.seqlen_q > 1500 and c.seqlen_k > 1500,
    "d_head 256": lambda c: c.d_head == 256,
    "d_head between variants": lambda c: c.d_head in (40, 72, 104, 200),
    "window (0, 0)": lambda c: c.window_size == (0, 0),
    "one-sided window (-1, w)": lambda c: c.window_size[0] == -1 and c.window_size[1] >= 0,
    "one-sided window (w, -1)": lambda c: c.window_size[1] == -1 and c.window_size[0] >= 0,
    "window past the sequence": lambda c: c.window_size[0] > c.seqlen_k > 0,
    "causal with a window": lambda c: c.causal and c.window_size[0] >= 0,
    "softcap": lambda c: c.softcap > 0 and c.causal,
    "softmax_scale": lambda c: c.softmax_scale is not None,
    "out=q": lambda c: c.out == "alias_q",
    "out=k or out=v": lambda c: c.out in ("alias_k", "alias_v"),
    "out overlapping q, shifted": lambda c: c.out == "shifted_q",
    "out a misaligned strided view": lambda c: c.out == "strided" and c.out_layout.offset % 8,
    "qkvpacked": lambda c: c.api == "qkvpacked" and c.seqlen_q > 0,
    "kvpacked": lambda c: c.api == "kvpacked" and c.kv_heads < c.heads,
    "return_lse through the interface": lambda c: c.api == "func" and c.return_lse,
}


def test_fixed_strategy_reaches_every_feature():
    _assert_reaches(fixed_cases(), FIXED_FEATURES)


VARLEN_FEATURES = {
    "empty and one-token sequences": lambda c: 0 in c.lengths_q and 1 in c.lengths_q,
    "a sequence without keys": lambda c: any(nq and not nk
                                             for nq, nk in zip(c.lengths_q, c.lengths_k)),
    "packed qkv": lambda c: c.source == "packed" and sum(c.lengths_q) > 0,
    "loose max_seqlen": lambda c: c.max_seqlen_q > max(c.lengths_q),
    "a long sequence": lambda c: max(c.lengths_q) > 1500,
    "expanded k heads": lambda c: c.source == "separate" and c.kv_heads > 1
    and c.layout("k").expand == (1,),
    "unequal lengths": lambda c: c.lengths_q != c.lengths_k and len(c.lengths_q) > 2,
    "causal": lambda c: c.causal and c.api == "varlen_func",
}


def test_varlen_strategy_reaches_every_feature():
    _assert_reaches(varlen_cases(), VARLEN_FEATURES)


# ---------------------------------------------------------------------------------------------
# The harness, with a reference-backed fake of the operator


def _fake_attention(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0,
                    softmax_scale=None, return_lse=False, out=None, deterministic=False):
    o, lse = attention_reference(q.contiguous(), k.contiguous(), v.contiguous(), softmax_scale,
                                 causal=causal, window_size=window_size, softcap=softcap)
    o = o.to(q.dtype)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, lse) if return_lse else o


def _fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, window_size=(-1, -1),
                 softcap=0.0, softmax_scale=None, return_lse=False, deterministic=False,
                 attend_across=False):
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf)
    for b in range(cu_q.numel() - 1):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(None) if attend_across else slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.start == rows.stop:
            continue
        o, l = attention_reference(q[None, rows], k[None, keys], v[None, keys], softmax_scale,
                                   causal=causal, window_size=window_size, softcap=softcap)
        out[rows], lse[:, rows] = o[0].to(q.dtype), l[0]
    return (out, lse) if return_lse else out


@pytest.fixture
def fake_api(monkeypatch):
    """The API namespace of the GPU tests with the operator replaced by the reference (the
    flash_attn_* functions are the real ones, calling the fakes)."""
    def with_impl(attention=_fake_attention, varlen=_fake_varlen):
        monkeypatch.setattr(interface, "attention", attention)
        monkeypatch.setattr(interface, "attention_varlen", varlen)
        return SimpleNamespace(
            attention=attention, attention_varlen=varlen,
            flash_attn_func=interface.flash_attn_func,
            flash_attn_kvpacked_func=interface.flash_attn_kvpacked_func,
            flash_attn_qkvpacked_func=interface.flash_attn_qkvpacked_func,
            flash_attn_varlen_func=interface.flash_attn_varlen_func)
    return with_impl


@settings(CPU, max_examples=25)
@given(case=fixed_cases(CPU_BUDGET))
def test_harness_passes_a_correct_fixed_implementation(fake_api, case):
    run_fixed_case(case, fake_api(), "cpu")


@settings(CPU, max_examples=15)
@given(case=varlen_cases(CPU_BUDGET))
def test_harness_passes_a_correct_varlen_implementation(fake_api, case):
    run_varlen_case(case, fake_api(), "cpu")


def _case(**changes) -> FixedCase:
    base = {"seed": 1, "dtype": "bf16", "api": "attention", "source": "separate", "batch": 1,
            "seqlen_q": 40, "seqlen_k": 40, "heads": 2, "kv_heads": 1, "d_head": 16,
            "causal": True, "window_size": (-1, -1), "softcap": 0.0, "softmax_scale": None,
            "return_lse": True,
            "layouts": (("k", Layout()), ("q", Layout(pads=(0, 0, 0, 4), offset=3)),
                        ("v", Layout(expand=(2,)))),
            "out": "strided", "out_layout": Layout(pads=(0, 1, 0, 0), offset=5)}
    base.update(changes)
    return FixedCase(**base)


def _ignores_causal(q, k, v, **kw):
    return _fake_attention(q, k, v, **dict(kw, causal=False))


def _skips_last_row(q, k, v, **kw):
    result = _fake_attention(q, k, v, **kw)
    out = result[0] if kw.get("return_lse") else result
    out[:, -1] = math.nan
    return result


def _stores_past_out(q, k, v, **kw):
    result = _fake_attention(q, k, v, **kw)
    out = kw["out"]
    last = out.storage_offset() + sum((n - 1) * s for n, s in zip(out.shape, out.stride()))
    out.as_strided((1,), (1,), last + 1).fill_(0.0)
    return result


def _reads_k_after_writing_out(q, k, v, *, out=None, return_lse=False, **kw):
    """Writes the first rows of out before reading k for the rest (wrong when out is k)."""
    half = q.shape[1] // 2
    first, lse = _fake_attention(q, k, v, return_lse=True, **kw)
    out[:, :half] = first[:, :half]
    out[:, half:] = _fake_attention(q, k, v, **kw)[:, half:]
    return (out, lse) if return_lse else out


def _modifies_k(q, k, v, **kw):
    result = _fake_attention(q, k, v, **kw)
    k.mul_(2)
    return result


def _wrong_lse(q, k, v, **kw):
    out, lse = _fake_attention(q, k, v, **dict(kw, return_lse=True))
    return (out, lse + 0.01) if kw.get("return_lse") else out


WRONG = {
    "ignores causal": (_ignores_causal, {}),
    "leaves a row of out unwritten": (_skips_last_row, {"out": "fresh"}),
    "stores past a strided out": (_stores_past_out, {}),
    "reads k after writing out=k": (_reads_k_after_writing_out,
                                    {"out": "alias_k", "kv_heads": 2, "layouts": (
                                        ("k", Layout(offset=1)), ("q", Layout()),
                                        ("v", Layout()))}),
    "modifies k": (_modifies_k, {"out": "none"}),
    "a wrong LSE": (_wrong_lse, {}),
}


@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_harness_catches_a_wrong_fixed_implementation(fake_api, wrong):
    impl, changes = WRONG[wrong]
    case = _case(**changes)
    run_fixed_case(case, fake_api(), "cpu")  # the correct fake passes this case
    with pytest.raises(AssertionError):
        run_fixed_case(case, fake_api(attention=impl), "cpu")


def test_harness_catches_a_varlen_implementation_attending_across_sequences(fake_api):
    case = VarlenCase(
        seed=2, dtype="fp16", api="varlen_func", source="separate", lengths_q=(5, 0, 1, 30),
        lengths_k=(7, 3, 1, 30), heads=2, kv_heads=2, d_head=8, max_seqlen_q=30,
        max_seqlen_k=30, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None,
        return_lse=True, layouts=(("k", Layout()), ("q", Layout(offset=1)), ("v", Layout())))
    run_varlen_case(case, fake_api(), "cpu")

    def across(*args, **kw):
        return _fake_varlen(*args, attend_across=True, **kw)

    with pytest.raises(AssertionError):
        run_varlen_case(case, fake_api(varlen=across), "cpu")


# ---------------------------------------------------------------------------------------------
# The expected masks of the non-finite tests


def _sdpa_math(q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k.repeat_interleave(group, 2),
                                              v.repeat_interleave(group, 2)))
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return out.transpose(1, 2)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True])
def test_expected_nonfinite_masks(where, causal, value):
    """expected_nonfinite, the spec of test_nonfinite_input_like_sdpa, agrees with the fp32
    reference (masked keys excluded) everywhere the GPU test asserts, and with SDPA's math
    where the GPU test compares with it (no mask, or a poisoned q)."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 40, n, 16, dtype=torch.bfloat16) for n in (4, 2, 2))
    poison = Poison(where, value, b=1, row=20, head=3 if where == "q" else 1, c=5)
    poison_inputs(q, k, v, poison)
    nan, pos, neg = expected_nonfinite(q, k, poison, causal)
    care = ~v_dont_care(q, k, poison, causal)
    assert (nan | pos | neg).any()
    ref, _ = attention_reference(q, k, v, causal=causal)
    for got, want in ((ref.isnan(), nan), (ref == math.inf, pos), (ref == -math.inf, neg)):
        assert torch.equal(got[care], want[care])
    if not causal or where == "q":
        sdpa = _sdpa_math(q, k, v, causal)
        assert torch.equal(sdpa.isnan(), nan)
        assert torch.equal(sdpa == math.inf, pos) and torch.equal(sdpa == -math.inf, neg)
