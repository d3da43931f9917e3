"""Hypothesis strategies and the checking harness of the property-based (fuzz) tests.

A drawn case is plain data (a frozen dataclass: shapes, features, memory layouts, a torch seed),
so that hypothesis can shrink it and print it; :func:`build_fixed` / :func:`build_varlen` turn
it into tensors on a device, and :func:`run_fixed_case` / :func:`run_varlen_case` call the
operator through an implementation namespace (the real API on a GPU, a reference-backed fake
in the CPU self-test of the harness) and check the result against the fp32 reference with the
rule of README.md ("Testing rule").

Memory layouts (:class:`Layout`) are views of one random buffer: the logical dimensions in any
storage order (bhsd seen as bshd, the last dimension not innermost), extra elements per
dimension (rows of 132 or 72 elements), every other element of the last dimension (a ::2
slice), any storage offset (b[..., 1:129]), and stride-0 (expanded) dimensions.

Settings profiles: ``fa-fuzz-bounded`` (the default: derandomized, so a run tests the same
examples every time) and ``fa-fuzz-long`` (FA_FUZZ_PROFILE=long: 10x the examples, new ones
every run).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

try:
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
except ImportError as exc:  # a plain error, not a skip: hypothesis is a test dependency
    raise ImportError(
        "the fuzz tests need hypothesis, a test dependency of this project: "
        "python -m pip install hypothesis"
    ) from exc

from flash_attention.masks import canonical_window, visible

from .gpu_support import check_against_reference

# ---------------------------------------------------------------------------------------------
# Settings profiles

_COMMON = {
    "deadline": None,
    "print_blob": True,
    # The GPU tests use the stateless require_extension fixture; examples are slow by design.
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                              HealthCheck.large_base_example,
                              HealthCheck.function_scoped_fixture],
}
settings.register_profile("fa-fuzz-bounded", derandomize=True, database=None, **_COMMON)
settings.register_profile("fa-fuzz-long", derandomize=False, **_COMMON)

PROFILES = {"bounded": ("fa-fuzz-bounded", 1), "long": ("fa-fuzz-long", 10)}
_PROFILE = os.environ.get("FA_FUZZ_PROFILE", "bounded")
if _PROFILE not in PROFILES:
    raise ValueError(f"FA_FUZZ_PROFILE={_PROFILE!r}: use one of {sorted(PROFILES)}")
PROFILE_NAME, _SCALE = PROFILES[_PROFILE]


def fuzz_settings(examples: int) -> settings:
    """The active profile with `examples` examples (x10 in the long profile)."""
    return settings(settings.get_profile(PROFILE_NAME), max_examples=examples * _SCALE)


# ---------------------------------------------------------------------------------------------
# Memory layouts

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SLACK = 64  # spare elements after every buffer: out may be q's view shifted by up to this
PADS = (0, 0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 24)


@dataclass(frozen=True)
class Layout:
    """Where the elements of a logical tensor lie in a buffer of random values.

    order: the logical dimensions from outermost to innermost in storage (() = natural);
    pads: extra elements of each logical dimension's extent (() = none); step 2: the last
    dimension takes every other element; offset: the view's storage offset in elements;
    expand: dimensions read with stride 0 (one slice of the buffer, seen size times)."""

    order: tuple[int, ...] = ()
    pads: tuple[int, ...] = ()
    step: int = 1
    offset: int = 0
    expand: tuple[int, ...] = ()

    def _extents(self, shape: tuple[int, ...]) -> list[int]:
        last = len(shape) - 1
        pads = self.pads or (0,) * len(shape)
        return [1 if d in self.expand
                else max(n, 1) * (self.step if d == last else 1) + pads[d]
                for d, n in enumerate(shape)]

    def strides(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        ext = self._extents(shape)
        last = len(shape) - 1
        strides = [0] * len(shape)
        running = 1
        for d in reversed(self.order or range(len(shape))):
            strides[d] = 0 if d in self.expand else running * (self.step if d == last else 1)
            running *= ext[d]
        return tuple(strides)

    def storage_elems(self, shape: tuple[int, ...]) -> int:
        return self.offset + math.prod(self._extents(shape)) + SLACK

    def view_of(self, buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return buffer.as_strided(shape, self.strides(shape), self.offset)

    def make_with_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: str,
                         gen: torch.Generator | None, fill: float | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(view, buffer): the view over a fresh 1-D buffer of randn values (or `fill`; on
        the meta device no values)."""
        n = self.storage_elems(shape)
        if device == "meta":
            buffer = torch.empty(n, dtype=dtype, device=device)
        elif fill is None:
            buffer = torch.randn(n, generator=gen, dtype=dtype, device=device)
        else:
            buffer = torch.full((n,), fill, dtype=dtype, device=device)
        return self.view_of(buffer, shape), buffer

    def make(self, shape: tuple[int, ...], dtype: torch.dtype, device: str,
             gen: torch.Generator | None, fill: float | None = None) -> torch.Tensor:
        return self.make_with_buffer(shape, dtype, device, gen, fill)[0]


def kernel_addressable(t: torch.Tensor) -> bool:
    """Whether the kernels could read t in place (16-byte aligned base, strides of dimensions
    of size > 1 multiples of 16 bytes, contiguous last dimension): used to describe coverage."""
    last = t.dim() - 1
    if t.size(last) > 1 and t.stride(last) != 1:
        return False
    if (t.storage_offset() * t.element_size()) % 16:
        return False
    return all(t.size(d) <= 1 or (t.stride(d) * t.element_size()) % 16 == 0
               for d in range(last))


@st.composite
def layouts(draw, ndim: int, expandable: tuple[int, ...] = ()) -> Layout:
    """Contiguous (shrinks to it), padded/offset views, permuted storage orders with the last
    dimension innermost (bhsd as bshd) or anywhere, ::2 last dimensions, stride-0 dimensions
    among `expandable`."""
    style = draw(st.sampled_from(["contiguous", "padded", "permuted", "any order"]))
    expand = tuple(d for d in expandable if draw(st.integers(0, 3)) == 0)
    if style == "contiguous":
        return Layout(expand=expand)
    order: tuple[int, ...] = ()
    if style == "permuted":  # often the sequence and heads swapped (bhsd seen as bshd)
        seq, heads = (0 if ndim == 3 else 1), ndim - 2  # (T, H, D) or (B, S, [2|3,] H, D)
        swapped = tuple(heads if d == seq else seq if d == heads else d for d in range(ndim))
        order = draw(st.one_of(st.just(swapped), st.permutations(range(ndim - 1)).map(
            lambda p: (*p, ndim - 1))))
    elif style == "any order":
        order = tuple(draw(st.permutations(range(ndim))))
    pads = tuple(draw(st.sampled_from(PADS)) for _ in range(ndim))
    step = draw(st.sampled_from([1, 1, 1, 2]))
    offset = draw(st.one_of(st.just(0), st.integers(1, 40)))
    return Layout(order, pads, step, offset, expand)


# ---------------------------------------------------------------------------------------------
# Shapes and features

D_HEADS = tuple(range(8, 257, 8))
# 0, 1, odd, and both sides of the block sizes (64, 128, 176, 192) the kernels tile by.
EDGE_SEQLENS = (0, 1, 2, 3, 7, 63, 64, 65, 127, 128, 129, 175, 176, 177, 191, 192, 193, 255,
                256, 257, 511, 512, 513)
# (seqlen_q, seqlen_k) that FlashAttention's tests single out: tails, Sq != Sk, one query.
CLASSIC_PAIRS = ((113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (1023, 1024),
                 (1024, 1023), (1, 300), (1, 2048), (300, 1), (2048, 2048), (64, 64), (1, 1))
MAX_WINDOW = 2**31 - 1


@dataclass(frozen=True)
class Budget:
    """Bounds on one example: max_scores bounds batch * heads * (sum of) seqlen_q * seqlen_k,
    max_work that times d_head, max_elems the elements of one input tensor."""

    max_seqlen: int = 2100
    max_scores: int = 2**23
    max_work: int = 2**30
    max_elems: int = 2**24
    max_batch: int = 3
    max_kv_heads: int = 4
    groups: tuple[int, ...] = (1, 2, 3, 4, 8)


GPU_BUDGET = Budget()
CPU_BUDGET = Budget(max_seqlen=80, max_scores=2**13, max_work=2**17, max_elems=2**14)


def seqlens(max_len: int) -> st.SearchStrategy[int]:
    """Block edges (shrinking to 0), short lengths, and now and then long ones."""
    edges = [n for n in EDGE_SEQLENS if n <= max_len]
    short = min(300, max_len)
    return st.one_of(st.sampled_from(edges), st.integers(0, short),
                     st.integers(short, max_len))


def window_side(n: int) -> st.SearchStrategy[int]:
    """-1 (unbounded), 0, small, any up to past the sequence, or far past it."""
    return st.one_of(st.just(-1), st.sampled_from([0, 1, 2]), st.integers(0, n + 2),
                     st.sampled_from([max(n - 1, 0), n, n + 1, 4096, MAX_WINDOW]))


@st.composite
def features(draw, seqlen_q: int, seqlen_k: int) -> dict:
    causal = draw(st.booleans())
    window = draw(st.one_of(st.just((-1, -1)),
                            st.tuples(window_side(seqlen_k), window_side(seqlen_q))))
    softcap = draw(st.one_of(st.just(0.0), st.floats(2.0, 50.0)))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 1.0)))
    return {"causal": causal, "window_size": window, "softcap": softcap,
            "softmax_scale": scale}


def _heads_cap(budget: Budget, scores_per_head: int, d_head: int, rows: int) -> int:
    """How many (batch x heads) the budget leaves for one head's scores and rows."""
    s = max(scores_per_head, 1)
    return max(1, min(budget.max_scores // s, budget.max_work // (s * d_head),
                      budget.max_elems // (max(rows, 1) * d_head)))


def _d_heads(budget: Budget, scores_per_head: int, rows: int) -> list[int]:
    s = max(scores_per_head, 1)
    return [d for d in D_HEADS
            if s * d <= budget.max_work and max(rows, 1) * d <= budget.max_elems]


# ---------------------------------------------------------------------------------------------
# Fixed-length cases

# How the inputs are made: separate tensors, k/v slices of one (B, Sk, 2, Hk, D) buffer, or
# q/k/v slices of one (B, S, 3, H, D) buffer.
SOURCES = ("separate", "kvpacked", "qkvpacked")
# Which function is called: fa.attention (with out=), flash_attn_func, and the packed ones.
FIXED_APIS = ("attention", "func", "kvpacked", "qkvpacked")
# out= of fa.attention: none, a fresh poisoned tensor, a poisoned strided view of a bigger
# buffer, q / k / v itself, or q's view shifted by a few elements (overlapping q).
OUT_KINDS = ("none", "fresh", "strided", "alias_q", "alias_k", "alias_v", "shifted_q")


@dataclass(frozen=True)
class FixedCase:
    seed: int
    dtype: str
    api: str
    source: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    d_head: int
    causal: bool
    window_size: tuple[int, int]
    softcap: float
    softmax_scale: float | None
    return_lse: bool
    layouts: tuple[tuple[str, Layout], ...]
    out: str = "none"
    out_layout: Layout = field(default_factory=Layout)
    out_shift: int = 1

    @property
    def features(self) -> dict:
        return {"causal": self.causal, "window_size": self.window_size, "softcap": self.softcap}

    def layout(self, name: str) -> Layout:
        return dict(self.layouts)[name]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        b, sq, sk, h, hk, d = (self.batch, self.seqlen_q, self.seqlen_k, self.heads,
                               self.kv_heads, self.d_head)
        return {"q": (b, sq, h, d), "k": (b, sk, hk, d), "v": (b, sk, hk, d),
                "kv": (b, sk, 2, hk, d), "qkv": (b, sq, 3, h, d)}


@st.composite
def fixed_cases(draw, budget: Budget = GPU_BUDGET) -> FixedCase:
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    api = draw(st.sampled_from(FIXED_APIS))
    source = {"kvpacked": "kvpacked", "qkvpacked": "qkvpacked"}.get(api) or draw(
        st.sampled_from(SOURCES))
    # q's shape = k's (qkv packed; and often for fa.attention, where out may then be k or v)
    square = source == "qkvpacked" or (api == "attention" and draw(st.integers(0, 3)) == 0)
    pairs = [p for p in CLASSIC_PAIRS if max(p) <= budget.max_seqlen
             and (not square or p[0] == p[1])]
    if pairs and draw(st.integers(0, 4)) == 0:
        sq, sk = draw(st.sampled_from(pairs))
    else:
        sq = draw(seqlens(budget.max_seqlen))
        same = square or draw(st.integers(0, 3)) == 0
        sk = sq if same else draw(seqlens(budget.max_seqlen))
    rows = max(sq, sk)
    d_head = draw(st.sampled_from(_d_heads(budget, sq * sk, rows)))
    cap = _heads_cap(budget, sq * sk, d_head, rows)
    kv_heads = draw(st.integers(1, min(budget.max_kv_heads, cap)))
    group = 1 if square else draw(
        st.sampled_from([g for g in budget.groups if kv_heads * g <= cap]))
    heads = kv_heads * group
    batch = draw(st.integers(1, max(1, min(budget.max_batch, cap // heads))))
    feats = draw(features(sq, sk))
    return_lse = draw(st.booleans())
    if source == "separate":
        named = {"q": draw(layouts(4)), "k": draw(layouts(4, (0, 2))),
                 "v": draw(layouts(4, (0, 2)))}
    elif source == "kvpacked":
        named = {"q": draw(layouts(4)), "kv": draw(layouts(5, (0, 2, 3)))}
    else:
        named = {"qkv": draw(layouts(5))}
    out, out_layout, out_shift = "none", Layout(), 1
    if api == "attention":
        kinds = ["none", "fresh", "strided", "strided", "alias_q", "shifted_q"]
        if sq == sk and heads == kv_heads:  # out=k / out=v where k / v is not expanded
            kinds += [f"alias_{name}" for name in ("k", "v")
                      if not _expanded(source, named, name)]
        out = draw(st.sampled_from(kinds))
        out_layout = draw(layouts(4))
        out_shift = draw(st.integers(1, SLACK))
    return FixedCase(seed, dtype, api, source, batch, sq, sk, heads, kv_heads, d_head,
                     feats["causal"], feats["window_size"], feats["softcap"],
                     feats["softmax_scale"], return_lse, tuple(sorted(named.items())), out,
                     out_layout, out_shift)


def _expanded(source: str, named: dict[str, Layout], name: str) -> bool:
    """Whether input `name` ("k" or "v") has a stride-0 dimension."""
    if source == "separate":
        return bool(named[name].expand)
    if source == "kvpacked":  # kv (B, Sk, 2, Hk, D): dim 2 stride 0 makes k and v one tensor
        return any(d in named["kv"].expand for d in (0, 1, 3, 4))
    return False


def generator(device: str, seed: int) -> torch.Generator | None:
    if device == "meta":
        return None
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class FixedInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv: torch.Tensor | None = None
    qkv: torch.Tensor | None = None


def build_fixed(case: FixedCase, device: str) -> FixedInputs:
    gen = generator(device, case.seed)
    dtype = DTYPES[case.dtype]
    shapes = case.shapes()

    def make(name: str) -> torch.Tensor:
        return case.layout(name).make(shapes[name], dtype, device, gen)

    if case.source == "separate":
        return FixedInputs(make("q"), make("k"), make("v"))
    if case.source == "kvpacked":
        q, kv = make("q"), make("kv")
        k, v = kv.unbind(2)
        return FixedInputs(q, k, v, kv=kv)
    qkv = make("qkv")
    q, k, v = qkv.unbind(2)
    return FixedInputs(q, k, v, qkv=qkv)


def make_out(case: FixedCase, t: FixedInputs, device: str
             ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(out, buffer): the out= argument and, for a poisoned strided view, its whole buffer."""
    dtype = DTYPES[case.dtype]
    if case.out == "none":
        return None, None
    if case.out == "fresh":
        return torch.full(t.q.shape, math.nan, dtype=dtype, device=device), None
    if case.out == "strided":
        return case.out_layout.make_with_buffer(tuple(t.q.shape), dtype, device, None,
                                                fill=math.nan)
    if case.out == "shifted_q":
        return t.q.as_strided(t.q.shape, t.q.stride(),
                              t.q.storage_offset() + case.out_shift), None
    return {"alias_q": t.q, "alias_k": t.k, "alias_v": t.v}[case.out], None


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def contiguous_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with t's values (never t itself: out= may overwrite t)."""
    return t.clone(memory_format=torch.contiguous_format)


def _unpack(result, with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, lse) of an attention call or of a flash_attn_* call (out, lse, None)."""
    return (result[0], result[1]) if with_lse else (result, None)


def run_fixed_case(case: FixedCase, impl, device: str) -> None:
    """Calls impl (attention / flash_attn_* functions) on the case's inputs and checks: the
    result against the fp32 reference of the inputs' values (made contiguous before the call)
    with the LSE if returned, out= returned as given and poisoned elements all written, no
    store outside a strided out, and inputs that do not share memory with out unchanged."""
    t = build_fixed(case, device)
    ref_q, ref_k, ref_v = (contiguous_copy(x) for x in (t.q, t.k, t.v))
    out_arg, out_buffer = make_out(case, t, device)
    opts = dict(case.features, softmax_scale=case.softmax_scale)
    interface = case.api != "attention"
    if case.api == "attention":
        result = impl.attention(t.q, t.k, t.v, return_lse=case.return_lse, out=out_arg, **opts)
    elif case.api == "func":
        result = impl.flash_attn_func(t.q, t.k, t.v, return_attn_probs=case.return_lse, **opts)
    elif case.api == "kvpacked":
        result = impl.flash_attn_kvpacked_func(t.q, t.kv, return_attn_probs=case.return_lse,
                                               **opts)
    else:
        result = impl.flash_attn_qkvpacked_func(t.qkv, return_attn_probs=case.return_lse,
                                                **opts)
    out, lse = _unpack(result, case.return_lse)
    if interface and case.return_lse:
        assert result[2] is None
    what = repr(case)
    assert out.shape == ref_q.shape and out.dtype == ref_q.dtype, what
    if out_arg is not None:
        assert out is out_arg, f"{what}: out= is not what was returned"
    if lse is not None:
        assert lse.shape == (case.batch, case.heads, case.seqlen_q), what
    if out.numel():
        check_against_reference(out, ref_q, ref_k, ref_v, case.softmax_scale, lse=lse,
                                what=what, **case.features)
    if out_buffer is not None:
        written = int((~torch.isnan(out_buffer)).sum())
        assert written == out.numel(), (
            f"{what}: {written} elements of out's buffer changed, out has {out.numel()}")
    for name, x, ref in (("q", t.q, ref_q), ("k", t.k, ref_k), ("v", t.v, ref_v)):
        if out_arg is None or not _shares_storage(x, out_arg):
            assert torch.equal(x, ref), f"{what}: the call modified {name}"


# ---------------------------------------------------------------------------------------------
# Varlen cases

VARLEN_APIS = ("attention_varlen", "varlen_func")


@dataclass(frozen=True)
class VarlenCase:
    seed: int
    dtype: str
    api: str
    source: str  # "separate" | "packed" (q/k/v slices of one (T, 3, H, D) buffer)
    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    heads: int
    kv_heads: int
    d_head: int
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    window_size: tuple[int, int]
    softcap: float
    softmax_scale: float | None
    return_lse: bool
    layouts: tuple[tuple[str, Layout], ...]

    @property
    def features(self) -> dict:
        return {"causal": self.causal, "window_size": self.window_size, "softcap": self.softcap}

    def layout(self, name: str) -> Layout:
        return dict(self.layouts)[name]


@st.composite
def varlen_cases(draw, budget: Budget = GPU_BUDGET) -> VarlenCase:
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    api = draw(st.sampled_from(VARLEN_APIS))
    source = draw(st.sampled_from(["separate", "packed"]))
    same = source == "packed" or draw(st.booleans())
    n = draw(st.integers(1, 6))
    short = st.sampled_from([0, 1])  # empty and one-token sequences, often
    left = budget.max_scores
    lengths_q: list[int] = []
    lengths_k: list[int] = []
    for _ in range(n):
        if same:
            nq = draw(st.one_of(short, seqlens(min(budget.max_seqlen, math.isqrt(left)))))
            nk = nq
        else:
            nq = draw(st.one_of(short, seqlens(min(budget.max_seqlen, left))))
            nk = draw(st.one_of(short, seqlens(min(budget.max_seqlen, left // max(nq, 1)))))
        left -= nq * nk
        lengths_q.append(nq)
        lengths_k.append(nk)
    scores = sum(a * b for a, b in zip(lengths_q, lengths_k))
    rows = max(sum(lengths_q), sum(lengths_k))
    d_head = draw(st.sampled_from(_d_heads(budget, scores, rows)))
    cap = min(_heads_cap(budget, scores, d_head, rows),
              budget.max_kv_heads * max(budget.groups))
    kv_heads = draw(st.integers(1, min(budget.max_kv_heads, cap)))
    group = 1 if source == "packed" else draw(
        st.sampled_from([g for g in budget.groups if kv_heads * g <= cap]))
    extra = st.sampled_from([0, 0, 0, 1, 37])  # max_seqlen may exceed the longest sequence
    max_q = max(lengths_q) + draw(extra)
    max_k = max(lengths_k) + draw(extra)
    feats = draw(features(max(lengths_q), max(lengths_k)))
    if source == "separate":
        named = {"q": draw(layouts(3)), "k": draw(layouts(3, (1,))),
                 "v": draw(layouts(3, (1,)))}
    else:
        named = {"qkv": draw(layouts(4))}
    return VarlenCase(seed, dtype, api, source, tuple(lengths_q), tuple(lengths_k),
                      kv_heads * group, kv_heads, d_head, max_q, max_k, feats["causal"],
                      feats["window_size"], feats["softcap"], feats["softmax_scale"],
                      draw(st.booleans()), tuple(sorted(named.items())))


def cu_seqlens(lengths: tuple[int, ...], device: str) -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def build_varlen(case: VarlenCase, device: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = generator(device, case.seed)
    dtype = DTYPES[case.dtype]
    tq, tk = sum(case.lengths_q), sum(case.lengths_k)
    if case.source == "packed":
        qkv = case.layout("qkv").make((tq, 3, case.heads, case.d_head), dtype, device, gen)
        return qkv.unbind(1)
    return (case.layout("q").make((tq, case.heads, case.d_head), dtype, device, gen),
            case.layout("k").make((tk, case.kv_heads, case.d_head), dtype, device, gen),
            case.layout("v").make((tk, case.kv_heads, case.d_head), dtype, device, gen))


def run_varlen_case(case: VarlenCase, impl, device: str) -> None:
    """Each sequence against the fixed-length reference on that sequence alone (inputs made
    contiguous before the call), with its LSE if returned; inputs unchanged."""
    q, k, v = build_varlen(case, device)
    ref_q, ref_k, ref_v = (contiguous_copy(x) for x in (q, k, v))
    cu_q, cu_k = cu_seqlens(case.lengths_q, device), cu_seqlens(case.lengths_k, device)
    opts = dict(case.features, softmax_scale=case.softmax_scale)
    if case.api == "attention_varlen":
        result = impl.attention_varlen(q, k, v, cu_q, cu_k, case.max_seqlen_q,
                                       case.max_seqlen_k, return_lse=case.return_lse, **opts)
        out, lse = result if case.return_lse else (result, None)
    else:
        result = impl.flash_attn_varlen_func(q, k, v, cu_q, cu_k, case.max_seqlen_q,
                                             case.max_seqlen_k,
                                             return_attn_probs=case.return_lse, **opts)
        if case.return_lse:
            out, lse, probs = result
            assert probs is None
        else:
            out, lse = result, None
    what = repr(case)
    assert out.shape == ref_q.shape and out.dtype == ref_q.dtype, what
    if lse is not None:
        assert lse.shape == (case.heads, ref_q.shape[0]), what
    q0 = k0 = 0
    for b, (nq, nk) in enumerate(zip(case.lengths_q, case.lengths_k)):
        rows, keys = slice(q0, q0 + nq), slice(k0, k0 + nk)
        if nq:
            check_against_reference(
                out[None, rows], ref_q[None, rows], ref_k[None, keys], ref_v[None, keys],
                case.softmax_scale, lse=None if lse is None else lse[None, :, rows],
                what=f"{what}: sequence {b} ({nq} x {nk})", **case.features)
        q0, k0 = q0 + nq, k0 + nk
    for name, x, ref in (("q", q, ref_q), ("k", k, ref_k), ("v", v, ref_v)):
        assert torch.equal(x, ref), f"{what}: the call modified {name}"


# ---------------------------------------------------------------------------------------------
# Refused outs

@dataclass(frozen=True)
class RefusedOutCase:
    """An out whose elements share memory: expanded dims (stride 0) or, with overlap_dim, one
    dimension whose stride is smaller than the span of the dimensions inside it."""

    seed: int
    dtype: str
    shape: tuple[int, int, int, int]
    kv_heads: int
    input_layouts: tuple[tuple[str, Layout], ...]
    expand: tuple[int, ...]
    overlap_dim: int  # -1: none
    overlap_stride: int
    via_op: bool  # torch.ops.flash_attention.fwd directly (the C++ check) or fa.attention

    def out_strides(self) -> tuple[int, ...]:
        strides = list(Layout(expand=self.expand).strides(self.shape))
        if self.overlap_dim >= 0:
            strides[self.overlap_dim] = self.overlap_stride
        return tuple(strides)


@st.composite
def refused_out_cases(draw) -> RefusedOutCase:
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    b = draw(st.integers(1, 3))
    s = draw(st.one_of(st.sampled_from([1, 2, 64, 65]), st.integers(1, 300)))
    kv_heads = draw(st.integers(1, 3))
    h = kv_heads * draw(st.sampled_from([1, 2, 4]))
    d = draw(st.sampled_from(D_HEADS))
    shape = (b, s, h, d)
    big = [i for i, n in enumerate(shape) if n > 1]  # d >= 8: never empty
    overlapping = draw(st.booleans()) and any(i in big for i in (1, 2))
    if overlapping:
        dim = draw(st.sampled_from([i for i in (1, 2) if i in big]))
        inner = math.prod(shape[dim + 1:])  # the span of the dims inside `dim`
        expand: tuple[int, ...] = ()
        stride = draw(st.integers(1, inner - 1))
    else:
        dim, stride = -1, 0
        expand = tuple(draw(st.lists(st.sampled_from(big), min_size=1, unique=True)))
    named = {"q": draw(layouts(4)), "k": draw(layouts(4, (0, 2))), "v": draw(layouts(4, (0, 2)))}
    return RefusedOutCase(seed, dtype, shape, kv_heads, tuple(sorted(named.items())), expand,
                          dim, stride, draw(st.booleans()))


def build_refused(case: RefusedOutCase, device: str, sentinel: float = 3.0):
    """q, k, v, the refused out (over a buffer filled with `sentinel`) and that buffer."""
    gen = generator(device, case.seed)
    dtype = DTYPES[case.dtype]
    b, s, h, d = case.shape
    named = dict(case.input_layouts)
    q = named["q"].make((b, s, h, d), dtype, device, gen)
    k = named["k"].make((b, s, case.kv_heads, d), dtype, device, gen)
    v = named["v"].make((b, s, case.kv_heads, d), dtype, device, gen)
    strides = case.out_strides()
    span = sum((n - 1) * st_ for n, st_ in zip(case.shape, strides)) + 1
    buffer = torch.full((span,), sentinel, dtype=dtype, device=device)
    return q, k, v, buffer.as_strided(case.shape, strides), buffer


# ---------------------------------------------------------------------------------------------
# The GPU process

_CONTEXT_LOST: list[str] = []


def is_cuda_fault(exc: BaseException) -> bool:
    accel = getattr(torch, "AcceleratorError", ())
    return isinstance(exc, accel) or "CUDA error" in str(exc)


def assert_cuda_healthy(what: str = "") -> None:
    """A CUDA operation still runs: the process's context survived."""
    torch.cuda.synchronize()
    assert torch.ones(1, device="cuda").sum().item() == 1.0, f"{what}: CUDA op gave a wrong sum"


@contextmanager
def cuda_guard(what: Callable[[], str]) -> Iterator[None]:
    """Runs one example and synchronizes after it. A CUDA fault (misaligned address, illegal
    access) is sticky, so every later example would fail with it and hypothesis would shrink
    to an innocent one: the first faulting example is printed at once, and every later one
    fails naming it."""
    if _CONTEXT_LOST:
        raise AssertionError(f"the CUDA context was lost earlier, first by: {_CONTEXT_LOST[0]}")
    try:
        yield
        torch.cuda.synchronize()
    except Exception as exc:
        if is_cuda_fault(exc):
            _CONTEXT_LOST.append(what())
            print(f"\nCUDA FAULT, first by: {_CONTEXT_LOST[0]}\n{exc}", file=sys.stderr,
                  flush=True)
        raise


# ---------------------------------------------------------------------------------------------
# Non-finite inputs: what each output element must be


@dataclass(frozen=True)
class Poison:
    """One non-finite element: tensor `where` ("q" / "k" / "v"), batch b, row (query row for
    q, key for k / v), head (kv head for k / v), column c."""

    where: str
    value: float
    b: int
    row: int
    head: int
    c: int


def expected_nonfinite(q: torch.Tensor, k: torch.Tensor, poison: Poison, causal: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nan, posinf, neginf) masks of the output (B, Sq, H, D) by the arithmetic of attention
    with masked keys excluded (not merely given -inf added):

    - q[b, i, h, c] NaN: every score of row i is NaN, so row (b, i, h) is NaN if it sees a key.
      +/-Inf: score_ij = q_ic * k_jc is +/-inf by the sign of k_jc; if some visible key gives
      +inf (or NaN), softmax has inf - inf: the row is NaN.
    - k[b, j, hk, c] NaN: every row of the query heads of kv head hk that sees key j is NaN.
      +/-Inf: such a row whose q_ic gives +inf (or NaN for q_ic == 0) is NaN; where it gives
      -inf, key j just gets weight 0 and the row stays finite (if it sees another key).
    - v[b, j, hk, c] NaN: column c of every row that sees j (weight > 0) is NaN; +/-Inf makes
      it +/-inf. Rows that do not see j are finite in exact arithmetic; the kernel's P = 0 times
      a non-finite v of a loaded but masked key is NaN, as in SDPA's math (0 @ NaN), so the
      tests leave column c of those rows out (see v_dont_care).
    q, k: the inputs as the call gets them (poisoned, see poison_inputs); batch and heads as
    the call's, GQA groups included."""
    _, seqlen_q, heads, d_head = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    left, right = canonical_window(causal, (-1, -1), seqlen_q, seqlen_k)
    seen = visible(seqlen_q, seqlen_k, left, right, q.device)  # (Sq, Sk)
    nan = torch.zeros(q.shape, dtype=torch.bool, device=q.device)
    pos, neg = torch.zeros_like(nan), torch.zeros_like(nan)
    p = poison
    if p.where == "q":
        hk = p.head // group
        if math.isnan(p.value):
            row_nan = bool(seen[p.row].any())
        else:
            signs = k[p.b, :, hk, p.c].float() * p.value  # the sign of each score
            row_nan = bool((seen[p.row] & ~(signs < 0)).any())
        nan[p.b, p.row, p.head, :] = row_nan
        return nan, pos, neg
    heads_of = slice(p.head * group, (p.head + 1) * group)
    rows = seen[:, p.row]  # (Sq,) rows that see key `row`
    if p.where == "k":
        if math.isnan(p.value):
            hit = rows[:, None].expand(seqlen_q, group)
        else:
            score = q[p.b, :, heads_of, p.c].float() * p.value  # (Sq, group)
            hit = rows[:, None] & ~(score < 0)
        nan[p.b, :, heads_of, :] = hit[:, :, None].expand(seqlen_q, group, d_head)
        return nan, pos, neg
    target = nan if math.isnan(p.value) else (pos if p.value > 0 else neg)
    target[p.b, :, heads_of, p.c] = rows[:, None].expand(seqlen_q, group)
    return nan, pos, neg


def v_dont_care(q: torch.Tensor, k: torch.Tensor, poison: Poison, causal: bool) -> torch.Tensor:
    """Output elements left unasserted: column c of the rows of the poisoned v's heads that do
    not see its key (NaN in the kernel iff their query block loads that key's block)."""
    care = torch.zeros(q.shape, dtype=torch.bool, device=q.device)
    if poison.where != "v":
        return care
    seqlen_q, heads = q.shape[1], q.shape[2]
    group = heads // k.shape[2]
    left, right = canonical_window(causal, (-1, -1), seqlen_q, k.shape[1])
    rows = visible(seqlen_q, k.shape[1], left, right, q.device)[:, poison.row]
    care[poison.b, :, poison.head * group:(poison.head + 1) * group, poison.c] = (
        ~rows[:, None].expand(seqlen_q, group))
    return care


def poison_inputs(q, k, v, poison: Poison) -> None:
    """Writes the poison in place (after forcing, for +/-inf in q, a key visible to every row,
    key 0, whose score is +inf, so the row's NaN is certain)."""
    t = {"q": q, "k": k, "v": v}[poison.where]
    t[poison.b, poison.row, poison.head, poison.c] = poison.value
    if poison.where == "q" and math.isinf(poison.value):
        group = q.shape[2] // k.shape[2]
        key0 = k[poison.b, 0, poison.head // group, poison.c]
        k[poison.b, 0, poison.head // group, poison.c] = key0.abs() * math.copysign(
            1.0, poison.value) + math.copysign(0.5, poison.value)
