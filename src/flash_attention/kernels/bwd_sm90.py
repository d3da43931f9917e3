"""The Hopper backward (``bwd_sm90``): wgmma, TMA, a producer warpgroup and two consumer
warpgroups; sm_90a code alone, for calls whose tensors TMA can address (deterministic ones too;
varlen ones on the kernels with flag j; the rest run on ``bwd_sm80``). A
:class:`Sm90BwdConfig` names one instantiation of ``flash::sm90::BwdConfig``
(src/csrc/sm90/backward_config.cuh). Name: ``bwd_sm90_bf16_d128_r64_c128_f``.

Exports what every kind module does: ``Config``, ``parse``, ``SETS``, ``ROWS``, ``select``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from . import base
from .base import DTYPES, Call, KernelConfig, Row, occupancy

KIND = "bwd_sm90"
D_HEADS = (64, 128, 256)
FLAGS: dict[str, str] = {
    "varlen": "varlen (packed) batches alone: a CTA finds its sequence through cu_seqlens, TMA "
              "maps span the packed rows, rows of a tile past its sequence's end are zeroed in "
              "shared memory, the per-row buffers hold each sequence from a multiple of 128 rows, "
              "and dK/dV rows that end inside the tensor leave from the staging buffer",
    "softcap": "score soft-capping: softcap * tanh(s / softcap), its derivative in dS",
}


@dataclass(frozen=True, order=True)
class Sm90BwdConfig(KernelConfig):
    """One Hopper backward kernel: B_c = 128 keys per CTA (64 per consumer warpgroup), query
    blocks of B_r = 64 rows (or 128 at d_head 64, where each consumer warpgroup computes dQ
    over its own keys) in two stages, a producer warpgroup. At d_head 256 (split_d) B_c = 64
    and the two consumer warpgroups split d_head instead of the keys; dO has one stage."""

    dtype: str
    d_head: int
    block_r: int
    block_c: int
    varlen: bool = False
    softcap: bool = False

    KIND = KIND
    SEGMENTS = (("d", "d_head"), ("r", "block_r"), ("c", "block_c"))
    FLAGS = FLAGS
    EXAMPLE = "bwd_sm90_bf16_d128_r64_c128_f"
    ARCH = 90
    STAGES = 2
    threads = 384  # two consumer warpgroups and the producer's
    warps = 12

    @staticmethod
    def block_c_for(d_head: int) -> int:
        """B_c, fixed by d_head: 64 at d_head 256, where the warpgroups split d_head, else
        128."""
        return 64 if d_head == 256 else 128

    @property
    def split_d(self) -> bool:
        """The consumer warpgroups split d_head, not the keys (BwdConfig::kSplitD)."""
        return self.d_head == 256

    @property
    def dq_own_keys(self) -> bool:
        """Each consumer warpgroup computes dQ over its own keys (BwdConfig::kDqOwnKeys)."""
        return self.d_head == 64

    @property
    def smem_bytes(self) -> int:
        """K, V, Q per stage, dO per stage (one at d_head 256), dS^T (once at d_head 64:
        kDqOwnKeys, else twice), P^T twice at d_head 256, a dQ part of B_r x 64 fp32 per
        consumer warpgroup, LSE and D per stage, 128 bytes of mbarriers, and 1024 bytes for
        the alignment of the base (BwdConfig::kSmemBytes)."""
        k = self.block_c * self.d_head * 2
        q = self.block_r * self.d_head * 2
        do_stages = 1 if self.split_d else self.STAGES
        dq = self.block_r * 64 * 4 * 2
        ds_buffers = (1 if self.dq_own_keys else 2) + (2 if self.split_d else 0)
        return (2 * k + (self.STAGES + do_stages) * q + ds_buffers * self.block_c * self.block_r * 2
                + dq + 2 * self.STAGES * self.block_r * 4 + 128 + 1024)

    def problems(self) -> list[str]:
        out = self.field_problems(("dtype", self.dtype, DTYPES),
                                  ("d_head", self.d_head, D_HEADS),
                                  ("B_r", self.block_r, (64, 128)),
                                  ("B_c", self.block_c, (64, 128)))
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

    def serves(self, call: Call) -> bool:
        """As Sm80BwdConfig.serves, for fixed-length calls (a varlen kernel, flag j, serves the
        same calls packed: VARLEN_ROWS)."""
        return (self.dtype == call.dtype and self.d_head >= call.d_head
                and self.softcap == call.softcap and not self.varlen)

    def describe(self) -> str:
        return (f"{self.name}: Hopper backward, {self.dtype}, d_head={self.d_head}, "
                f"B_r={self.block_r}, B_c={self.block_c}, smem={self.smem_bytes} B, "
                f"flags={self.flags_on}")


Config = Sm90BwdConfig
parse = Sm90BwdConfig.parse

# ---- the default table -------------------------------------------------------------------------
# B_r = 128 at d_head 64 (dQ over each warpgroup's own keys), 64 at d_head 128 and 256; B_c = 64
# at d_head 256 (the warpgroups split d_head). docs/backward.md holds the measurements.
ANY = ("plain", "masked", "local", "softcap")
ROWS: tuple[Row, ...] = (
    Row("bwd sm90 d64", ANY, (32, 64), None, "r128_c128_f",
        "B_r=128: each consumer warpgroup computes dQ over its own keys"),
    Row("bwd sm90 d128", ANY, (96, 128), None, "r64_c128_f", "two stages of 64 query rows"),
    Row("bwd sm90 d256", ANY, (160, 192, 224, 256), None, "r64_c64_f",
        "the consumer warpgroups split d_head; one dO stage"),
)


# Varlen calls (cu_seqlens) run their row's tile with flag j.
VARLEN_ROWS: tuple[Row, ...] = tuple(
    Row(r.key.replace("bwd sm90", "bwd sm90 varlen"), r.calls, r.d_heads, r.max_seq,
        r.kernel + "j", "the fixed-length row's tile over packed sequences")
    for r in ROWS)


def table_rows(call: Call) -> list[tuple[int | None, str]]:
    """(None, kernel name) of the row for the call's d_head."""
    return base.table_rows(KIND, ROWS, call, D_HEADS)


def varlen_table_rows(call: Call) -> list[tuple[int | None, str]]:
    """(None, kernel name) of the varlen row for the call's d_head."""
    return base.table_rows(KIND, VARLEN_ROWS, call, D_HEADS)


def default_tile(dtype: str, d_head: int, softcap: bool = False) -> Sm90BwdConfig:
    """The row's kernel of a Hopper d_head variant."""
    (_, name), = table_rows(Call(dtype, d_head, softcap=softcap))
    return parse(name)


def select(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig]
           ) -> Sm90BwdConfig | None:
    """The Hopper backward kernel for a call among the built ones (its row's kernel, else the
    smallest d_head variant that serves it), or None: the bwd_sm80 choice runs."""
    mine = [c for c in built if isinstance(c, Sm90BwdConfig)]
    return base.select_by_rows(mine, table_rows(call), call)


def select_varlen(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig]
                  ) -> Sm90BwdConfig | None:
    """The Hopper backward kernel for a varlen call among the built ones (its varlen row's
    kernel), or None: the bwd_sm80 choice runs."""
    names = {c.name for c in built}
    for _, name in varlen_table_rows(call):
        if name in names:
            return parse(name)
    return None


def varlen_tile(dtype: str, d_head: int, softcap: bool = False) -> Sm90BwdConfig:
    """The varlen row's kernel of a Hopper d_head variant."""
    (_, name), = varlen_table_rows(Call(dtype, d_head, softcap=softcap))
    return parse(name)


# ---- sets --------------------------------------------------------------------------------------

DEFAULT: tuple[Sm90BwdConfig, ...] = tuple(
    tile(dtype, d, softcap)
    for tile in (default_tile, varlen_tile)
    for dtype, d, softcap in itertools.product(DTYPES, D_HEADS, (False, True)))
SETS: dict[str, tuple[KernelConfig, ...]] = {
    "ci": (default_tile("bf16", 128), varlen_tile("bf16", 128)),
    "default": DEFAULT,
    # the d_head 64 kernels at B_r = 64, for side-by-side timing (studies/backward_bench.py)
    "r64": tuple(Sm90BwdConfig(dtype, 64, 64, 128, softcap=softcap)
                 for dtype, softcap in itertools.product(DTYPES, (False, True))),
}
