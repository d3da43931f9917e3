"""The Hopper forward (``fwd_sm90``): wgmma, TMA, mbarriers, setmaxnreg; sm_90a code alone, for
fixed-length calls whose tensors TMA can address (the rest run on ``fwd_sm80``). A
:class:`Sm90FwdConfig` names one instantiation of ``flash::sm90::FwdConfig``
(src/csrc/sm90/forward_config.cuh), whose static_asserts the rules here mirror. One flag per
technique, so each step of the Hopper progression is a config. Name:
``fwd_sm90_bf16_d128_r128_c128_s2_fwpia`` (B_r = 64 per consumer warpgroup, B_c, K/V stages).
dtype ``e4m3``: the FP8 forward (float8_e4m3fn q, k, v with descales, bf16 out; FP8_ROWS).

Exports what every kind module does: ``Config``, ``parse``, ``SETS``, ``ROWS``, ``select``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from . import base
from .base import (
    DTYPES,
    SMEM_PER_BLOCK_OPTIN,
    Call,
    ConfigError,
    KernelConfig,
    ProgStep,
    Row,
)

KIND = "fwd_sm90"
D_HEADS = (64, 128, 256)
FP8 = "e4m3"
DTYPES_ALL = (*DTYPES, FP8)  # the 16-bit ones and FP8 e4m3 (Hopper alone)
BLOCK_R = (64, 128, 192)  # 1 to 3 consumer warpgroups of 64 query rows
BLOCK_C = (64, 96, 128, 176, 192)
STAGES = (1, 2, 3, 4)

FLAGS: dict[str, str] = {
    "warp_spec": "a producer warpgroup issues the TMA copies; setmaxnreg gives the consumers its "
                 "registers",
    "pingpong": "the two consumer warpgroups take turns on the tensor cores (named barriers): "
                "one's softmax runs under the other's GEMMs",
    "overlap": "softmax of block j under P V_{j-1} inside a warpgroup",
    "tma_store": "epilogue through shared memory and a TMA store",
    "persistent": "persistent grid (a CTA per SM looping over tiles): the next tile's loads run "
                  "under the current one's tail; O gets its own buffer",
    "dynamic": "the persistent grid draws tiles from a global counter, heaviest query blocks "
               "first within groups of heads whose K/V fit in L2 (even SM loads under causal "
               "masks)",
    "cluster": "CTA pairs (clusters of two) on neighbouring query blocks: each loads half of "
               "every K/V block and multicasts it to both (half the L2 reads)",
    "tile_overlap": "the next tile's S_0 GEMM and softmax run under the current tile's last "
                    "P V, before its epilogue (two Q buffers)",
    "q_regs": "Q in registers for the tile (ldmatrix once): S = Q K^T takes A from registers, so "
              "the S GEMMs read only K from shared memory",
    "lazy_rescale": "a row's running max moves only when it grows by more than 8 (log2 units, P "
                    "stays <= 256), and a warp rescales O only when one of its rows moved",
    "exp2_fma": "a quarter of the softmax's exp2s by a polynomial on the FMA pipe, the rest on "
                "MUFU (its 16 results per clock and SM bound the FP8 softmax at d_head 128)",
    "varlen": "varlen (packed) batches alone: tiles find their sequence through cu_seqlens, TMA "
              "maps span the packed rows, V rows past a sequence's end are zeroed in shared "
              "memory, and a warpgroup whose rows cross the end stores from registers",
    "mask": "causal / sliding-window masks (as fwd_sm80's)",
    "softcap": "score soft-capping (as fwd_sm80's)",
}

# Registers per consumer thread after setmaxnreg (or the launch cap without a producer), by
# consumer warpgroups, and what the kernel needs besides accumulators (addresses, softmax
# state, loop state).
CONSUMER_REGS = {1: 240, 2: 240, 3: 160}
OVERHEAD_REGS = 40


def variant_for(d_head: int) -> int | None:
    """The Hopper d_head variant that serves d_head (64, 128 or 256), or None."""
    return base.variant_for(d_head, D_HEADS)


@dataclass(frozen=True, order=True)
class Sm90FwdConfig(KernelConfig):
    """One Hopper forward kernel: B_r = 64 x consumer warpgroups query rows per CTA, B_c key
    rows per stage."""

    dtype: str
    d_head: int
    block_r: int
    block_c: int
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
    exp2_fma: bool = False
    varlen: bool = False
    mask: bool = False
    softcap: bool = False

    KIND = KIND
    SEGMENTS = (("d", "d_head"), ("r", "block_r"), ("c", "block_c"), ("s", "stages"))
    FLAGS = FLAGS
    EXAMPLE = "fwd_sm90_bf16_d128_r128_c128_s2_fwpia"
    ARCH = 90

    # ---- derived shapes (mirror FwdConfig in sm90/forward_config.cuh) --------------------------

    @property
    def consumer_wgs(self) -> int:
        return self.block_r // 64

    @property
    def warps(self) -> int:
        return 4 * (self.consumer_wgs + (1 if self.warp_spec else 0))

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def elem_bytes(self) -> int:
        return 1 if self.fp8 else 2

    @property
    def smem_bytes(self) -> int:
        """Q (two buffers with tile_overlap), K and V stages (FP8: and V as TMA lands it, before
        the transpose), O (16-bit; persistent, or FP8 with tma_store), the mbarriers (1 KB) and 1
        KB to align the base to 1024."""
        eb = self.elem_bytes
        q = self.block_r * (1 + int(self.tile_overlap)) * self.d_head * eb
        kv = (3 if self.fp8 else 2) * self.stages * self.block_c * self.d_head * eb
        own_o = self.persistent or (self.fp8 and self.tma_store)
        o = self.block_r * self.d_head * 2 if own_o else 0
        return q + kv + o + 2048

    @property
    def exp2_fma_tiles(self) -> int:
        """Score n8 tiles per row whose exp2s run on the FMA pipe (kExp2FmaTiles: a quarter of
        the B_c / 8 with exp2_fma, else none)."""
        return self.block_c // 8 * 2 // 8 if self.exp2_fma else 0

    @property
    def consumer_regs(self) -> int:
        """Registers per consumer thread after setmaxnreg (kConsumerRegs): 8 fewer with one or
        two consumer warpgroups and the dynamic schedule or a cluster, whose producer keeps 40; 16
        fewer with FP8, whose producer transposes V with 56 (24 fewer with FP8 varlen: 72)."""
        if self.fp8:
            return 216 if self.varlen else 224
        busy_producer = self.dynamic or self.cluster
        return CONSUMER_REGS[self.consumer_wgs] - (8 if busy_producer and self.consumer_wgs < 3
                                                   else 0)

    @property
    def accum_regs(self) -> int:
        """fp32 accumulators of O and S plus the P fragments (16-bit, or FP8 at 4 a register),
        and Q's with q_regs, per consumer thread."""
        frag = 8 if self.fp8 else 4  # columns of P or Q per register and thread's quarter
        q = self.d_head // frag if self.q_regs else 0
        return self.d_head // 2 + self.block_c // 2 + self.block_c // frag + q

    def problems(self) -> list[str]:
        out = self.field_problems(
            ("dtype", self.dtype, DTYPES_ALL), ("d_head", self.d_head, D_HEADS, " on sm90"),
            ("B_r", self.block_r, BLOCK_R, " (64 per consumer warpgroup)"),
            ("B_c", self.block_c, BLOCK_C, " (a wgmma N)"),
            ("stages", self.stages, STAGES))
        if out:
            return out
        if self.pingpong and not (self.consumer_wgs == 2 and self.warp_spec):
            out.append("pingpong needs two consumer warpgroups (B_r=128) and warp_spec")
        if self.persistent and not (self.warp_spec and self.tma_store and not self.pingpong):
            out.append("persistent needs warp_spec and tma_store, without pingpong")
        if self.dynamic and not self.persistent:
            out.append("dynamic tile scheduling needs the persistent grid")
        if self.cluster and not (self.warp_spec and not self.dynamic and not self.mask):
            out.append("cluster needs warp_spec, without dynamic or mask")
        if self.tile_overlap and not self.persistent:
            out.append("tile_overlap needs the persistent grid")
        if self.varlen and self.cluster:
            out.append("varlen cannot take CTA pairs (a pair's blocks may lie in two sequences)")
        if self.fp8:
            if self.d_head not in (128, 256) or self.block_c not in (64, 128, 192):
                out.append("FP8 needs d_head 128 or 256 and B_c 64, 128 or 192 (a transposed V "
                           "row is one 128-byte swizzled row of keys, or 64-byte rows in panels "
                           "of 64 keys)")
            if not (self.warp_spec and self.block_r == 128 and self.stages >= 2):
                out.append("FP8 needs warp_spec (the producer transposes V), B_r 128 and 2+ "
                           "stages")
            bad = [f for f in ("dynamic", "cluster", "tile_overlap", "lazy_rescale")
                   if getattr(self, f)]
            if bad:
                out.append(f"FP8 does not take {', '.join(bad)} (lazy_rescale: P would exceed "
                           "e4m3's range)")
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

    def serves(self, call: Call) -> bool:
        """As Sm80FwdConfig.serves, with the Hopper d_head variant, for fixed-length calls (a
        varlen kernel, flag j, serves the same calls packed: VARLEN_ROWS)."""
        return (self.dtype == call.dtype and self.d_head == variant_for(call.d_head)
                and self.softcap == call.softcap and (self.mask or not call.mask)
                and not self.varlen)

    def describe(self) -> str:
        return (f"{self.name}: sm90a, {self.dtype}, d_head={self.d_head}, B_r={self.block_r}, "
                f"B_c={self.block_c}, {self.consumer_wgs} consumer warpgroups, "
                f"{self.stages} stages, smem={self.smem_bytes} B, flags={self.flags_on}")


Config = Sm90FwdConfig
parse = Sm90FwdConfig.parse

# ---- the default table -------------------------------------------------------------------------
# The binding runs these on sm_90 GPUs for fixed-length calls whose tensors TMA can address
# (16-byte aligned, strides multiples of 8 elements), else the fwd_sm80 row of the call. Rows are
# keyed by the call's fwd_sm80 d_head variant; the kernel is the next Hopper variant's (columns
# past the call's d_head zero-filled by TMA, never stored). d_head 32 has no row. Calls: "plain";
# "masked" (causal or a window open on the left); "local" (a window bounded on the left, which
# runs the masked row's kernel when its own is not built); "softcap" (with or without masks).
# Varlen calls have their own rows (VARLEN_ROWS, below).
ROWS: tuple[Row, ...] = (
    Row("sm90 plain d64 q<=256", ("plain",), (64,), 256, "r128_c128_s2_fwal",
        "B_r 128: a 197-token sequence pads to 256 rows (384 with B_r 192)"),
    Row("sm90 plain d64 q<=512", ("plain",), (64,), 512, "r192_c96_s3_fwaln",
        "257 tokens pad to 384 rows with either B_r; B_c 96 pads the keys to 288, not 384"),
    Row("sm90 plain d64 q<=1024", ("plain",), (64,), 1024, "r128_c128_s2_fwal",
        "B_r 128 pads 577-1024 rows less than B_r 192 does (1024: none against 1152)"),
    Row("sm90 plain d64 q<=4096", ("plain",), (64,), 4096, "r192_c96_s3_fwaln",
        "3 consumer warpgroups, persistent; the tile hand-over (n) saves cycles in every row"),
    Row("sm90 plain d64 q>4096", ("plain",), (64,), None, "r192_c96_s3_fwalngz",
        "Q in registers and the lazy rescale gain 3-4% from 8192, lose at 1024-2048"),
    Row("sm90 plain d128 q<=512", ("plain",), (96, 128), 512, "r128_c128_s2_fwal",
        "CTA pairs, and Q in registers with the lazy rescale, lose at 512"),
    Row("sm90 plain d128 q<=2048", ("plain",), (96, 128), 2048, "r128_c128_s2_fwalxgz",
        "CTA pairs multicasting K/V buy clock at 1024-2048; g and z cut cycles"),
    Row("sm90 plain d128 q>2048", ("plain",), (96, 128), None, "r128_c128_s2_fwialgz",
        "from 4096 one CTA per tile with overlap, g and z needs 5-6% fewer cycles than pairs"),
    Row("sm90 plain d256", ("plain",), (160, 192, 224, 256), None, "r128_c64_s2_fwpiaz",
        "ping-pong, overlap and the lazy rescale; no room for the persistent grid's O buffer"),
    Row("sm90 masked d64", ("masked",), (64,), None, "r192_c96_s3_fwald",
        "the dynamic tile schedule evens out the uneven causal tiles over the SMs"),
    Row("sm90 masked d128 q<=2048", ("masked",), (96, 128), 2048, "r128_c128_s2_fwald",
        "dynamic schedule; g and z save cycles but cost time at 1024-2048"),
    Row("sm90 masked d128 q<=4096", ("masked",), (96, 128), 4096, "r128_c128_s2_fwaldgz",
        "g and z: fewer cycles, and the time follows at 4096"),
    Row("sm90 masked d128 q>4096", ("masked",), (96, 128), None, "r128_c128_s2_fwialdgz",
        "intra-warpgroup overlap on top leads by 3-5% from 8192"),
    Row("sm90 masked d256", ("masked",), (160, 192, 224, 256), None, "r128_c64_s2_fwpia",
        "ping-pong and overlap beat the plain masked tile; no room for the O buffer"),
    Row("sm90 local d64", ("local",), (64,), None, "r192_c96_s3_fwal",
        "persistent grid: a window's query blocks cost about the same (as at d_head 128)"),
    Row("sm90 local d128", ("local",), (96, 128), None, "r128_c128_s2_fwialgz",
        "static persistent schedule with overlap, g and z: fewest cycles per window tile"),
    Row("sm90 local d256", ("local",), (160, 192, 224, 256), None, "r128_c64_s2_fwpia",
        "the masked row's kernel: no room for the persistent grid's O buffer"),
    Row("sm90 softcap d64", ("softcap",), (64,), None, "r192_c96_s3_fwald",
        "the masked row's kernel: the dynamic schedule serves masked softcap calls too"),
    Row("sm90 softcap d128", ("softcap",), (96, 128), None, "r128_c128_s2_fwpiaz",
        "ping-pong hides one warpgroup's tanh under the other's GEMMs; the persistent fwialgz "
        "tile takes 1.06-1.12x its time without masks"),
    Row("sm90 softcap d256", ("softcap",), (160, 192, 224, 256), None, "r128_c64_s2_fwpiaz",
        "the plain row's kernel: ping-pong and overlap hide the tanh under the GEMMs"),
)


# Small calls (ViT encoders at batch 1, a short prefill): when a call's tiles (batch x heads x
# query blocks) fit in one wave on the GPU's SMs, the rows below run it before the length
# rows, the first tier whose tiles fit: the B_r 64 tile (twice the CTAs of B_r 128, so that
# SMs a B_r 128 grid leaves idle take work), then the non-persistent B_r 128 ping-pong tile (a
# persistent grid or CTA pairs buy nothing in one wave). The extension applies the rule per
# call from its batch, heads, seqlen_q and the device's SM count (dispatch.h: one_wave). Plain
# 16-bit calls at d_head 64 and 128 (80, 96); each row is a tier, in order, not a length.
ONE_WAVE_ROWS: tuple[Row, ...] = (
    Row("sm90 one wave d64 B_r 64", ("plain",), (64,), None, "r64_c128_s2_fwia",
        "tier 1: B_r 64 tiles in one wave"),
    Row("sm90 one wave d64 B_r 128", ("plain",), (64,), None, "r128_c128_s2_fwpia",
        "tier 2: B_r 128 tiles in one wave, non-persistent ping-pong"),
    Row("sm90 one wave d128 B_r 64", ("plain",), (96, 128), None, "r64_c128_s2_fwia",
        "tier 1: B_r 64 tiles in one wave"),
    Row("sm90 one wave d128 B_r 128", ("plain",), (96, 128), None, "r128_c128_s2_fwpia",
        "tier 2: B_r 128 tiles in one wave, non-persistent ping-pong"),
)


def one_wave_table_rows(call: Call) -> list[tuple[int | None, str]]:
    """(None, kernel name) of the one-wave tiers for the call's kind and d_head, in tier order
    (none for FP8 calls)."""
    return [] if call.dtype == FP8 else base.table_rows(KIND, ONE_WAVE_ROWS, call, D_HEADS)


def select_one_wave(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig]
                    ) -> tuple[Sm90FwdConfig, ...]:
    """The built one-wave tiers of a call's row, in tier order (empty: the rule is off)."""
    names = {c.name for c in built}
    return tuple(P(name) for _, name in one_wave_table_rows(call) if name in names)


# Fewer padded keys: a plain call of up to max_seq query rows (the row's bucket) whose keys this
# tile's B_c pads at least 1/8 less than the length row's kernel does runs it instead (257 keys:
# B_c 96 pads to 288, B_c 128 to 384); applied per call from seqlen_k in the extension
# (dispatch.h: fewer_padded_keys). A call that fits in one wave runs its tier first.
KEY_PAD_ROWS: tuple[Row, ...] = (
    Row("sm90 key padding d128", ("plain",), (96, 128), 512, "r128_c96_s2_fwal",
        "B_c 96 where it pads the keys at least 1/8 less than B_c 128"),
)


def key_pad_table_rows(call: Call) -> list[tuple[int | None, str]]:
    """(largest seqlen_q it serves, kernel name) of the fewer-padded-keys row for the call's
    kind and d_head (none for FP8 calls)."""
    return [] if call.dtype == FP8 else base.table_rows(KIND, KEY_PAD_ROWS, call, D_HEADS)


def select_key_pad(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig]
                   ) -> Sm90FwdConfig | None:
    """The built fewer-padded-keys kernel for calls of this kind and seqlen_q (its row's
    bucket and below), or None."""
    names = {c.name for c in built}
    for max_seq, name in key_pad_table_rows(call):
        if name in names and (max_seq is None or call.seqlen_q <= max_seq):
            return P(name)
    return None


# FP8 (e4m3) calls: d_head 96-256 (no d_head 64 kernel yet); every kind of call runs the
# ping-pong tile (the producer warpgroup transposes V for the FP8 P V GEMM). No fallback: the
# sm80 family has no FP8 kernels.
_ALL_KINDS = ("plain", "masked", "local", "softcap")
FP8_ROWS: tuple[Row, ...] = (
    Row("sm90 fp8 d128", ("plain", "masked", "local"), (96, 128), None,
        "r128_c192_s2_fwpiau", "ping-pong and overlap, O through a TMA store; B_c 192 (V "
        "transposed into panels of 64 keys) leads B_c 128 with 3 stages by 2-9%; a quarter of the "
        "exp2s on the FMA pipe (u) gains 1-7.5%"),
    Row("sm90 fp8 softcap d128", ("softcap",), (96, 128), None,
        "r128_c128_s3_fwpiau", "B_c 128: at B_c 192 the softcap kernels spill (184-208 bytes); "
        "exp2_fma (u) gains 4-9%"),
    Row("sm90 fp8 d256", _ALL_KINDS, (160, 192, 224, 256), None,
        "r128_c64_s2_fwpia", "B_c 64 (O's 128 registers leave no room for 128), 2 stages (3 do "
        "not fit beside O's buffer)"),
)
# FP8 varlen calls (cu_seqlens): the fixed-length rows' tiles with flag j, but B_c 128 at d_head
# 128 (a varlen consumer keeps 216 registers: its producer needs 72 beside the sequence's span).
FP8_VARLEN_ROWS: tuple[Row, ...] = (
    Row("sm90 fp8 varlen d128", _ALL_KINDS, (96, 128), None, "r128_c128_s3_fwpiaj",
        "B_c 192 does not fit the varlen consumer's 216 registers"),
    Row("sm90 fp8 varlen d256", _ALL_KINDS, (160, 192, 224, 256), None, "r128_c64_s2_fwpiaj",
        "the fixed-length row's tile"),
)


# Varlen calls (cu_seqlens) on sm_90 run the row of their kind and d_head variant here (its
# kernel with the call's feature letters after flag j), not a row of their length: a pack holds
# many lengths. Each kernel ran FlashAttention's rule over packs of 9-40 sequences on an H200
# (docs/dispatch.md has the measurements): the longest fixed-length row's tile on the dynamic
# schedule where it passed; at d_head 128 the non-persistent ping-pong tile (the persistent
# dynamic one, fwialdgz plus j, gave wrong rows until sQ's early release was fixed, and is no
# faster on packs since: docs/dispatch.md).
_MASKED = ("masked", "local", "softcap")
VARLEN_ROWS: tuple[Row, ...] = (
    Row("sm90 varlen plain d64", ("plain",), (64,), None, "r192_c96_s3_fwaldngzj",
        "the longest plain row's tile on the dynamic schedule"),
    Row("sm90 varlen masked d64", _MASKED, (64,), None, "r192_c96_s3_fwaldj",
        "the masked rows' tile"),
    Row("sm90 varlen plain d128", ("plain",), (96, 128), None, "r128_c128_s2_fwpiazj",
        "non-persistent ping-pong: the persistent dynamic tile is no faster on packs"),
    Row("sm90 varlen masked d128", _MASKED, (96, 128), None, "r128_c128_s2_fwpiazj",
        "non-persistent ping-pong: the persistent masked tile within the spread of it"),
    Row("sm90 varlen plain d256", ("plain", "softcap"), (160, 192, 224, 256), None,
        "r128_c64_s2_fwpiazj", "the plain row's tile"),
    Row("sm90 varlen masked d256", ("masked", "local"), (160, 192, 224, 256), None,
        "r128_c64_s2_fwpiaj", "the masked row's tile"),
)


def varlen_table_rows(call: Call) -> list[tuple[int | None, str]]:
    """(None, kernel name) of the varlen row for the call's kind and d_head (FP8_VARLEN_ROWS
    for an e4m3 call; empty: none)."""
    return base.table_rows(KIND, FP8_VARLEN_ROWS if call.dtype == FP8 else VARLEN_ROWS, call,
                           D_HEADS)


def select_varlen(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig]
                  ) -> Sm90FwdConfig | None:
    """The Hopper kernel for a varlen call among the built ones: its varlen row's kernel, else
    None (the fwd_sm80 choice runs)."""
    names = {c.name for c in built}
    for _, name in varlen_table_rows(call):
        if name in names:
            return P(name)
    return None


def table_rows(call: Call) -> list[tuple[int | None, str]]:
    """(largest seqlen_q it serves or None, kernel name) of the rows for the call's kind and
    d_head (FP8_ROWS for an e4m3 call), shortest first."""
    return base.table_rows(KIND, FP8_ROWS if call.dtype == FP8 else ROWS, call, D_HEADS)


def select(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig]
           ) -> Sm90FwdConfig | None:
    """The Hopper kernel for a call among the built ones: the row of the call's length, else
    another built row of its kind (a window bounded on the left: then the masked rows), else
    None (the fwd_sm80 choice runs)."""
    by_name = {c.name: c for c in built if isinstance(c, Sm90FwdConfig)}
    if not by_name:
        return None
    calls = (call, dataclasses.replace(call, local=False)) if call.kind == "local" else (call,)
    for of_kind in calls:
        rows = sorted(table_rows(of_kind),
                      key=lambda row: row[0] is not None and call.seqlen_q > row[0])
        for _, name in rows:
            cfg = by_name.get(name)
            if cfg is not None and cfg.serves(call):
                return cfg
    return None


# ---- sets --------------------------------------------------------------------------------------

P = Sm90FwdConfig.parse

# What CI builds: 5 kernels that together switch on every Hopper flag.
CI: tuple[Sm90FwdConfig, ...] = (
    P("fwd_sm90_bf16_d128_r128_c128_s2_fwpiam"),  # every technique, masks
    P("fwd_sm90_bf16_d128_r128_c128_s2_fwaldgzm"),  # persistent, dynamic schedule, q_regs, lazy
    P("fwd_sm90_bf16_d128_r128_c128_s2_fwalxgz"),  # persistent, CTA pairs multicasting K/V
    P("fwd_sm90_bf16_d64_r192_c96_s3_fwaln"),  # 3 consumer warpgroups, tile hand-over
    P("fwd_sm90_bf16_d128_r128_c128_s2_fwpiazjmt"),  # varlen, softcap, ping-pong
    P("fwd_sm90_e4m3_d128_r128_c192_s2_fwpiaum"),  # FP8: V transposed by the producer, exp2_fma
)

# (mask, local, softcap) of each kind of call the default table serves.
_CALL_FEATURES = ((False, False, False), (True, False, False), (True, True, False),
                  (False, False, True), (True, False, True))
# Every kernel of the default table, in table order (dtype, d_head, call kind, rows), then those
# of the varlen table.
_FIXED: tuple[Sm90FwdConfig, ...] = tuple(dict.fromkeys(
    P(name)
    for dtype, d, (mask, local, softcap) in itertools.product(DTYPES_ALL, base.D_HEADS,
                                                              _CALL_FEATURES)
    for _, name in table_rows(Call(dtype, d, mask=mask, local=local, softcap=softcap))))
DEFAULT: tuple[Sm90FwdConfig, ...] = tuple(dict.fromkeys(_FIXED + tuple(
    P(name)
    for dtype, d, (mask, local, softcap) in itertools.product(DTYPES_ALL, base.D_HEADS,
                                                              _CALL_FEATURES)
    for rows in (varlen_table_rows, one_wave_table_rows, key_pad_table_rows)
    for _, name in rows(Call(dtype, d, mask=mask, local=local, softcap=softcap)))))

# The Hopper progression (FA3's milestones), bf16 d_head 128, B_r 128 (2 consumer warpgroups),
# B_c 128: each step adds one technique flag.
PROG_STEPS: tuple[ProgStep, ...] = (
    ProgStep(1, "wgmma + TMA, one K/V stage, no warp roles",
                      P("fwd_sm90_bf16_d128_r128_c128_s1_f")),
    ProgStep(2, "+ 2-stage K/V pipeline", P("fwd_sm90_bf16_d128_r128_c128_s2_f")),
    ProgStep(3, "+ producer warpgroup, setmaxnreg",
                      P("fwd_sm90_bf16_d128_r128_c128_s2_fw")),
    ProgStep(4, "+ ping-pong between consumer warpgroups",
                      P("fwd_sm90_bf16_d128_r128_c128_s2_fwp")),
    ProgStep(5, "+ softmax overlapped with P V in a warpgroup",
                      P("fwd_sm90_bf16_d128_r128_c128_s2_fwpi")),
    ProgStep(6, "+ epilogue through smem and a TMA store",
                      P("fwd_sm90_bf16_d128_r128_c128_s2_fwpia")),
)


def _tune_space() -> tuple[Sm90FwdConfig, ...]:
    """Hopper tiles per dtype and d_head: every valid (B_c, consumer warpgroups, stages) with
    warp specialisation and the epilogue; each plain, with ping-pong and overlap, with overlap
    alone, and on a persistent grid with and without overlap; each of those as it is and with Q
    in registers and the lazy rescale (the lazy rescale alone where Q does not fit)."""
    combos = ((False, False, False), (True, True, False), (False, True, False),
              (False, False, True), (False, True, True))
    out: list[Sm90FwdConfig] = []
    for dtype, d, bc, wgs, stages in itertools.product(DTYPES, D_HEADS, BLOCK_C, (2, 3), (2, 3)):
        for pingpong, overlap, persistent in combos:
            try:
                base = Sm90FwdConfig(dtype, d, 64 * wgs, bc, stages, pingpong=pingpong,
                                     overlap=overlap, persistent=persistent)
            except ConfigError:
                continue
            out.append(base)
            try:
                out.append(base.replace(q_regs=True, lazy_rescale=True))
            except ConfigError:
                out.append(base.replace(lazy_rescale=True))
    # FP8: d_head 128 at B_c 128, 256 at B_c 64, two consumer warpgroups; with and without Q in
    # registers (the lazy rescale is not an FP8 option).
    for (d, bc), stages, (pingpong, overlap, persistent), q_regs in itertools.product(
            ((128, 128), (256, 64)), (2, 3), combos, (False, True)):
        try:
            out.append(Sm90FwdConfig(FP8, d, 128, bc, stages, pingpong=pingpong,
                                     overlap=overlap, persistent=persistent, q_regs=q_regs))
        except ConfigError:
            continue
    return tuple(out)


SETS: dict[str, tuple[KernelConfig, ...]] = {
    "ci": CI,
    "default": DEFAULT,
    "tune": _tune_space(),
    "prog": tuple(dict.fromkeys(s.config for s in PROG_STEPS)),
}
