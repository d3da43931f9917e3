"""What every kernel kind's config shares: the dtypes, the error type, the per-architecture limits
the validity rules check, the occupancy estimate, the one table of flag letters, the call a
``select`` answers, the rows of a default table, and :class:`KernelConfig`, the base of every
config: its name (built from the kind's name segments and flags, parsed back by the same
rule), the check at construction and the rules on a field's allowed values.

A kernel's name is ``<direction>_<family>_<dtype>[_<cache dtype>]_d<d_head>_r<B_r>_c<B_c>
[_w<warps>|_s<stages>]_f<flags>``: the kind first (``fwd_sm80``, ``bwd_sm90``, ...), q's dtype
and, for a kind with CACHE_DTYPES, the K/V dtype where it differs from q's (a decode kernel over
an FP8 cache: ``dec_sm80_bf16_e4m3_...``), then r (query rows) before c (key columns), then the
flag letters of :data:`FLAG_LETTERS` that are on, in the kind's order. A flag
letter means one thing in every kind. Plain Python: no torch, no build code.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

DTYPES = ("fp16", "bf16")

# Shared-memory limits per architecture: the most one CTA may opt in to, and what one SM has.
SMEM_PER_BLOCK_OPTIN = {80: 163 * 1024, 90: 227 * 1024}
SMEM_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
THREADS_PER_SM = {80: 2048, 90: 2048}
MAX_CTAS_PER_SM = {80: 32, 90: 32}
REGS_PER_SM = 65536

# Every config flag of every kind and its one letter in kernel names. A kind declares the flags
# it has (its FLAGS, in name order); a letter never changes meaning between kinds.
FLAG_LETTERS: dict[str, str] = {
    # the sm80 forward's techniques
    "swizzle": "s", "eager_kv": "e", "slice_q": "q", "slice_k": "k", "slice_v": "v",
    "double_buffer": "b", "opt_softmax": "o", "reverse_kv": "r",
    # the Hopper forward's techniques
    "warp_spec": "w", "pingpong": "p", "overlap": "i", "tma_store": "a", "persistent": "l",
    "dynamic": "d", "cluster": "x", "tile_overlap": "n", "q_regs": "g", "lazy_rescale": "z",
    "exp2_fma": "u", "varlen": "j",
    # the sm80 backward's
    "prefetch": "h",
    # features, in every kind that has them (always the last two letters of a name)
    "mask": "m", "softcap": "t",
}
assert len(set(FLAG_LETTERS.values())) == len(FLAG_LETTERS), "a letter names two flags"
FEATURE_FLAGS = ("mask", "softcap")

# The d_head variants a call's d_head maps to (the smallest not below it): the sm80 family's
# compiled variants, and the keys of every kind's default table.
D_HEADS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_D_HEAD = D_HEADS[-1]


def variant_for(d_head: int, variants: tuple[int, ...] = D_HEADS) -> int | None:
    """The variant of `variants` that serves d_head (the smallest one not below it), or None
    when d_head is not a positive multiple of 8 up to MAX_D_HEAD (or above every variant)."""
    if d_head <= 0 or d_head % 8 or d_head > MAX_D_HEAD:
        return None
    return next((v for v in variants if v >= d_head), None)


class ConfigError(ValueError):
    """A kernel config that cannot be built, or a name that does not parse."""


def occupancy(threads: int, regs_per_thread: int, smem_per_cta: int,
              arch: int) -> dict[str, int]:
    """Resident CTAs per SM on sm_<arch> and what limits them: registers (allocated per warp in
    units of 256, 8 per thread rounded up), shared memory (smem_per_cta plus 1 KB reserved per
    CTA), threads and the CTA cap; with the warps they give."""
    if arch not in SMEM_PER_SM:
        raise ConfigError(f"unknown architecture sm_{arch}; known: {sorted(SMEM_PER_SM)}")
    regs_alloc = ((max(regs_per_thread, 1) + 7) // 8) * 8
    limits = {
        "by_regs": REGS_PER_SM // (regs_alloc * threads),
        "by_smem": SMEM_PER_SM[arch] // (smem_per_cta + 1024),
        "by_threads": THREADS_PER_SM[arch] // threads,
        "by_cap": MAX_CTAS_PER_SM[arch],
    }
    ctas = max(0, min(limits.values()))
    return {**limits, "ctas": ctas, "warps": ctas * threads // 32}


@dataclass(frozen=True)
class Call:
    """What a kernel choice depends on: dtype, the call's d_head (any multiple of 8), the longest
    query sequence, masks (causal or a window), a window bounded on the left (``local``, implies
    mask) and a softcap."""

    dtype: str
    d_head: int
    seqlen_q: int = 1
    mask: bool = False
    local: bool = False
    softcap: bool = False

    @property
    def kind(self) -> str:
        """The call's kind in a row's ``calls``: plain, masked, local or softcap (a softcap call
        of any mask: no kind has separate rows for it)."""
        if self.softcap:
            return "softcap"
        return "local" if self.local and self.mask else "masked" if self.mask else "plain"

    @property
    def feature_letters(self) -> str:
        """The flag letters of the features a kernel for this call carries (m, t, mt)."""
        return ((FLAG_LETTERS["mask"] if self.mask else "")
                + (FLAG_LETTERS["softcap"] if self.softcap else ""))


@dataclass(frozen=True)
class Row:
    """One decision of a kind's default table: calls of the kinds in ``calls`` at the d_head
    variants ``d_heads`` with seqlen_q up to ``max_seq`` (None: longer than the key's other
    rows) run ``kernel``, the name past ``<kind>_<dtype>_d<variant>_`` without the call's
    feature letters (m, t), which the table appends. ``key`` names the row in
    docs/dispatch.md, which holds the measurements behind ``why``."""

    key: str
    calls: tuple[str, ...]
    d_heads: tuple[int, ...]
    max_seq: int | None
    kernel: str
    why: str


def rows_for(rows: tuple[Row, ...], calls: str, variant: int) -> list[Row]:
    """The rows of a table that serve these calls at this d_head variant, shortest first."""
    mine = [row for row in rows if calls in row.calls and variant in row.d_heads]
    return sorted(mine, key=lambda row: (row.max_seq is None, row.max_seq or 0))


def table_rows(kind: str, rows: tuple[Row, ...], call: Call,
               kernel_variants: tuple[int, ...] = D_HEADS) -> list[tuple[int | None, str]]:
    """(largest seqlen_q it serves or None, kernel name) of a kind's rows for the call's kind and
    d_head variant (D_HEADS), shortest first; the kernel's d_head is its variant among
    `kernel_variants` (a Hopper kind's 64, 128, 256), its flags the row's and the call's
    features."""
    d = variant_for(call.d_head)
    if d is None:
        return []
    return [(row.max_seq, f"{kind}_{call.dtype}_d{variant_for(d, kernel_variants)}_"
             f"{row.kernel}{call.feature_letters}") for row in rows_for(rows, call.kind, d)]


@dataclass(frozen=True)
class ProgStep:
    """One step of a progression set: a technique and the config that first has it."""

    step: int
    title: str
    config: KernelConfig
    note: str = ""


def select_by_rows(built: list[KernelConfig], rows: list[tuple[int | None, str]], call: Call
                   ) -> KernelConfig | None:
    """A backward kind's choice among its built kernels: the first row's kernel that is built,
    else of those that serve the call the smallest d_head variant (the first built of it)."""
    by_name = {c.name: c for c in built}
    for _, name in rows:
        if name in by_name:
            return by_name[name]
    serving = [c for c in built if c.serves(call)]
    return min(serving, key=lambda c: c.d_head) if serving else None


_Config = TypeVar("_Config", bound="KernelConfig")


@functools.cache
def _flag_order(flags: tuple[str, ...]) -> str:
    """A kind's flag letters in name order."""
    return "".join(FLAG_LETTERS[f] for f in flags)


@functools.cache
def _name_pattern(kind: str, segments: tuple[tuple[str, str], ...],
                  cache_dtypes: tuple[str, ...] = ()) -> re.Pattern[str]:
    """The regular expression of a kind's names (KernelConfig.name), compiled once."""
    fields = "".join(rf"_{letter}(?P<{f}>\d+)" for letter, f in segments)
    cache = rf"(?:_(?P<cache>{'|'.join(cache_dtypes)}))?" if cache_dtypes else ""
    return re.compile(rf"{kind}_(?P<dtype>fp16|bf16|e4m3){cache}{fields}_f(?P<flags>[a-z]*)")


class KernelConfig:
    """Base of the config dataclasses (frozen; fields dtype, d_head, the kind's name segments,
    its flags). A kind sets the class attributes below and defines ``problems()`` (every reason
    the config cannot be built, from :meth:`field_problems`) and ``describe()``; the name and
    its parsing come from here."""

    KIND: ClassVar[str]  # "<direction>_<family>", e.g. "fwd_sm80"
    # (letter, field) of each name segment after the dtype, in order, e.g. (("d", "d_head"),
    # ("r", "block_r"), ("c", "block_c"), ("w", "warps"))
    SEGMENTS: ClassVar[tuple[tuple[str, str], ...]]
    FLAGS: ClassVar[dict[str, str]]  # flag field -> what it changes, in name order
    # K/V dtypes other than q's a kind's kernels may read (its configs then have a ``cache``
    # field: "" for q's dtype); () for kinds whose q, k and v share one dtype.
    CACHE_DTYPES: ClassVar[tuple[str, ...]] = ()
    EXAMPLE: ClassVar[str]  # a valid name
    ARCH: ClassVar[int]  # 80: runs on sm_80 and newer; 90: sm_90a code alone

    dtype: str
    d_head: int

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(f"invalid {self.KIND} config {self.name}: " + "; ".join(problems))

    def __str__(self) -> str:
        return self.name

    def problems(self) -> list[str]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    # ---- names ---------------------------------------------------------------------------------

    @property
    def direction(self) -> str:
        return self.KIND.split("_")[0]

    @property
    def family(self) -> str:
        return self.KIND.split("_")[1]

    @property
    def flag_letters(self) -> str:
        """The name's letters of the flags that are on, in FLAGS order."""
        return "".join(FLAG_LETTERS[f] for f in self.FLAGS if getattr(self, f))

    @property
    def flags_on(self) -> str:
        """The flags that are on, comma-separated, or ``none`` (for describe())."""
        return ",".join(f for f in self.FLAGS if getattr(self, f)) or "none"

    @functools.cached_property
    def name(self) -> str:
        """The kernel's name, e.g. ``fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor``: a valid C
        identifier, and the kernel's name in the build, the registry and every report."""
        segments = "".join(f"_{letter}{getattr(self, f)}" for letter, f in self.SEGMENTS)
        cache = f"_{getattr(self, 'cache', '')}" if getattr(self, "cache", "") else ""
        return f"{self.KIND}_{self.dtype}{cache}{segments}_f{self.flag_letters}"

    @classmethod
    def name_format(cls) -> str:
        segments = "".join(f"_{letter}<{f}>" for letter, f in cls.SEGMENTS)
        dtypes = "fp16|bf16|e4m3" if cls.KIND == "fwd_sm90" else "fp16|bf16"
        cache = f"[_<{'|'.join(cls.CACHE_DTYPES)}>]" if cls.CACHE_DTYPES else ""
        return f"{cls.KIND}_<{dtypes}>{cache}{segments}_f<flags>"

    @classmethod
    def parse(cls: type[_Config], text: str) -> _Config:
        """The config of a name; the inverse of :attr:`name`. ConfigError naming the format
        (and the flag letters of this kind, in order) when it does not parse."""
        m = _name_pattern(cls.KIND, cls.SEGMENTS, cls.CACHE_DTYPES).fullmatch(text.strip())
        order = _flag_order(tuple(cls.FLAGS))
        if m is None:
            raise ConfigError(f"cannot parse {cls.KIND} kernel name {text!r}: expected "
                              f"{cls.name_format()}, flags a subset of {order!r} in that order, "
                              f"e.g. {cls.EXAMPLE}")
        it = iter(order)
        if not all(ch in it for ch in m["flags"]):  # subsequence: known letters, in order
            raise ConfigError(f"cannot parse {cls.KIND} kernel name {text!r}: flags "
                              f"{m['flags']!r} must be a subset of {order!r} in that order")
        flags = {f: FLAG_LETTERS[f] in m["flags"] for f in cls.FLAGS}
        fields: dict[str, Any] = {f: int(m[f]) for _, f in cls.SEGMENTS}
        if cls.CACHE_DTYPES:
            fields["cache"] = m["cache"] or ""
        return cls(dtype=m["dtype"], **fields, **flags)  # type: ignore[call-arg]

    # ---- checks and copies ---------------------------------------------------------------------

    def replace(self: _Config, **changes: Any) -> _Config:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def field_problems(self, *rules: tuple[Any, ...]) -> list[str]:
        """Every field outside its allowed values, from rules (label, value, allowed) or
        (label, value, allowed, note: said after the allowed values), and every flag that is
        not a bool."""
        out = []
        for label, value, allowed, *note in rules:
            if value not in allowed:
                out.append(f"{label} must be one of {allowed}{''.join(note)}, got {value!r}")
        out += [f"{f} must be a bool" for f in self.FLAGS if not isinstance(getattr(self, f),
                                                                              bool)]
        return out
