"""Kernel configs: the single source of truth for what a kernel is.

A :class:`KernelConfig` names one instantiation of the C++ template ``flash::FwdConfig``
(src/csrc/sm80/config.cuh). Code generation, dispatch, tests and the tools all start from
it. Its short form (``bf16_d128_r128_c64_w4_fseqkvbor``) parses back to the same config and
doubles as the kernel's name in the build, the registry and every report.

The validity rules here mirror the static_asserts in config.cuh; an invalid config is rejected
with the reason before any code is generated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .config_common import (
    DTYPES,
    SMEM_PER_BLOCK_OPTIN,
    ConfigError,  # noqa: F401  (the package's error type, imported from here)
    ShortFormConfig,
    occupancy,
)
from .config_sm90 import Sm90Config

# Compiled d_head variants; a variant also serves every smaller d_head that is a multiple of 8
# (see variant_for). Mirrors the static_asserts of FwdConfig.
D_HEADS = (32, 64, 96, 128, 160, 192, 224, 256)
MAX_D_HEAD = D_HEADS[-1]
BLOCK_R = (64, 128)
BLOCK_C = (32, 64, 128)
WARPS = (4, 8)

# Register budget of one thread for accumulators plus whole-block fragments (32-bit words);
# above it ptxas spills. Mirrors FwdConfig::kFragRegBudget.
FRAG_REG_BUDGET = 224

# Boolean fields, their one-letter code in the short form, and what each changes in the kernel.
FLAGS: dict[str, tuple[str, str]] = {
    "swizzle": ("s", "XOR-swizzle 16-byte smem chunks by row (conflict-free ldmatrix)"),
    "eager_kv": ("e", "prefetch V_j under Q K_j^T and K_{j+1} under softmax and P V_j"),
    "slice_q": ("q", "load Q fragments per d-slice from smem (else resident in registers)"),
    "slice_k": ("k", "load K fragments per d-slice, between the MMAs (else the whole block)"),
    "slice_v": ("v", "load V fragments per key-slice, between the MMAs (else the whole block)"),
    "double_buffer": ("b", "load slice s+1 into a second register buffer before the MMAs of s"),
    "opt_softmax": ("o", "peeled first KV block (no rescale), scale folded into the exp2 FMA"),
    "reverse_kv": ("r", "iterate KV blocks from last to first"),
    "mask": ("m", "causal / sliding-window masks: visit only the KV blocks a query block can see, "
                  "mask only the blocks on the window's edges, heaviest query blocks first"),
    "softcap": ("t", "score soft-capping, softcap * tanh(s / softcap) before the softmax"),
}
# Flags that add a feature rather than an optimisation: off unless asked for.
FEATURE_FLAGS = ("mask", "softcap")

_SHORT_RE = re.compile(
    r"^(?P<dtype>fp16|bf16)_d(?P<d_head>\d+)_r(?P<block_r>\d+)_c(?P<block_c>\d+)"
    r"_w(?P<warps>\d+)_f(?P<flags>[a-z]*)$"
)


def variant_for(d_head: int) -> int | None:
    """The compiled d_head variant that serves d_head (the smallest one not below it), or None
    when d_head is not a positive multiple of 8 up to MAX_D_HEAD."""
    if d_head <= 0 or d_head % 8 or d_head > MAX_D_HEAD:
        return None
    return next(v for v in D_HEADS if v >= d_head)


def smem_d_head(d_head: int) -> int:
    """Row width of the smem tiles: d_head rounded up to 64, 128 or 256 (whole 8-chunk swizzle
    groups). Mirrors FwdConfig::kSmemDHead."""
    return 64 if d_head <= 64 else (128 if d_head <= 128 else 256)


@dataclass(frozen=True, order=True)
class KernelConfig(ShortFormConfig):
    """One FA2 forward kernel. Field names follow the paper: B_r query rows per CTA, B_c key
    rows per iteration."""

    dtype: str
    d_head: int
    block_r: int
    block_c: int
    warps: int
    swizzle: bool = True
    eager_kv: bool = True
    slice_q: bool = True
    slice_k: bool = True
    slice_v: bool = True
    double_buffer: bool = True
    opt_softmax: bool = True
    reverse_kv: bool = True
    mask: bool = False
    softcap: bool = False

    family = "sm80"  # the kernel family (sm80: mma.sync, cp.async; runs on sm_80 and newer)
    FLAGS = FLAGS
    KIND = "kernel config"
    SHORT_RE = _SHORT_RE
    SHORT_FORMAT = "<fp16|bf16>_d<d_head>_r<B_r>_c<B_c>_w<warps>_f<flags>"
    EXAMPLE = "bf16_d128_r128_c64_w4_fseqkvbor"

    # ---- names -------------------------------------------------------------------------------

    @property
    def short(self) -> str:
        """Short form, e.g. ``bf16_d128_r128_c64_w4_fseqkvbor``; a valid C identifier."""
        return (f"{self.dtype}_d{self.d_head}_r{self.block_r}_c{self.block_c}_w{self.warps}"
                f"_f{self.flag_letters}")

    @classmethod
    def parse(cls, text: str) -> KernelConfig:
        """Parse a short form; the inverse of :attr:`short`."""
        m, flags = cls.match_short(text)
        return cls(dtype=m["dtype"], d_head=int(m["d_head"]), block_r=int(m["block_r"]),
                   block_c=int(m["block_c"]), warps=int(m["warps"]), **flags)

    # ---- derived shapes (mirror FwdConfig in config.cuh) ---------------------------------------

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def rows_per_warp(self) -> int:
        return self.block_r // self.warps

    @property
    def m_tiles(self) -> int:
        """m16 MMA tiles per warp."""
        return self.rows_per_warp // 16

    @property
    def elem_bytes(self) -> int:
        return 2

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: one Q tile, one K tile, one V tile, rows padded to
        smem_d_head."""
        return (self.block_r + 2 * self.block_c) * smem_d_head(self.d_head) * self.elem_bytes

    @property
    def accum_regs(self) -> int:
        """fp32 accumulator registers per thread: O (m_tiles x d/8 tiles) and S (x B_c/8)."""
        return self.m_tiles * (self.d_head // 8 + self.block_c // 8) * 4

    @property
    def whole_frag_regs(self) -> int:
        """Registers of operands held as a whole block rather than slices."""
        q = 0 if self.slice_q else self.m_tiles * (self.d_head // 16) * 4
        k = 0 if self.slice_k else (self.block_c // 8) * (self.d_head // 16) * 2
        v = 0 if self.slice_v else (self.d_head // 8) * (self.block_c // 16) * 2
        return q + k + v

    # ---- validity ------------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """Every reason this config cannot be built (empty when valid)."""
        out = self.field_problems(("dtype", self.dtype, DTYPES), ("d_head", self.d_head, D_HEADS),
                                  ("B_r", self.block_r, BLOCK_R), ("B_c", self.block_c, BLOCK_C),
                                  ("warps", self.warps, WARPS))
        if out:
            return out
        if self.block_r % (16 * self.warps) != 0:
            out.append(
                f"B_r={self.block_r} over {self.warps} warps gives {self.rows_per_warp} rows per "
                "warp; each warp needs a multiple of 16 (one m16 MMA tile)"
            )
            return out
        rows_per_pass = self.threads // (smem_d_head(self.d_head) // 8)
        if rows_per_pass % 8:
            out.append(
                f"d_head={self.d_head} over {self.warps} warps copies {rows_per_pass} smem rows "
                "per pass; the swizzled copy needs a multiple of 8 (use 8 warps above d_head 128)"
            )
        elif self.block_c % rows_per_pass or self.block_r % rows_per_pass:
            out.append(f"B_r and B_c must be multiples of the {rows_per_pass} smem rows one copy "
                       "pass covers")
        if self.double_buffer and not (self.slice_q or self.slice_k or self.slice_v):
            out.append("double_buffer needs at least one sliced operand (slice_q/k/v); "
                       "with whole-block fragments it would change nothing")
        regs = self.accum_regs + self.whole_frag_regs
        if regs > FRAG_REG_BUDGET:
            out.append(
                f"accumulators ({self.accum_regs}) plus whole-block fragments "
                f"({self.whole_frag_regs}) need {regs} registers per thread, over the budget of "
                f"{FRAG_REG_BUDGET}: slice an operand or use a smaller tile"
            )
        if self.smem_bytes > SMEM_PER_BLOCK_OPTIN[80]:
            out.append(f"needs {self.smem_bytes} bytes of shared memory, over the sm_80 limit")
        return out

    # ---- occupancy -----------------------------------------------------------------------------

    def occupancy(self, arch: int = 90, regs_per_thread: int | None = None,
                  static_smem: int = 0) -> dict[str, int]:
        """Resident CTAs per SM on sm_<arch> and what limits them: registers, shared memory
        (dynamic tiles plus any static smem, 1 KB reserved per CTA), threads and the CTA cap.
        Without a measured register count the estimate assumes this config's fragments plus
        64 for addressing (at least 128, at most 255)."""
        if regs_per_thread is None:
            regs_per_thread = min(255, max(128, self.accum_regs + self.whole_frag_regs + 64))
        return occupancy(self.threads, regs_per_thread, self.smem_bytes + static_smem, arch)

    def ctas_per_sm(self, arch: int = 90, regs_per_thread: int | None = None) -> int:
        """Expected resident CTAs per SM on sm_<arch> (see occupancy())."""
        return self.occupancy(arch, regs_per_thread)["ctas"]

    def describe(self) -> str:
        return (
            f"{self.short}: {self.dtype}, d_head={self.d_head}, B_r={self.block_r}, "
            f"B_c={self.block_c}, {self.warps} warps, smem={self.smem_bytes} B, "
            f"flags={self.flags_on}"
        )


def parse_config(text: str) -> KernelConfig | Sm90Config:
    """Parse the short form of a config of either family (``sm90_...`` is a Hopper one)."""
    if text.strip().startswith("sm90_"):
        return Sm90Config.parse(text)
    return KernelConfig.parse(text)
