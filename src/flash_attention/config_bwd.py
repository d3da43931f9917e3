"""Backward kernel configs: the single source of truth for what a backward kernel is.

A :class:`BwdConfig` names one instantiation of the C++ template ``flash::BwdConfig``
(src/csrc/sm80/backward_config.cuh), the sm80-family FlashAttention-2 backward (runs on sm_80
and sm_90). Its short form (``bwd_bf16_d128_c128_r64_w8_fb``) parses back to the same config and
is the kernel's name in the build, the backward registry and every report. The rules here
mirror the static_asserts of backward_config.cuh. A :class:`Sm90BwdConfig`
(``bwd_sm90_bf16_d128_c128_r64_f``) names one of ``flash::sm90::Sm90BwdConfig``
(src/csrc/sm90/backward_config.cuh), the Hopper backward (wgmma, TMA, a producer warp and two
consumer warpgroups; sm_90a, fixed-length calls, deterministic ones too: the rest run on the
sm80 family).

Named sets (selected by FLASH_ATTENTION_BWD_KERNELS, comma-separated set names or short forms;
``none`` builds no backward):

- ``ci``: four kernels: bf16 d_head 64 and 128 with the prefetch, fp16 d_head 256 with a
  softcap and without (the split-column warp grid, the padded 256-wide rows), and the Hopper
  kernel of bf16 d_head 128.
- ``hopper``: the Hopper backward kernels (:class:`Sm90BwdConfig`), d_head 64, 128 and 256 in
  both dtypes, with and without a softcap (12 kernels). They need the sm80 family beside them
  for the calls they do not run (varlen, other GPUs).
- ``default``: the sm80 family's tile of :func:`default_tile` for d_head 64, 128 and 256 in
  both dtypes, with and without a softcap (12 kernels; every other d_head runs zero-padded on
  the next), and the ``hopper`` set.
- ``variants``: the sm80 family's tile for every d_head variant (32 .. 256 but 224, which
  runs on 256).
- ``all``: the union.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from .config import D_HEADS, smem_d_head
from .config_common import DTYPES, SMEM_PER_BLOCK_OPTIN, ConfigError, ShortFormConfig, occupancy

BLOCK_C = (64, 128)
BLOCK_R = (64, 128)
WARPS = (4, 8)
REG_BUDGET = 200  # mirrors BwdConfig::kRegBudget: fp32 accumulator registers per thread

FLAGS: dict[str, tuple[str, str]] = {
    "prefetch": ("b", "double-buffered query blocks: Q, dO, LSE and D of the next block load "
                      "while this one computes"),
    "softcap": ("t", "score soft-capping: softcap * tanh(s / softcap), its derivative in dS"),
}
STATIC_SMEM = 128  # the CTA's sequence span (static __shared__), beside the dynamic tiles

_SHORT_RE = re.compile(
    r"^bwd_(?P<dtype>fp16|bf16)_d(?P<d_head>\d+)_c(?P<block_c>\d+)_r(?P<block_r>\d+)"
    r"_w(?P<warps>\d+)_f(?P<flags>[a-z]*)$"
)


@dataclass(frozen=True)
class WarpGrid:
    """Mirrors flash::WarpGrid: warps over a (rows x cols) tile, each with m_tiles m16 tiles and
    n_tiles n8 tiles; of the splits into whole 16 x 16 tiles per warp, the squarest warp tile
    (least smem read per k-step), more warp rows on a tie."""

    rows: int
    cols: int
    warps: int

    @property
    def warp_rows(self) -> int:
        best, best_cost = 0, 1 << 30
        wr = 1
        while wr <= self.warps:
            wc = self.warps // wr
            if not (self.warps % wr or self.rows % (16 * wr) or self.cols % (16 * wc)):
                cost = self.rows // wr + self.cols // wc
                if cost <= best_cost:
                    best, best_cost = wr, cost
            wr *= 2
        return best

    @property
    def warp_cols(self) -> int:
        return self.warps // self.warp_rows if self.warp_rows else 0

    @property
    def m_tiles(self) -> int:
        return self.rows // self.warp_rows // 16

    @property
    def n_tiles(self) -> int:
        return self.cols // self.warp_cols // 8

    def problems(self, what: str) -> list[str]:
        if not self.warp_rows:
            return [f"{what}: no split of a {self.rows} x {self.cols} tile over {self.warps} "
                    "warps gives each warp whole 16 x 16 tiles"]
        return []


@dataclass(frozen=True, order=True)
class BwdConfig(ShortFormConfig):
    """One FA2 backward kernel: B_c keys per CTA, B_r query rows per iteration."""

    dtype: str
    d_head: int
    block_c: int
    block_r: int
    warps: int
    prefetch: bool = False
    softcap: bool = False

    family = "sm80-bwd"
    FLAGS = FLAGS
    KIND = "backward config"
    SHORT_RE = _SHORT_RE
    SHORT_FORMAT = "bwd_<fp16|bf16>_d<d_head>_c<B_c>_r<B_r>_w<warps>_f<flags>"
    EXAMPLE = "bwd_bf16_d128_c128_r64_w8_fb"

    @property
    def short(self) -> str:
        """Short form, e.g. ``bwd_bf16_d128_c128_r64_w8_fb``; a valid C identifier."""
        return (f"bwd_{self.dtype}_d{self.d_head}_c{self.block_c}_r{self.block_r}"
                f"_w{self.warps}_f{self.flag_letters}")

    @classmethod
    def parse(cls, text: str) -> BwdConfig:
        m, flags = cls.match_short(text)
        return cls(dtype=m["dtype"], d_head=int(m["d_head"]), block_c=int(m["block_c"]),
                   block_r=int(m["block_r"]), warps=int(m["warps"]), **flags)

    # ---- derived (mirror backward_config.cuh) -----------------------------------------------

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def phase1(self) -> WarpGrid:  # S^T, dP^T: keys x queries
        return WarpGrid(self.block_c, self.block_r, self.warps)

    @property
    def phase2(self) -> WarpGrid:  # dV or dK (a half of the warps each): keys x d_head
        return WarpGrid(self.block_c, self.d_head, self.warps // 2)

    @property
    def phase3(self) -> WarpGrid:  # dQ: queries x d_head
        return WarpGrid(self.block_r, self.d_head, self.warps)

    @property
    def smem_bytes(self) -> int:
        """Per query stage (two with prefetch) Q, dO (rows padded to smem_d_head), LSE and D;
        then K, V, P^T and dS^T."""
        row = smem_d_head(self.d_head) * 2
        stage = 2 * self.block_r * row + 2 * self.block_r * 4
        return ((2 if self.prefetch else 1) * stage + 2 * self.block_c * row
                + 2 * self.block_c * self.block_r * 2)

    @property
    def p1_chunk_n_tiles(self) -> int:
        """n8 tiles of a phase-1 chunk (mirrors BwdConfig::kP1ChunkNT): the widest chunk (the
        whole warp tile where it fits) whose S^T and dP^T fit REG_BUDGET beside dK and dV, at
        least 2."""
        resident = self.phase2.m_tiles * self.phase2.n_tiles * 4
        n_tiles = self.phase1.n_tiles
        while n_tiles > 2 and resident + 2 * self.phase1.m_tiles * n_tiles * 4 > REG_BUDGET:
            n_tiles //= 2
        return n_tiles

    @property
    def p3_chunk_n_tiles(self) -> int:
        """n8 tiles of a phase-3 (dQ) chunk (mirrors BwdConfig::kP3ChunkNT): the widest even
        divisor of the warp's n8 tiles with at most 12 m16 x n8 tiles, at least 2."""
        fits = [n for n in range(2, self.phase3.n_tiles + 1, 2)
                if self.phase3.n_tiles % n == 0 and self.phase3.m_tiles * n <= 12]
        return max(fits, default=2)

    @property
    def accum_regs(self) -> int:
        resident = self.phase2.m_tiles * self.phase2.n_tiles * 4
        p1 = 2 * self.phase1.m_tiles * self.p1_chunk_n_tiles * 4
        p3 = self.phase3.m_tiles * self.p3_chunk_n_tiles * 4
        return resident + max(p1, p3)

    def problems(self) -> list[str]:
        out = self.field_problems(("dtype", self.dtype, DTYPES), ("d_head", self.d_head, D_HEADS),
                                  ("B_c", self.block_c, BLOCK_C), ("B_r", self.block_r, BLOCK_R),
                                  ("warps", self.warps, WARPS))
        if out:
            return out
        for what, grid in (("phase 1 (S^T)", self.phase1), ("phase 2 (dV or dK)", self.phase2),
                           ("phase 3 (dQ)", self.phase3)):
            out += grid.problems(what)
        rows_per_pass = self.threads // (smem_d_head(self.d_head) // 8)
        if rows_per_pass % 8:
            out.append(f"d_head={self.d_head} over {self.warps} warps copies {rows_per_pass} smem "
                       "rows per pass; the swizzled copy needs a multiple of 8 (8 warps above "
                       "d_head 128)")
        elif self.block_r % rows_per_pass or self.block_c % rows_per_pass:
            out.append(f"B_r and B_c must be multiples of the {rows_per_pass} rows a copy pass "
                       "covers")
        if out:
            return out
        for what, grid, chunk in (("phase 1", self.phase1, self.p1_chunk_n_tiles),
                                  ("phase 3", self.phase3, self.p3_chunk_n_tiles)):
            if grid.n_tiles % chunk or chunk % 2:  # BwdConfig's static_asserts
                out.append(f"{what} chunks of {chunk} n8 tiles do not split the warp's "
                           f"{grid.n_tiles} into whole pairs")
        if self.accum_regs > REG_BUDGET:
            out.append(f"accumulators need {self.accum_regs} registers per thread, over the "
                       f"budget of {REG_BUDGET}: use more warps or a smaller tile")
        if self.smem_bytes + STATIC_SMEM > SMEM_PER_BLOCK_OPTIN[80]:
            out.append(f"needs {self.smem_bytes} bytes of shared memory, over the sm_80 limit")
        return out

    def occupancy(self, arch: int = 90, regs_per_thread: int | None = None,
                  static_smem: int = 0) -> dict[str, int]:
        """Resident CTAs per SM on sm_<arch> and what limits them (as KernelConfig.occupancy;
        without a measured register count, 255)."""
        return occupancy(self.threads, regs_per_thread or 255, self.smem_bytes + static_smem,
                         arch)

    def describe(self) -> str:
        return (f"{self.short}: backward, {self.dtype}, d_head={self.d_head}, B_c={self.block_c}, "
                f"B_r={self.block_r}, {self.warps} warps, smem={self.smem_bytes} B, "
                f"flags={self.flags_on}")


SM90_FLAGS: dict[str, tuple[str, str]] = {
    "softcap": ("t", "score soft-capping: softcap * tanh(s / softcap), its derivative in dS"),
}
SM90_D_HEADS = (64, 128, 256)
_SHORT90_RE = re.compile(
    r"^bwd_sm90_(?P<dtype>fp16|bf16)_d(?P<d_head>\d+)_c(?P<block_c>\d+)_r(?P<block_r>\d+)"
    r"_f(?P<flags>[a-z]*)$"
)


@dataclass(frozen=True, order=True)
class Sm90BwdConfig(ShortFormConfig):
    """One Hopper backward kernel: B_c = 128 keys per CTA (64 per consumer warpgroup), query
    blocks of B_r = 64 rows (or 128 at d_head 64, where each consumer warpgroup computes dQ
    over its own keys) in two stages, a producer warpgroup (mirrors
    sm90/backward_config.cuh). At d_head 256 (split_d) B_c = 64 and the two consumer
    warpgroups split d_head instead of the keys; dO has one stage."""

    dtype: str
    d_head: int
    block_c: int = 128
    block_r: int = 64
    softcap: bool = False

    family = "sm90-bwd"
    arch = 90
    FLAGS = SM90_FLAGS
    KIND = "Hopper backward config"
    SHORT_RE = _SHORT90_RE
    SHORT_FORMAT = "bwd_sm90_<fp16|bf16>_d<d_head>_c<B_c>_r<B_r>_f<flags>"
    EXAMPLE = "bwd_sm90_bf16_d128_c128_r64_f"
    STAGES = 2
    threads = 384  # two consumer warpgroups and the producer's
    warps = 12

    @property
    def short(self) -> str:
        return (f"bwd_sm90_{self.dtype}_d{self.d_head}_c{self.block_c}_r{self.block_r}"
                f"_f{self.flag_letters}")

    @classmethod
    def parse(cls, text: str) -> Sm90BwdConfig:
        m, flags = cls.match_short(text)
        return cls(dtype=m["dtype"], d_head=int(m["d_head"]), block_c=int(m["block_c"]),
                   block_r=int(m["block_r"]), **flags)

    @staticmethod
    def block_c_for(d_head: int) -> int:
        """B_c, fixed by d_head (not a template argument of the C++ config): 64 at d_head 256,
        where the warpgroups split d_head, else 128."""
        return 64 if d_head == 256 else 128

    @property
    def split_d(self) -> bool:
        """The consumer warpgroups split d_head, not the keys (Sm90BwdConfig::kSplitD)."""
        return self.d_head == 256

    @property
    def smem_bytes(self) -> int:
        """K, V, Q per stage, dO per stage (one at d_head 256), dS^T (once at d_head 64:
        kDqOwnKeys, else twice), P^T twice at d_head 256, a dQ part of B_r x 64 fp32 per
        consumer warpgroup, LSE and D per stage, 128 bytes of mbarriers, and 1024 bytes for
        the alignment of the base (Sm90BwdConfig::kSmemBytes)."""
        k = self.block_c * self.d_head * 2
        q = self.block_r * self.d_head * 2
        do_stages = 1 if self.split_d else self.STAGES
        dq = self.block_r * 64 * 4 * 2
        ds_buffers = (1 if self.dq_own_keys else 2) + (2 if self.split_d else 0)
        return (2 * k + (self.STAGES + do_stages) * q + ds_buffers * self.block_c * self.block_r * 2
                + dq + 2 * self.STAGES * self.block_r * 4 + 128 + 1024)

    @property
    def dq_own_keys(self) -> bool:
        """Each consumer warpgroup computes dQ over its own keys (Sm90BwdConfig::kDqOwnKeys)."""
        return self.d_head == 64

    def problems(self) -> list[str]:
        out = self.field_problems(("dtype", self.dtype, DTYPES),
                                  ("d_head", self.d_head, SM90_D_HEADS),
                                  ("B_c", self.block_c, (64, 128)),
                                  ("B_r", self.block_r, (64, 128)))
        if not out and self.block_c != self.block_c_for(self.d_head):
            out.append(f"B_c={self.block_c} does not go with d_head={self.d_head} (B_c is 64 "
                       f"at d_head 256, where the warpgroups split d_head, else 128)")
        if self.block_r == 128 and not self.dq_own_keys:
            out.append(f"B_r=128 needs d_head=64 (each warpgroup's dQ over its own keys), got "
                       f"d_head={self.d_head}")
        return out

    def occupancy(self, arch: int = 90, regs_per_thread: int | None = None,
                  static_smem: int = 0) -> dict[str, int]:
        """Resident CTAs per SM (one: the launch bounds and shared memory say so)."""
        return occupancy(self.threads, regs_per_thread or 168, self.smem_bytes + static_smem,
                         arch)

    def describe(self) -> str:
        return (f"{self.short}: Hopper backward, {self.dtype}, d_head={self.d_head}, "
                f"B_c={self.block_c}, B_r={self.block_r}, smem={self.smem_bytes} B, "
                f"flags={self.flags_on}")


AnyBwdConfig = BwdConfig | Sm90BwdConfig


def parse_config(text: str) -> AnyBwdConfig:
    """A backward main kernel's short form, of either family."""
    if text.strip().startswith("bwd_sm90_"):
        return Sm90BwdConfig.parse(text)
    return BwdConfig.parse(text)


# The helper kernels a backward launch runs around the main one (common/backward_common.cuh):
# templates on the element type alone, instantiated by every backward unit of that dtype whose
# family launches them. Both families run the preprocess; the dQ conversion reads the fp32
# accumulator in the order the family's main kernel writes it: row by row for the sm80 family
# (convert_dq), in 64-row blocks of the wgmma accumulator's order for the Hopper one
# (convert_dq_tiles, whose units compile for sm_90a alone). kind -> threads per CTA.
AUX_KINDS: dict[str, int] = {"preprocess": 128, "convert_dq": 256, "convert_dq_tiles": 256}
# main kernel's family -> the helper kinds its units hold and its launch runs, in launch order
AUX_KINDS_OF_FAMILY: dict[str, tuple[str, ...]] = {
    "sm80-bwd": ("preprocess", "convert_dq"),
    "sm90-bwd": ("preprocess", "convert_dq_tiles"),
}
_AUX_RE = re.compile(
    r"^bwd_(?P<kind>preprocess|convert_dq_tiles|convert_dq)_(?P<dtype>fp16|bf16)$")


@dataclass(frozen=True, order=True)
class BwdAuxKernel:
    """``flash::bwd::bwd_<kind>_kernel<Elem>``: the preprocess (D, LSE log2 e, the zeroed dQ
    accumulator), the sm80 family's dQ conversion (accumulator rows) or the Hopper family's
    (``convert_dq_tiles``: wgmma-ordered 64-row blocks). Short form ``bwd_preprocess_bf16``,
    ``bwd_convert_dq_fp16``, ``bwd_convert_dq_tiles_bf16``."""

    kind: str
    dtype: str

    smem_bytes = 0  # no dynamic shared memory

    def __post_init__(self) -> None:
        if self.kind not in AUX_KINDS or self.dtype not in DTYPES:
            raise ConfigError(f"invalid backward helper kernel {self.kind!r}/{self.dtype!r}: "
                              f"kinds {tuple(AUX_KINDS)}, dtypes {DTYPES}")

    @property
    def family(self) -> str:
        """Whose code it is compiled as: ``sm90-bwd`` for a helper of Hopper backward units
        alone (sm_90a code only, as their main kernels), else ``sm80-bwd`` (every arch of the
        build; the preprocess, which Hopper units hold too, among them)."""
        return "sm80-bwd" if self.kind in AUX_KINDS_OF_FAMILY["sm80-bwd"] else "sm90-bwd"

    @property
    def short(self) -> str:
        return f"bwd_{self.kind}_{self.dtype}"

    def __str__(self) -> str:
        return self.short

    @property
    def threads(self) -> int:
        return AUX_KINDS[self.kind]

    @property
    def warps(self) -> int:
        return self.threads // 32

    @classmethod
    def parse(cls, text: str) -> BwdAuxKernel:
        m = _AUX_RE.match(text.strip())
        if m is None:
            raise ConfigError(f"cannot parse backward helper kernel {text!r}: expected "
                              f"bwd_<{'|'.join(AUX_KINDS)}>_<fp16|bf16>")
        return cls(m["kind"], m["dtype"])

    def occupancy(self, arch: int = 90, regs_per_thread: int | None = None,
                  static_smem: int = 0) -> dict[str, int]:
        """Resident CTAs per SM (as BwdConfig.occupancy; no dynamic shared memory)."""
        return occupancy(self.threads, regs_per_thread or 255, static_smem, arch)


def aux_kernels_of(config: AnyBwdConfig) -> tuple[BwdAuxKernel, ...]:
    """The helper kernels of a backward main kernel: what its unit holds beside it and its
    launch runs around it, the preprocess and its family's dQ conversion, of its dtype."""
    return tuple(BwdAuxKernel(kind, config.dtype) for kind in AUX_KINDS_OF_FAMILY[config.family])


def aux_kernels(configs: tuple[AnyBwdConfig, ...] | list[AnyBwdConfig]
                ) -> tuple[BwdAuxKernel, ...]:
    """The helper kernels a build of these backward configs holds: those of each config
    (aux_kernels_of), once, by dtype and then kind (AUX_KINDS' order)."""
    held = {aux for c in configs for aux in aux_kernels_of(c)}
    return tuple(a for a in (BwdAuxKernel(kind, d) for d in DTYPES for kind in AUX_KINDS)
                 if a in held)


def parse_kernel(text: str) -> AnyBwdConfig | BwdAuxKernel:
    """A backward main kernel's short form (either family) or a helper kernel's."""
    if _AUX_RE.match(text.strip()):
        return BwdAuxKernel.parse(text)
    return parse_config(text)


def default_tile(dtype: str, d_head: int, softcap: bool = False) -> BwdConfig:
    """The backward tile of a d_head variant, 8 warps: B_c=128 up to d_head 128 with the
    prefetch, B_r=128 up to d_head 64 (H100: 0.79-0.94x SDPA FA2 against 0.74-0.87x with
    B_r=64) and 64 above; B_c=64, B_r=64 above d_head 128, without the prefetch (two stages of
    256-wide Q and dO rows exceed sm_80's shared memory), dK and dV at 128 registers."""
    block_c = 128 if d_head <= 128 else 64
    block_r = 128 if d_head <= 64 else 64
    return BwdConfig(dtype, d_head, block_c, block_r, 8, prefetch=d_head <= 128,
                     softcap=softcap)


# d_head variants of the default set, few for compile time (each backward kernel takes about
# 35 s of one core for sm_80 and sm_90): a call's d_head runs on the smallest one not below it,
# zero-padded (d_head 96 on the 128 kernel, 160 and 192 on the 256 one).
DEFAULT_D_HEADS = (64, 128, 256)
# The ``variants`` set: every variant but 224 (which spills 16 bytes on sm_90: a 224-column tile
# splits over two warp columns only; d_head 224 runs on the 256 kernel).
VARIANT_D_HEADS = tuple(d for d in D_HEADS if d != 224)


P = BwdConfig.parse

SM80_CI: tuple[BwdConfig, ...] = (
    P("bwd_bf16_d64_c128_r64_w8_fb"),
    P("bwd_bf16_d128_c128_r64_w8_fb"),
    P("bwd_fp16_d256_c64_r64_w8_ft"),
)
SM80_DEFAULT: tuple[BwdConfig, ...] = tuple(
    default_tile(dtype, d, softcap)
    for dtype, d, softcap in itertools.product(DTYPES, DEFAULT_D_HEADS, (False, True)))
VARIANTS: tuple[BwdConfig, ...] = tuple(
    default_tile(dtype, d, softcap)
    for dtype, d, softcap in itertools.product(DTYPES, VARIANT_D_HEADS, (False, True)))

# B_r = 128 at d_head 64 (dQ over each warpgroup's own keys), 64 at d_head 128 and 256; B_c =
# 64 at d_head 256 (the warpgroups split d_head).
HOPPER: tuple[Sm90BwdConfig, ...] = tuple(
    Sm90BwdConfig(dtype, d, block_c=Sm90BwdConfig.block_c_for(d),
                  block_r=128 if d == 64 else 64, softcap=softcap)
    for dtype, d, softcap in itertools.product(DTYPES, SM90_D_HEADS, (False, True)))
# The d_head 64 kernels at B_r = 64, for side-by-side timing (studies/backward_bench.py
# --variants).
HOPPER_R64: tuple[Sm90BwdConfig, ...] = tuple(
    Sm90BwdConfig(dtype, 64, block_r=64, softcap=softcap)
    for dtype, softcap in itertools.product(DTYPES, (False, True)))
DEFAULT: tuple[AnyBwdConfig, ...] = SM80_DEFAULT + HOPPER
CI: tuple[AnyBwdConfig, ...] = (*SM80_CI, Sm90BwdConfig("bf16", 128))

SETS: dict[str, tuple[AnyBwdConfig, ...]] = {"ci": CI, "default": DEFAULT,
                                             "variants": VARIANTS, "hopper": HOPPER,
                                             "hopper-r64": HOPPER_R64, "none": ()}
SETS["all"] = tuple(dict.fromkeys(CI + DEFAULT + VARIANTS + HOPPER_R64))


def resolve(spec: str) -> tuple[AnyBwdConfig, ...]:
    """Backward configs named by comma-separated set names and/or short forms, in order,
    without duplicates (``none``: no backward kernels)."""
    out: list[AnyBwdConfig] = []
    for item in (i.strip() for i in spec.split(",")):
        if not item:
            continue
        if item in SETS:
            out.extend(SETS[item])
        else:
            try:
                out.append(parse_config(item))
            except ConfigError as exc:
                raise ConfigError(f"{exc}; or name a backward set: {', '.join(SETS)}") from None
    return tuple(dict.fromkeys(out))


def select(dtype: str, d_head: int, softcap: bool, built: tuple[AnyBwdConfig, ...],
           hopper: bool = False) -> AnyBwdConfig | None:
    """The backward kernel for a call (what the operator picks in C++): of the built configs of
    the dtype and softcap flag, the smallest d_head variant not below d_head; a Hopper one when
    ``hopper`` (the call can run on one: an sm_90 GPU, fixed length, tensors TMA can address)
    and one is built, else an sm80-family one."""
    def fits(family: type) -> list[AnyBwdConfig]:
        return [c for c in built if isinstance(c, family) and c.dtype == dtype
                and c.softcap == softcap and c.d_head >= d_head]

    cands = (fits(Sm90BwdConfig) if hopper else []) or fits(BwdConfig)
    return min(cands, key=lambda c: c.d_head) if cands else None
