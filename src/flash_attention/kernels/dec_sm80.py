"""The sm80 family's decode kernels (``dec_sm80``): attention of a few query rows per sequence
over a KV cache (flash_attn_with_kvcache, varlen calls over a paged cache), bound by reading K
and V. mma.sync, ldmatrix and cp.async as the forward; runs on every GPU from sm_80. A
:class:`Sm80DecConfig` names one instantiation of ``flash::sm80::DecConfig``
(src/csrc/sm80/decode_config.cuh), whose static_asserts the rules here mirror. Name:
``dec_sm80_bf16_d128_r16_c16_w4_f``.

One CTA owns B_r = 16 packed query rows (the query heads of one KV head at the positions of
seqlen_q: packed GQA), or 32 for calls of more than 16 (WIDE_ROWS: 8 speculative positions of a
GQA group of 4 read the cache once, not twice), its warps split the keys, each through its own
3-stage cp.async pipeline (paged blocks addressed per page, per 16-row group over pages of a
multiple of 16 rows, else row by row: a paged cache of any page size),
and the keys may be split over CTAs, merged by the combine kernel (split-KV). Masks, softcap
and paging are run-time arguments: one kernel per dtype, d_head variant and tile height serves
every call.

An FP8 KV cache (``cache`` e4m3 or e5m2, q fp16/bf16: ``dec_sm80_bf16_e4m3_d128_r16_c32_w4_f``)
keeps K and V FP8 in shared memory and converts each fragment to fp16 right before its mma.sync
(both products run in fp16, a bf16 Q tile scaled into fp16's range; src/csrc/sm80/decode_fp8.cuh);
its blocks hold twice the keys in the same bytes.

Exports what every kind module does: ``Config``, ``parse``, ``SETS``, ``ROWS``, ``select``.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

from . import base
from .base import DTYPES, SMEM_PER_BLOCK_OPTIN, Call, ConfigError, KernelConfig, Row, occupancy

KIND = "dec_sm80"
D_HEADS = (64, 128, 256)
BLOCK_R = (16, 32)  # one m16 tile, or two (16-bit caches, d_head <= 128)
BLOCK_C = (16, 32)
WARPS = (2, 4, 8)
STAGES = 3  # DecConfig::kStages
FLAGS: dict[str, str] = {}
CACHES = ("e4m3", "e5m2")  # FP8 KV caches (DecConfig's CacheElem), q fp16 or bf16
BLOCK_C_FP8 = (32, 64)  # an FP8 block's K fragments come in x4 loads of 32 keys


def smem_d_head(d_head: int) -> int:
    return 64 if d_head <= 64 else (128 if d_head <= 128 else 256)


@dataclass(frozen=True, order=True)
class Sm80DecConfig(KernelConfig):
    """One decode kernel: B_r packed query rows per CTA, B_c keys per warp block, `warps` warps
    splitting the keys."""

    dtype: str
    d_head: int
    block_r: int
    block_c: int
    warps: int
    cache: str = ""  # "" (K and V of q's dtype) or an FP8 cache's dtype, e4m3 / e5m2

    KIND = KIND
    CACHE_DTYPES = CACHES
    SEGMENTS = (("d", "d_head"), ("r", "block_r"), ("c", "block_c"), ("w", "warps"))
    FLAGS = FLAGS
    EXAMPLE = "dec_sm80_bf16_d128_r16_c16_w4_f"
    ARCH = 80
    mask = True  # masks and softcap are run-time arguments (DecConfig::kMask, kSoftcap)
    softcap = True

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def cache_bytes(self) -> int:
        """Bytes of one K or V element: 1 with an FP8 cache, else 2."""
        return 1 if self.cache else 2

    @property
    def smem_bytes(self) -> int:
        """Q's B_r rows, then each warp's 3 stages of a K and a V block (or, if larger, the
        merge's fp32 O, m and l of every warp). Mirrors DecConfig::kSmemBytes."""
        row = smem_d_head(self.d_head) * 2
        kv_row = smem_d_head(self.d_head) * self.cache_bytes
        pipe = self.warps * STAGES * 2 * self.block_c * kv_row
        merge = self.warps * self.block_r * (self.d_head + 2) * 4
        return self.block_r * row + max(pipe, merge)

    def problems(self) -> list[str]:
        out = self.field_problems(("dtype", self.dtype, DTYPES),
                                  ("d_head", self.d_head, D_HEADS),
                                  ("B_r", self.block_r, BLOCK_R, " (m16 tiles of packed rows)"),
                                  ("B_c", self.block_c, BLOCK_C_FP8 if self.cache else BLOCK_C,
                                   " with an FP8 cache" if self.cache else ""),
                                  ("warps", self.warps, WARPS),
                                  ("cache", self.cache, ("", *CACHES)))
        if not out and self.block_r > 16 and (self.cache or self.d_head > 128):
            out.append(f"B_r {self.block_r} needs d_head <= 128 and a 16-bit cache (a warp's O "
                       f"of {self.block_r} rows x {self.d_head} fp32 in registers; the FP8 "
                       "fragments are of one m16 tile)")
        if not out:
            chunks = smem_d_head(self.d_head) // 8
            if (self.block_r * chunks) % self.threads:
                out.append(f"the Q tile copy ({self.block_r} rows of {chunks} chunks) does not "
                           f"split over {self.threads} threads")
            kv_chunks = smem_d_head(self.d_head) * self.cache_bytes // 16
            if (self.block_c * kv_chunks) % 32:
                out.append(f"a warp's K/V block copy ({self.block_c} rows of {kv_chunks} "
                           "chunks) does not split over 32 lanes")
            if self.smem_bytes > SMEM_PER_BLOCK_OPTIN[90]:
                out.append(f"shared memory {self.smem_bytes} B exceeds the sm_90 limit "
                           f"{SMEM_PER_BLOCK_OPTIN[90]} B")
        return out

    def occupancy(self, arch: int = 90, regs_per_thread: int | None = None,
                  static_smem: int = 0) -> dict[str, int]:
        return occupancy(self.threads, regs_per_thread or 168, self.smem_bytes + static_smem,
                         arch)

    def serves(self, call: Call, cache: str | None = None) -> bool:
        """Every call of its dtype up to its d_head variant (over an FP8 cache: d_head a
        multiple of 16), over a cache of `cache`'s dtype ("": q's; None: its own)."""
        return (self.dtype == call.dtype and (cache is None or self.cache == cache)
                and self.d_head >= call.d_head and (not self.cache or call.d_head % 16 == 0))

    @property
    def sm90_only(self) -> bool:
        """More shared memory than an sm_80 CTA may have: it launches only on GPUs that give it
        (H100/H200; the binding refuses it elsewhere, check_device)."""
        return self.smem_bytes > SMEM_PER_BLOCK_OPTIN[80]

    def describe(self) -> str:
        cache = f" over an {self.cache} cache" if self.cache else ""
        only = " (sm_90 only: more than sm_80's shared memory)" if self.sm90_only else ""
        return (f"{self.name}: decode, {self.dtype}{cache}, d_head={self.d_head}, "
                f"B_r={self.block_r} packed rows, B_c={self.block_c} keys per warp block, "
                f"{self.warps} warps, {STAGES} stages, smem={self.smem_bytes} B{only}")


Config = Sm80DecConfig
parse = Sm80DecConfig.parse

# ---- the default table -------------------------------------------------------------------------
ANY = ("plain", "masked", "local", "softcap")
ROWS: tuple[Row, ...] = (
    Row("dec sm80 d64", ANY, (32, 64), None, "r16_c32_w4_f",
        "B_c=32: a 64-wide row is 128 bytes, so a warp block of 32 keys is 4 KB like d128's"),
    Row("dec sm80 d128", ANY, (96, 128), None, "r16_c16_w4_f",
        "4 warps x 3 stages x (K, V) of 16 keys: 96 KB of stages, 2 CTAs per Hopper SM"),
    Row("dec sm80 d256", ANY, (160, 192, 224, 256), None, "r16_c16_w2_f",
        "2 warps: 96 KB of stages as at d128; O of 16 x 256 fp32 per warp in registers"),
)
# FP8 caches (e4m3, e5m2; the kernel name carries the cache's dtype after q's): the 16-bit
# rows' warps and stage bytes, so a block holds twice the keys.
FP8_ROWS: tuple[Row, ...] = (
    Row("dec sm80 fp8 d64", ANY, (32, 64), None, "r16_c64_w4_f",
        "B_c=64: 4 KB per K or V block as the 16-bit d64 and d128 rows"),
    Row("dec sm80 fp8 d128", ANY, (96, 128), None, "r16_c32_w4_f",
        "B_c=32: the 16-bit d128 row's 96 KB of stages, 2 CTAs per Hopper SM"),
    Row("dec sm80 fp8 d256", ANY, (160, 192, 224, 256), None, "r16_c32_w2_f",
        "2 warps, B_c=32: 96 KB of stages as at d128"),
)


# Calls of more than 16 packed rows (seqlen_q x heads_per_kv; 16-bit caches, d_head <= 128):
# two m16 tiles per CTA, so the keys are read once per 32 rows.
WIDE_ROWS: tuple[Row, ...] = (
    Row("dec sm80 wide d64", ANY, (32, 64), None, "r32_c32_w4_f",
        "the d64 row's stages with 32 rows: one CTA reads the keys of 32 packed rows once"),
    Row("dec sm80 wide d128", ANY, (96, 128), None, "r32_c16_w4_f",
        "the d128 row's stages with 32 rows (Q sliced: O of 32 x 128 fp32 takes 128 "
        "registers)"),
)
# A call runs its WIDE_ROWS kernel (where one is built) from WIDE_FROM packed rows when it reads
# WIDE_MIN_BYTES of K and V or more: below, a step is bound by fixed costs more than by
# bandwidth and the two 16-row CTAs of a KV head find its keys in L2 (H200, bf16, GQA 32/8,
# 8 queries: 16-row tiles 4-7% faster at 32-64 MiB, 32-row tiles 6-30% faster from 128 MiB).
# choose_decode in src/csrc/binding/decode.cpp decides the same.
WIDE_FROM = 17
WIDE_MIN_BYTES = 1 << 27

# Calls whose 16-row tiles fill a third of the SMs to all of them, one CTA each (1024 keys or more
# a split), run, where it is built and on a GPU that gives a CTA its shared memory (sm_90), the
# deep kernel of their row (the table's one-wave column): 8 warps over 3 stages each, 196 KB,
# one CTA per SM with twice the bytes in flight of a 4-warp CTA; one split over more than half
# the SMs, two over a third to a half (deep_splits). H200, bf16, GQA 32/8, by name: 10-16
# sequences (80-128 tiles) x 1024-8192 keys at one split 0.85-0.93x the time of the 4-warp
# kernel at its best split count; 8 x 2048 (64 tiles) at two splits 0.97x; over more tiles
# than SMs (20-24 sequences) it runs a second wave: 1.12-1.32x the 4-warp kernel's time.
DEEP_MIN_KEYS = 1024
DEEP_ROWS: tuple[Row, ...] = (
    Row("dec sm80 deep d128", ANY, (96, 128), None, "r16_c16_w8_f",
        "8 warps x 3 stages x (K, V) of 16 keys: 192 KB of stages, one CTA per SM (sm_90 only)"),
)


# Paged calls whose page size is a multiple of 16 but not of the row kernel's B_c (pages of 16 or
# 48 rows at d_head 64, whose 32-key blocks straddle two pages) run, where it is built, their
# row's kernel of 16-key blocks, each inside one page and addressed from its page's entry read
# one iteration ahead. H200, bf16, d_head 64, 16-row pages: 1.04-1.30x faster than the 32-key
# row gathering its rows one by one (GQA 32/8 and MHA 32/32, 1 x 4096 to 64 x 4096), 0.98-1.09x
# the contiguous cache's time but 1.35x at GQA 16 x 1024; 1.01-1.05x faster than the 32-key row
# with its blocks addressed per 16-row group (16 x 1024 to 64 x 4096, GQA 32/8).
# choose_decode in src/csrc/binding/decode.cpp decides the same (the table's SMALL_PAGE_BUCKET).
SMALL_PAGE_ROWS: tuple[Row, ...] = (
    Row("dec sm80 small pages d64", ANY, (32, 64), None, "r16_c16_w4_f",
        "B_c=16 for pages of 16 rows: every block inside one page (the d64 row's 32-key blocks "
        "straddle two)"),
)
SMALL_PAGE_BUCKET = 1016  # the decode table's bucket of SMALL_PAGE_ROWS (no tile height's)


def small_pages(page_size: int, block_c: int) -> bool:
    """Whether pages of `page_size` rows take a SMALL_PAGE_ROWS kernel over a row kernel of
    `block_c` keys a block (a multiple of 16 that block_c does not divide)."""
    return page_size > 0 and page_size % 16 == 0 and page_size % block_c != 0


def table_rows(call: Call, cache: str = "", wide: bool = False, deep: bool = False,
               small_page: bool = False) -> list[tuple[int | None, str]]:
    """(None, kernel name) of the row for the call's d_head over a cache of `cache`'s dtype
    ("": q's), of WIDE_ROWS with `wide`, of DEEP_ROWS with `deep`, of SMALL_PAGE_ROWS with
    `small_page` (those three: none over an FP8 cache) (no feature letters: one kernel serves
    every mask and softcap)."""
    nofeat = Call(call.dtype, call.d_head, call.seqlen_q)
    if wide or deep or small_page:
        rows = WIDE_ROWS if wide else DEEP_ROWS if deep else SMALL_PAGE_ROWS
        return [] if cache else base.table_rows(KIND, rows, nofeat, D_HEADS)
    if not cache:
        return base.table_rows(KIND, ROWS, nofeat, D_HEADS)
    head = f"{KIND}_{call.dtype}_"
    return [(seq, head + cache + "_" + name[len(head):])
            for seq, name in base.table_rows(KIND, FP8_ROWS, nofeat, D_HEADS)]


def default_tile(dtype: str, d_head: int, cache: str = "", wide: bool = False,
                 deep: bool = False, small_page: bool = False) -> Sm80DecConfig:
    (_, name), = table_rows(Call(dtype, d_head), cache, wide, deep, small_page)
    return parse(name)


def select(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig], cache: str = "",
           wide: bool = False) -> Sm80DecConfig | None:
    """The decode kernel for a call (over a cache of `cache`'s dtype, "": q's) among the built
    ones of 16 packed rows (of more with `wide`) that fit sm_80's shared memory: its row's
    kernel, else the smallest d_head variant that serves it, or None."""
    mine = [c for c in built if isinstance(c, Sm80DecConfig) and c.cache == cache
            and (c.block_r > 16) == wide and not c.sm90_only]
    if cache and call.d_head % 16:
        return None
    return base.select_by_rows(mine, table_rows(call, cache, wide), call)


def _select_built(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig], cache: str,
                  **which: bool) -> Sm80DecConfig | None:
    """The kernel of the call's row of table_rows(**which) if it is built, else None (no other
    kernel stands in: those rows are measured exceptions, not d_head variants)."""
    rows = {name for _, name in table_rows(call, cache, **which)}
    return next((c for c in built if isinstance(c, Sm80DecConfig) and c.name in rows), None)


def select_deep(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig],
                cache: str = "") -> Sm80DecConfig | None:
    """The DEEP_ROWS kernel of a call's row if it is built, else None."""
    return _select_built(call, built, cache, deep=True)


def select_small_page(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig],
                      cache: str = "") -> Sm80DecConfig | None:
    """The SMALL_PAGE_ROWS kernel of a call's row if it is built, else None."""
    return _select_built(call, built, cache, small_page=True)


def heuristic_splits(ctas: int, keys: int, sms: int) -> int:
    """The split count num_splits=0 takes for `ctas` tiles of `keys` keys per sequence on a GPU
    of `sms` SMs, mirroring choose_splits in src/csrc/binding/decode.cpp: none when the tiles
    fill most of a wave of two CTAs per SM, two when they fill most of one per SM and the keys
    are 4096 or more, else what one wave of two per SM holds (128 keys a split at least, 128
    splits at most)."""
    wave = 2 * sms
    if ctas >= wave * 4 // 5:
        return 1
    if ctas >= sms * 4 // 5:
        return 2 if keys >= 4096 else 1
    return min(128, max(1, keys // 128), max(1, wave // ctas))


def deep_splits(tiles: int, keys: int, sms: int) -> int:
    """The split count a call of `tiles` 16-row tiles and `keys` keys per sequence runs its
    row's deep kernel with (num_splits=0, on an sm_90 GPU of `sms` SMs), 0 where it runs
    another kernel: one split over more than half the SMs (at most one tile per SM), two over a
    third to a half, each split DEEP_MIN_KEYS keys or more. Mirrors deep_splits in
    src/csrc/binding/decode.cpp."""
    if not sms // 3 < tiles <= sms:
        return 0
    splits = 1 if tiles > sms // 2 else 2
    return splits if keys >= DEEP_MIN_KEYS * splits else 0


def runs_deep(tiles: int, keys: int, sms: int) -> bool:
    """Whether a call of `tiles` 16-row tiles and `keys` keys per sequence, with num_splits=0,
    takes its row's deep kernel on an sm_90 GPU of `sms` SMs (deep_splits)."""
    return deep_splits(tiles, keys, sms) > 0


def packed_rows(seqlen_q: int, heads: int, kv_heads: int) -> int:
    """The packed rows of a decode call: seqlen_q positions x the query heads of a KV head."""
    return seqlen_q * (heads // kv_heads)


def row_tiles(rows: int, kv_heads: int, batch: int, block_r: int = 16) -> int:
    """The tiles (CTAs before splits) of a call of `rows` packed rows: row blocks of B_r x KV
    heads x sequences."""
    return -(-rows // block_r) * kv_heads * batch


def runs_wide(rows: int, kv_bytes: int) -> bool:
    """Whether a call of `rows` packed rows reading `kv_bytes` of K and V takes 32-row tiles."""
    return rows >= WIDE_FROM and kv_bytes >= WIDE_MIN_BYTES


def kv_bytes(batch: int, kv_heads: int, keys: int, d_head: int, cache: str = "") -> int:
    """The K and V bytes a call reads at most: `keys` rows of every sequence and KV head."""
    return 2 * batch * kv_heads * keys * d_head * (1 if cache else 2)


def select_for(call: Call, built: tuple[KernelConfig, ...] | list[KernelConfig], rows: int,
               kv: int, cache: str = "", *, tiles: int = 0, keys: int = 0, sms: int = 0,
               smem: int = SMEM_PER_BLOCK_OPTIN[90], page_size: int = 0) -> Sm80DecConfig | None:
    """The kernel a call of `rows` packed rows reading `kv` bytes of K and V runs (with
    num_splits=0; `tiles` 16-row tiles, `keys` per sequence, on a GPU of `sms` SMs giving a
    CTA `smem` bytes of shared memory; sms 0: no deep kernel; over pages of `page_size` rows,
    0: contiguous): the wide one where runs_wide says so and one is built, else the deep one
    where runs_deep says so, one is built and the GPU gives its shared memory, else select's,
    or its row's small-page kernel where small_pages says so and one is built (choose_decode
    in src/csrc/binding/decode.cpp)."""
    wide = select(call, built, cache, wide=True) if runs_wide(rows, kv) else None
    if wide is not None:
        return wide
    deep = select_deep(call, built, cache) if sms and runs_deep(tiles, keys, sms) else None
    if deep is not None and deep.smem_bytes <= smem:
        return deep
    cfg = select(call, built, cache)
    if cfg is not None and small_pages(page_size, cfg.block_c):
        small = select_small_page(call, built, cache)
        if small is not None and small.block_r == cfg.block_r:
            return small
    return cfg


# ---- sets --------------------------------------------------------------------------------------

# The DEEP_ROWS kernels, in `default` (sm_90 builds run them; on sm_80 GPUs check_device
# refuses them by name and the table never takes them) and a set of their own.
DEEP: tuple[Sm80DecConfig, ...] = tuple(default_tile(dtype, 128, deep=True) for dtype in DTYPES)
SMALL_PAGE: tuple[Sm80DecConfig, ...] = tuple(default_tile(dtype, 64, small_page=True)
                                              for dtype in DTYPES)
DEFAULT: tuple[Sm80DecConfig, ...] = (
    tuple(default_tile(dtype, d, cache)
          for cache, dtype, d in itertools.product(("", *CACHES), DTYPES, D_HEADS))
    + tuple(default_tile(dtype, d, wide=True)
            for dtype, d in itertools.product(DTYPES, (64, 128)))
    + DEEP + SMALL_PAGE)


def _tune_space() -> tuple[Sm80DecConfig, ...]:
    out = []
    for cache, dtype, d, r, c, w in itertools.product(("", *CACHES), DTYPES, D_HEADS, BLOCK_R,
                                                      (*BLOCK_C, 64), WARPS):
        with contextlib.suppress(ConfigError):
            out.append(Sm80DecConfig(dtype, d, r, c, w, cache))
    return tuple(out)


SETS: dict[str, tuple[KernelConfig, ...]] = {
    "ci": (default_tile("bf16", 128), default_tile("bf16", 128, "e4m3"),
           default_tile("bf16", 128, wide=True)),
    "default": DEFAULT,
    "deep": DEEP,
    # every valid tile shape, for side-by-side timing
    "tune": _tune_space(),
}
