"""Hopper kernel configs: one instantiation of ``flash::sm90::Sm90Config``
(src/csrc/sm90/config.cuh), the sm_90a family (wgmma, TMA, mbarriers, setmaxnreg).

Short form: ``sm90_bf16_d128_c128_g2_s2_fwpoe`` = dtype, d_head variant, B_c, consumer
warpgroups (B_r = 64 per warpgroup), K/V stages, flags. One flag per technique, so each step of
the Hopper progression is a config (config_sets.SM90_PROG_STEPS). The rules mirror the
static_asserts of config.cuh.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .config_common import DTYPES, SMEM_PER_BLOCK_OPTIN, ShortFormConfig

FAMILY = "sm90"
D_HEADS = (64, 128, 256)
BLOCK_C = (64, 96, 128, 176, 192)
CONSUMER_WGS = (1, 2, 3)
STAGES = (1, 2, 3, 4)

FLAGS: dict[str, tuple[str, str]] = {
    "warp_spec": ("w", "a producer warpgroup issues the TMA copies; setmaxnreg gives the "
                       "consumers its registers"),
    "pingpong": ("p", "the two consumer warpgroups take turns on the tensor cores (named "
                      "barriers): one's softmax runs under the other's GEMMs"),
    "overlap": ("o", "softmax of block j under P V_{j-1} inside a warpgroup"),
    "tma_store": ("e", "epilogue through shared memory and a TMA store"),
    "persistent": ("s", "persistent grid (a CTA per SM looping over tiles): the next tile's "
                        "loads run under the current one's tail; O gets its own buffer"),
    "dynamic": ("d", "the persistent grid draws tiles from a global counter, heaviest query "
                     "blocks first within groups of heads whose K/V fit in L2 (even SM loads "
                     "under causal masks)"),
    "cluster": ("x", "CTA pairs (clusters of two) on neighbouring query blocks: each loads half "
                     "of every K/V block and multicasts it to both (half the L2 reads)"),
    "tile_overlap": ("n", "the next tile's S_0 GEMM and softmax run under the current tile's "
                          "last P V, before its epilogue (two Q buffers)"),
    "q_regs": ("q", "Q in registers for the tile (ldmatrix once): S = Q K^T takes A from "
                    "registers, so the S GEMMs read only K from shared memory"),
    "lazy_rescale": ("r", "a row's running max moves only when it grows by more than 8 (log2 "
                          "units, P stays <= 256), and a warp rescales O only when one of its "
                          "rows moved"),
    "mask": ("m", "causal / sliding-window masks (as the sm80 flag m)"),
    "softcap": ("t", "score soft-capping (as the sm80 flag t)"),
}
FEATURE_FLAGS = ("mask", "softcap")

# Registers per consumer thread after setmaxnreg (or the launch cap without a producer), and
# what the kernel needs besides accumulators (addresses, softmax state, loop state).
CONSUMER_REGS = {1: 240, 2: 240, 3: 160}
OVERHEAD_REGS = 40

_SHORT_RE = re.compile(
    r"^sm90_(?P<dtype>fp16|bf16)_d(?P<d_head>\d+)_c(?P<block_c>\d+)_g(?P<wgs>\d+)"
    r"_s(?P<stages>\d+)_f(?P<flags>[a-z]*)$"
)


@dataclass(frozen=True, order=True)
class Sm90Config(ShortFormConfig):
    """One Hopper forward kernel. B_r = 64 x consumer_wgs query rows per CTA, B_c key rows per
    stage."""

    dtype: str
    d_head: int
    block_c: int
    consumer_wgs: int
    stages: int
    warp_spec: bool = True
    pingpong: bool = True
    overlap: bool = True
    tma_store: bool = True
    persistent: bool = False
    dynamic: bool = False
    cluster: bool = False
    tile_overlap: bool = False
    q_regs: bool = False
    lazy_rescale: bool = False
    mask: bool = False
    softcap: bool = False

    family = FAMILY
    FLAGS = FLAGS
    KIND = "Hopper kernel config"
    SHORT_RE = _SHORT_RE
    SHORT_FORMAT = "sm90_<fp16|bf16>_d<d_head>_c<B_c>_g<consumer warpgroups>_s<stages>_f<flags>"
    EXAMPLE = "sm90_bf16_d128_c128_g2_s2_fwpoe"

    @property
    def short(self) -> str:
        return (f"sm90_{self.dtype}_d{self.d_head}_c{self.block_c}_g{self.consumer_wgs}"
                f"_s{self.stages}_f{self.flag_letters}")

    @classmethod
    def parse(cls, text: str) -> Sm90Config:
        m, flags = cls.match_short(text)
        return cls(dtype=m["dtype"], d_head=int(m["d_head"]), block_c=int(m["block_c"]),
                   consumer_wgs=int(m["wgs"]), stages=int(m["stages"]), **flags)

    # ---- derived shapes (mirror Sm90Config in config.cuh) --------------------------------------

    @property
    def block_r(self) -> int:
        return 64 * self.consumer_wgs

    @property
    def warps(self) -> int:
        return 4 * (self.consumer_wgs + (1 if self.warp_spec else 0))

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def elem_bytes(self) -> int:
        return 2

    @property
    def smem_bytes(self) -> int:
        """Q (two buffers with tile_overlap), K and V stages, O (persistent), the mbarriers
        (1 KB) and 1 KB to align the base to 1024."""
        q_and_o = 1 + int(self.tile_overlap) + int(self.persistent)
        rows = self.block_r * q_and_o + 2 * self.stages * self.block_c
        return rows * self.d_head * 2 + 2048

    @property
    def consumer_regs(self) -> int:
        """Registers per consumer thread after setmaxnreg (kConsumerRegs): 8 fewer with two
        consumer warpgroups and the dynamic schedule or a cluster, whose producer keeps 40."""
        busy_producer = self.dynamic or self.cluster
        return CONSUMER_REGS[self.consumer_wgs] - (8 if busy_producer and self.consumer_wgs == 2
                                                   else 0)

    @property
    def accum_regs(self) -> int:
        """fp32 accumulators of O and S plus the 16-bit P fragments (and Q's with q_regs), per
        consumer thread."""
        q = self.d_head // 4 if self.q_regs else 0
        return self.d_head // 2 + self.block_c // 2 + self.block_c // 4 + q

    def problems(self) -> list[str]:
        out = self.field_problems(
            ("dtype", self.dtype, DTYPES), ("d_head", self.d_head, D_HEADS, " on sm90"),
            ("B_c", self.block_c, BLOCK_C, " (a wgmma N)"),
            ("consumer warpgroups", self.consumer_wgs, CONSUMER_WGS),
            ("stages", self.stages, STAGES))
        if out:
            return out
        if self.pingpong and not (self.consumer_wgs == 2 and self.warp_spec):
            out.append("pingpong needs two consumer warpgroups and warp_spec")
        if self.persistent and not (self.warp_spec and self.tma_store and not self.pingpong):
            out.append("persistent needs warp_spec and tma_store, without pingpong")
        if self.dynamic and not self.persistent:
            out.append("dynamic tile scheduling needs the persistent grid")
        if self.cluster and not (self.warp_spec and not self.dynamic and not self.mask):
            out.append("cluster needs warp_spec, without dynamic or mask")
        if self.tile_overlap and not self.persistent:
            out.append("tile_overlap needs the persistent grid")
        regs = self.accum_regs + OVERHEAD_REGS
        if regs > self.consumer_regs:
            q = " and Q" if self.q_regs else ""
            out.append(f"O, S, P{q} need {self.accum_regs} registers per thread plus about "
                       f"{OVERHEAD_REGS}: over the {self.consumer_regs} a consumer has; use a "
                       "smaller B_c")
        if self.smem_bytes > SMEM_PER_BLOCK_OPTIN[90]:
            out.append(f"needs {self.smem_bytes} bytes of shared memory, over the sm_90 limit")
        return out

    def occupancy(self, arch: int = 90, regs_per_thread: int | None = None,
                  static_smem: int = 0) -> dict[str, int]:
        """One CTA per SM by design (launch bounds and setmaxnreg assume it)."""
        return {"by_regs": 1, "by_smem": 1, "by_threads": 1, "by_cap": 1, "ctas": 1,
                "warps": self.warps}

    def ctas_per_sm(self, arch: int = 90, regs_per_thread: int | None = None) -> int:
        return 1

    def describe(self) -> str:
        return (f"{self.short}: sm90a, {self.dtype}, d_head={self.d_head}, B_r={self.block_r}, "
                f"B_c={self.block_c}, {self.consumer_wgs} consumer warpgroups, "
                f"{self.stages} stages, smem={self.smem_bytes} B, flags={self.flags_on}")
