"""The sm80 family's backward (``bwd_sm80``): FlashAttention-2's algorithm with mma.sync,
ldmatrix and cp.async; runs on every GPU from sm_80 and every call (varlen too). A
:class:`Sm80BwdConfig` names one instantiation of ``flash::sm80::BwdConfig``
(src/csrc/sm80/backward_config.cuh), whose static_asserts the rules here mirror. Name:
``bwd_sm80_bf16_d128_r64_c128_w8_fh`` (B_r query rows per iteration, B_c keys per CTA).

Exports what every kind module does: ``Config``, ``parse``, ``SETS``, ``ROWS``, ``select``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from . import base
from .base import (
    D_HEADS,
    DTYPES,
    SMEM_PER_BLOCK_OPTIN,
    Call,
    KernelConfig,
    Row,
    occupancy,
)
from .fwd_sm80 import smem_d_head

KIND = "bwd_sm80"
BLOCK_R = (64, 128)
BLOCK_C = (64, 128)
WARPS = (4, 8)
REG_BUDGET = 200  # mirrors BwdConfig::kRegBudget: fp32 accumulator registers per thread
STATIC_SMEM = 128  # the CTA's sequence span (static __shared__), beside the dynamic tiles

FLAGS: dict[str, str] = {
    "prefetch": "double-buffered query blocks: Q, dO, LSE and D of the next block load while "
                "this one computes",
    "softcap": "score soft-capping: softcap * tanh(s / softcap), its derivative in dS",
}


@dataclass(frozen=True)
class WarpGrid:
    """Mirrors flash::sm80::WarpGrid: warps over a (rows x cols) tile, each with m_tiles m16
    tiles and n_tiles n8 tiles; of the splits into whole 16 x 16 tiles per warp, the squarest
    warp tile (least smem read per k-step), more warp rows on a tie."""

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
class Sm80BwdConfig(KernelConfig):
    """One FA2 backward kernel: B_r query rows per iteration, B_c keys per CTA."""

    dtype: str
    d_head: int
    block_r: int
    block_c: int
    warps: int
    prefetch: bool = False
    softcap: bool = False

    KIND = KIND
    SEGMENTS = (("d", "d_head"), ("r", "block_r"), ("c", "block_c"), ("w", "warps"))
    FLAGS = FLAGS
    EXAMPLE = "bwd_sm80_bf16_d128_r64_c128_w8_fh"
    ARCH = 80

    # ---- derived (mirror backward_config.cuh) --------------------------------------------------

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
                                  ("B_r", self.block_r, BLOCK_R), ("B_c", self.block_c, BLOCK_C),
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
        """Resident CTAs per SM on sm_<arch> and what limits them (as the forward's; without a
        measured register count, 255)."""
        return occupancy(self.threads, regs_per_thread or 255, self.smem_bytes + static_smem,
                         arch)

    def serves(self, call: Call) -> bool:
        """A backward kernel serves every call of its dtype and softcap flag up to its d_head
        (masks are run-time arguments of every backward kernel)."""
        return (self.dtype == call.dtype and self.d_head >= call.d_head
                and self.softcap == call.softcap)

    def describe(self) -> str:
        return (f"{self.name}: backward, {self.dtype}, d_head={self.d_head}, B_r={self.block_r}, "
                f"B_c={self.block_c}, {self.warps} warps, smem={self.smem_bytes} B, "
                f"flags={self.flags_on}")


Config = Sm80BwdConfig
parse = Sm80BwdConfig.parse

# ---- the default table -------------------------------------------------------------------------
# One tile per d_head variant, 8 warps (docs/backward.md holds the measurements). Every call kind
# (masks are run-time arguments); a softcap call runs the tile with flag t.
ANY = ("plain", "masked", "local", "softcap")
ROWS: tuple[Row, ...] = (
    Row("bwd sm80 d32-64", ANY, (32, 64), None, "r128_c128_w8_fh",
        "B_r=128 with the prefetch: H100 0.79-0.94x SDPA FA2 against 0.74-0.87x with B_r=64"),
    Row("bwd sm80 d96-128", ANY, (96, 128), None, "r64_c128_w8_fh",
        "B_c=128 with the prefetch"),
    Row("bwd sm80 d160-256", ANY, (160, 192, 224, 256), None, "r64_c64_w8_f",
        "B_c=64 without the prefetch: two stages of 256-wide Q and dO rows exceed sm_80's "
        "shared memory; dK and dV at 128 registers"),
)


def table_rows(call: Call) -> list[tuple[int | None, str]]:
    """(None, kernel name) of the row for the call's d_head variant."""
    return base.table_rows(KIND, ROWS, call)


def default_tile(dtype: str, d_head: int, softcap: bool = False) -> Sm80BwdConfig:
    """The row's kernel of a d_head variant."""
    (_, name), = table_rows(Call(dtype, d_head, softcap=softcap))
    return parse(name)


def select(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig]
           ) -> Sm80BwdConfig | None:
    """The sm80-family backward kernel for a call among the built ones: its row's kernel, else
    of those that serve it the smallest d_head variant (the first built of it; d_head runs
    zero-padded)."""
    mine = [c for c in built if isinstance(c, Sm80BwdConfig)]
    return base.select_by_rows(mine, table_rows(call), call)


# ---- sets --------------------------------------------------------------------------------------

# d_head variants of the default set, few for compile time (each backward kernel takes about
# 35 s of one core for sm_80 and sm_90): a call's d_head runs on the smallest one not below it,
# zero-padded (d_head 96 on the 128 kernel, 160 and 192 on the 256 one).
DEFAULT_D_HEADS = (64, 128, 256)
# The ``variants`` set: every variant but 224 (which spills 16 bytes on sm_90: a 224-column tile
# splits over two warp columns only; d_head 224 runs on the 256 kernel).
VARIANT_D_HEADS = tuple(d for d in D_HEADS if d != 224)

# What CI builds: d_head 64 and 128 with the prefetch (bf16), fp16 d_head 256 with a softcap
# (the split-column warp grid, the padded 256-wide rows).
CI: tuple[Sm80BwdConfig, ...] = (
    default_tile("bf16", 64), default_tile("bf16", 128), default_tile("fp16", 256, True))
DEFAULT: tuple[Sm80BwdConfig, ...] = tuple(
    default_tile(dtype, d, softcap)
    for dtype, d, softcap in itertools.product(DTYPES, DEFAULT_D_HEADS, (False, True)))

SETS: dict[str, tuple[KernelConfig, ...]] = {
    "ci": CI,
    "default": DEFAULT,
    "variants": tuple(default_tile(dtype, d, softcap) for dtype, d, softcap
                      in itertools.product(DTYPES, VARIANT_D_HEADS, (False, True))),
}
