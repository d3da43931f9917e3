"""The sm80 family's forward (``fwd_sm80``): mma.sync m16n8k16, ldmatrix, cp.async, swizzled
shared memory; runs on every GPU from sm_80. A :class:`Sm80FwdConfig` names one instantiation
of ``flash::sm80::FwdConfig`` (src/csrc/sm80/forward_config.cuh), whose static_asserts the
rules here mirror. Name: ``fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor``.

Exports what every kind module does: ``Config``, ``parse``, ``SETS``, ``ROWS``, ``select``.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

from . import base
from .base import (
    D_HEADS,
    DTYPES,
    FEATURE_FLAGS,
    SMEM_PER_BLOCK_OPTIN,
    Call,
    ConfigError,
    KernelConfig,
    ProgStep,
    Row,
    occupancy,
    variant_for,
)

KIND = "fwd_sm80"
# Compiled d_head variants: D_HEADS (32 .. 256, base.variant_for); a variant also serves every
# smaller d_head that is a multiple of 8. Mirrors the static_asserts of FwdConfig.
BLOCK_R = (64, 128)
BLOCK_C = (32, 64, 128)
WARPS = (4, 8)

# Register budget of one thread for accumulators plus whole-block fragments (32-bit words);
# above it ptxas spills. Mirrors FwdConfig::kFragRegBudget.
FRAG_REG_BUDGET = 224

FLAGS: dict[str, str] = {
    "swizzle": "XOR-swizzle 16-byte smem chunks by row (conflict-free ldmatrix)",
    "eager_kv": "prefetch V_j under Q K_j^T and K_{j+1} under softmax and P V_j",
    "slice_q": "load Q fragments per d-slice from smem (else resident in registers)",
    "slice_k": "load K fragments per d-slice, between the MMAs (else the whole block)",
    "slice_v": "load V fragments per key-slice, between the MMAs (else the whole block)",
    "double_buffer": "load slice s+1 into a second register buffer before the MMAs of s",
    "opt_softmax": "peeled first KV block (no rescale), scale folded into the exp2 FMA",
    "reverse_kv": "iterate KV blocks from last to first",
    "mask": "causal / sliding-window masks: visit only the KV blocks a query block can see, mask "
            "only the blocks on the window's edges, heaviest query blocks first",
    "softcap": "score soft-capping, softcap * tanh(s / softcap) before the softmax",
}


def smem_d_head(d_head: int) -> int:
    """Row width of the smem tiles: d_head rounded up to 64, 128 or 256 (whole 8-chunk swizzle
    groups). Mirrors FwdConfig::kSmemDHead."""
    return 64 if d_head <= 64 else (128 if d_head <= 128 else 256)


@dataclass(frozen=True, order=True)
class Sm80FwdConfig(KernelConfig):
    """One FA2 forward kernel: B_r query rows per CTA, B_c key rows per iteration."""

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

    KIND = KIND
    SEGMENTS = (("d", "d_head"), ("r", "block_r"), ("c", "block_c"), ("w", "warps"))
    FLAGS = FLAGS
    EXAMPLE = "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"
    ARCH = 80

    # ---- derived shapes (mirror FwdConfig in forward_config.cuh) -------------------------------

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

    def serves(self, call: Call) -> bool:
        """Is this dispatch's kind of kernel for the call? Its d_head is the call's variant (a
        larger one would run it too, but slower); masks serve unmasked calls too; a softcap
        kernel only softcap calls."""
        return (self.dtype == call.dtype and self.d_head == variant_for(call.d_head)
                and self.softcap == call.softcap and (self.mask or not call.mask))

    def describe(self) -> str:
        return (
            f"{self.name}: {self.dtype}, d_head={self.d_head}, B_r={self.block_r}, "
            f"B_c={self.block_c}, {self.warps} warps, smem={self.smem_bytes} B, "
            f"flags={self.flags_on}"
        )


Config = Sm80FwdConfig
parse = Sm80FwdConfig.parse

# ---- the default table -------------------------------------------------------------------------
# Runs on every GPU, and where a Hopper kernel cannot (the fallback of every Hopper row).
# docs/dispatch.md holds the measurements behind each row.
ANY = ("plain", "masked", "local", "softcap")
NO_SOFTCAP = ("plain", "masked", "local")
ROWS: tuple[Row, ...] = (
    Row("sm80 short", NO_SOFTCAP, (32, 64, 96, 128), 64, "r64_c64_w4_fseqkvbor",
        "<= 64 query rows fill one B_r=64 tile; softcap calls keep the one long tile"),
    Row("sm80 d64", ANY, (64,), None, "r128_c64_w4_fsekvbor",
        "sweep winner's shape with Q resident in registers: B_c=128 spills, defaults must not"),
    Row("sm80 d128", ANY, (128,), None, "r128_c64_w4_fseqkvbor",
        "sweep: B_r=128 with 4 warps and B_c=64 win at every length measured"),
    Row("sm80 d32, d96", ANY, (32, 96), None, "r128_c64_w4_fseqkvbor",
        "the d128 tile, spill-free; not swept"),
    Row("sm80 d160-256", ANY, (160, 192, 224, 256), None, "r128_c64_w8_fseqkvbor",
        "8 warps: O of d256 in 128 registers, 256 threads for the swizzled row; not swept"),
)

# (mask, softcap) of each feature set of a call, in the default set's order
FEATURES = ((False, False), (True, False), (False, True), (True, True))


def table_rows(call: Call) -> list[tuple[int | None, str]]:
    """(largest seqlen_q it serves or None, kernel name) of the rows for the call's kind and
    d_head variant, shortest first."""
    return base.table_rows(KIND, ROWS, call)


def select(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig]
           ) -> Sm80FwdConfig | None:
    """The sm80-family kernel for a call among the built ones: its row's kernel for the call's
    length, else any built kernel that serves it (exact features first: masks cost a little
    when none is needed), else None."""
    by_name = {c.name: c for c in built if isinstance(c, Sm80FwdConfig)}
    for max_seq, name in table_rows(call):
        if (max_seq is None or call.seqlen_q <= max_seq) and name in by_name:
            return by_name[name]
    candidates = [c for c in by_name.values() if c.serves(call)]
    return min(candidates, key=lambda c: c.mask != call.mask) if candidates else None


# ---- sets --------------------------------------------------------------------------------------

P = Sm80FwdConfig.parse

# What CI builds: 6 kernels that together switch every flag on and off at least once (masks
# with both KV orders) and cover both dtypes, d_head 64, 128 and a padded variant (160: smem
# rows of 256, 8 warps), every B_c and both warp counts.
CI: tuple[Sm80FwdConfig, ...] = (
    P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"),  # default long-sequence kernel, bf16
    P("fwd_sm80_fp16_d128_r128_c64_w4_fseqkvbor"),  # ... and fp16
    # plain: no swizzle, eager, double buffer, opt softmax, reverse
    P("fwd_sm80_fp16_d64_r64_c32_w4_fqkv"),
    P("fwd_sm80_bf16_d128_r64_c128_w4_fsekvom"),  # resident Q, forward order, no double buffer
    P("fwd_sm80_bf16_d64_r128_c64_w8_fseqbrmt"),  # whole-block K, V, 8 warps, plain softmax
    P("fwd_sm80_fp16_d160_r128_c64_w8_fsqkvbo"),  # no eager prefetch; a padded d_head variant
)

# Every kernel of the default table, in table order (dtype, d_head, features, rows).
DEFAULT: tuple[Sm80FwdConfig, ...] = tuple(dict.fromkeys(
    P(name)
    for dtype, d, (mask, softcap) in itertools.product(DTYPES, D_HEADS, FEATURES)
    for _, name in table_rows(Call(dtype, d, mask=mask, softcap=softcap))))


def _tune_space() -> tuple[Sm80FwdConfig, ...]:
    """Every valid tile shape per dtype and d_head with all optimisations on, plus the
    resident-Q variant where it fits the register budget."""
    out: list[Sm80FwdConfig] = []
    for dtype, d, br, bc, w in itertools.product(DTYPES, D_HEADS, BLOCK_R, BLOCK_C, WARPS):
        for slice_q in (True, False):
            with contextlib.suppress(ConfigError):  # the space holds only valid configs
                out.append(Sm80FwdConfig(dtype, d, br, bc, w, slice_q=slice_q))
    return tuple(out)


_BUILT_IN = "code-level change that this kernel always has; same config as the step before"

# One config per step of the original 16-step progression (steps that were code-level changes
# with no flag here share the config of the step before).
PROG_STEPS: tuple[ProgStep, ...] = (
    ProgStep(1, "base kernel (resident Q, K/V fragments per slice)",
             P("fwd_sm80_bf16_d128_r64_c64_w4_fkv")),
    ProgStep(2, "swizzled shared memory", P("fwd_sm80_bf16_d128_r64_c64_w4_fskv")),
    ProgStep(3, "eager K/V loading", P("fwd_sm80_bf16_d128_r64_c64_w4_fsekv")),
    ProgStep(4, "Q fragments interleaved with the MMAs", P("fwd_sm80_bf16_d128_r64_c64_w4_fseqkv")),
    ProgStep(5, "double-buffered smem->register loads", P("fwd_sm80_bf16_d128_r64_c64_w4_fseqkvb")),
    ProgStep(6, "fp32 throughput: optimised softmax", P("fwd_sm80_bf16_d128_r64_c64_w4_fseqkvbo")),
    ProgStep(7, "autotuned tile: B_r=128, B_c=64", P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbo")),
    ProgStep(8, "fewer address instructions", P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbo"),
             _BUILT_IN),
    ProgStep(9, "fewer register moves", P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbo"), _BUILT_IN),
    ProgStep(10, "peeled first softmax iteration", P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbo"),
             "part of opt_softmax here"),
    ProgStep(11, "precomputed swizzle offsets", P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbo"),
             _BUILT_IN),
    ProgStep(12, "streamed output stores", P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbo"),
             _BUILT_IN),
    ProgStep(13, "iterating KV blocks backwards", P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor")),
    ProgStep(14, "cache configuration", P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"), _BUILT_IN),
    ProgStep(15, "64-wide d_head smem tiling", P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"),
             _BUILT_IN),
    ProgStep(16, "runtime strides for any layout", P("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"),
             _BUILT_IN),
)

SETS: dict[str, tuple[KernelConfig, ...]] = {
    "ci": CI,
    "default": DEFAULT,
    "tune": _tune_space(),
    "prog": tuple(dict.fromkeys(s.config for s in PROG_STEPS)),
}
assert all(f in FLAGS for f in FEATURE_FLAGS)
