"""Choosing a kernel for a call: a tuning file if one exists and names a built kernel, else the
default table by dtype, d_head, features and sequence length, else any built kernel of that
dtype and d_head that has the features the call needs (a kernel with masks also serves unmasked
calls; a softcap kernel serves only softcap calls).

Features: ``mask`` (causal or a sliding window), ``softcap``. The default table has, per dtype
and d_head variant (32, 64, ..., 256; a call's d_head maps to the smallest variant not below
it), the plain kernels, the same tiles with masks, and the long-sequence tile with a softcap,
with and without masks.

The d_head 64 and 128 tiles come from a sweep of the tune set on an H200 (docs/results.md):
B_r=128 with 4 warps and B_c=64 win at every measured length. At d_head 64 the table keeps Q
resident in registers (no slice_q): 314 TFLOP/s against 316 for B_c=128, which spills 16 bytes;
default kernels must not spill. Very short query sequences (<= 64 rows) use B_r=64. The other
variants use the first spill-free tile of the same shape (8 warps above d_head 128), not yet
swept: on an H100 d_head 96 runs at 0.93-0.99x and 256 at 0.82-0.95x SDPA FA2.

The tuning file (written by ``python -m flash_attention.autotune``) is JSON:
``{"version": 1, "device": "...", "entries": {"bf16/d128/q4096": "<short form>", ...}}`` where
the ``q`` bucket is seqlen_q rounded up to a power of two (64 .. 16384), with ``/m``, ``/t`` or
``/mt`` appended for calls with masks and/or a softcap. Its path is
$FLASH_ATTENTION_TUNING_FILE, else ~/.cache/flash_attention/tuning.json. It is read once per
process (``reload_tuning()`` reads it again). The API does not call :func:`select` per call:
flash_attention.ops computes the choice for every (dtype, d_head, bucket, features) once and
hands the table to the extension, which looks a call's kernel up in C++.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .config import D_HEADS, ConfigError, KernelConfig, variant_for
from .config_sm90 import D_HEADS as SM90_D_HEADS
from .config_sm90 import Sm90Config

log = logging.getLogger(__name__)

# The long-sequence tile of each d_head variant: B_r=128, B_c=64; 4 warps up to d_head 128 (at
# d_head 64 with Q resident in registers), 8 warps above (one m16 tile of rows per warp keeps
# the O accumulators of d_head 256 at 128 registers, and the swizzled copy of a 256-wide row
# needs 256 threads). All spill-free on sm_80 and sm_90.
_LONG = {32: "r128_c64_w4_fseqkvbor", 64: "r128_c64_w4_fsekvbor", 96: "r128_c64_w4_fseqkvbor",
         128: "r128_c64_w4_fseqkvbor", 160: "r128_c64_w8_fseqkvbor",
         192: "r128_c64_w8_fseqkvbor", 224: "r128_c64_w8_fseqkvbor",
         256: "r128_c64_w8_fseqkvbor"}


def _rows(dtype: str, d: int, features: str) -> list[tuple[int | None, str]]:
    long = f"{dtype}_d{d}_{_LONG[d]}{features}"
    if "t" in features or d > 128:  # softcap, and the 8-warp variants: one tile for all lengths
        return [(None, long)]
    return [(64, f"{dtype}_d{d}_r64_c64_w4_fseqkvbor{features}"), (None, long)]


# Config flag letters of each (mask, softcap) feature set.
FEATURES = {(False, False): "", (True, False): "m", (False, True): "t", (True, True): "mt"}

# (dtype, d_head variant, mask, softcap) -> [(largest seqlen_q it serves or None, config)]
DEFAULT_TABLE: dict[tuple[str, int, bool, bool], list[tuple[int | None, str]]] = {
    (dtype, d, mask, softcap): _rows(dtype, d, letters)
    for dtype in ("fp16", "bf16")
    for d in D_HEADS
    for (mask, softcap), letters in FEATURES.items()
}

# Hopper (sm_90a) kernels: (dtype, d_head variant of the call, mask, local, softcap) -> rows
# [(largest seqlen_q bucket it serves or None, config)], as DEFAULT_TABLE. The
# binding runs them on sm_90 GPUs for fixed-length calls whose tensors TMA can address (16-byte
# aligned, strides multiples of 8 elements) and otherwise the sm80 choice of the same row.
# Tiles from a sweep of the sm90tune set on an H100 (bf16, docs/results.md, 2026-11-23): a
# producer warpgroup and the TMA-store epilogue everywhere. Timed at the steady state under the
# 700 W power limit (bench's sustained timing), ping-pong and intra-warpgroup overlap change
# d_head 64 and 128 by less than the 1-2% spread, and gain 7% at 256 (1.01x cuDNN against
# 0.94x). A persistent grid gains 5-7% at d_head 64 (B_r = 192, 3 consumer warpgroups) and 1%
# at 128 over 2048-8192, but lost 5-8% under causal masks with a static round-robin of the
# uneven tiles; with the dynamic schedule (flag d: a global tile counter, heaviest query blocks
# first in L2-sized groups of heads) causal d_head 128 runs at 1.02-1.13x cuDNN causal against
# 0.89-1.04x for the non-persistent kernel (H100, 1024-16384, both dtypes,
# results/2026-11-23-h100-causal-dynamic-ab.md), and d_head 64 causal at 0.85-1.02x against
# 0.68-1.00x (results/2026-11-23-h100-causal-dynamic-d64-ab.md). d_head 256 has no room for the
# persistent grid's O buffer. CTA pairs multicasting K/V (flag x), d_head 128: +2.3 to +8.0% at
# 2048, -1.2 to +5.4% at 1024, -1.1 to +2.0% from 4096, -6% at 512 (H100, two runs, both dtypes,
# results/2026-11-23-h100-cluster-ab.md); at 64 and 256 they lose 5-7%. With intra-warpgroup
# overlap the dynamic causal kernel leads by 3-5% from 8192 (results/2026-11-23-h100-causal-
# dynamic-ab.md), the one without by 1-9% below. The tile hand-over (flag n: the next tile's
# S_0 and softmax under the current tile's last P V) needs fewer SM cycles at d_head 64 in every
# row measured (H100, 2048-16384: +0.2 to +0.5% in the run of the final code, both dtypes; +2 to
# +5% in a first run, bf16), time within the rows' spread; at d_head 128 it gains nothing (two
# warpgroups already fill each other's tile changes; results/2026-11-23-h100-tile-overlap-*).
# Q in registers (flag q) and the lazy rescale (flag r) together take 6-7% off the SM cycles of
# the d_head 128 kernels (ours/cuDNN in cycles 1.003-1.012 against 0.938-0.942 for fwesx, H100,
# bf16, 2048-16384; time 0.977 / 1.060 / 1.049 / 1.072x cuDNN against 0.969 / 0.994 / 0.982 /
# 1.021; fp16 1.011 / 1.055 at 2048 / 8192 against 1.050 / 1.006; each alone gives about half),
# the sliding window's too (1.058 of its visible share in cycles against 1.117). The lazy
# rescale alone gives d_head 256 8-10% (1.091 / 1.125x cuDNN at 4096 / 8192 against 1.012 /
# 1.020); at d_head 64 both together gain 3-4% from 8192 and lose 2-5% at 1024-2048, and under
# causal masks at 2048 (results/2026-11-23-h100-q-regs-lazy-rescale.md). Causal d_head 128 at
# 1024 and 2048 kept the plain dynamic kernel: fewer cycles with q and r, but 2-8% more time.
# Intra-warpgroup overlap on top (fwoesxqr) needs 2-3% fewer cycles from 2048 and is 1.5-3%
# faster from 8192 (bf16 and fp16, three comparisons in two calls), 2.6-5% slower at 1024-4096.
# From 4096 one CTA per tile with all of that (fwoesqr, static) needs 5-6% fewer SM cycles than
# the pairs (ours/cuDNN in cycles 1.086-1.101 against 1.028-1.040, both dtypes) and runs at
# 1.075-1.102x cuDNN in time against 1.060-1.084 for fwoesxqr and 1.067-1.069 for fwesxqr (two
# calls, 3 and 5 rounds; the pairs' multicast buys clock under the power limit, not cycles);
# at 2048 it loses 1-7% (results/2026-11-23-h100-window-tile-cost.md).
_SM90_PLAIN = {64: [(4096, "c96_g3_s3_fwesn"), (None, "c96_g3_s3_fwesnqr")],
               128: [(512, "c128_g2_s2_fwes"), (2048, "c128_g2_s2_fwesxqr"),
                     (None, "c128_g2_s2_fwoesqr")],
               256: [(None, "c64_g2_s2_fwpoer")]}
_SM90_MASKED = {64: [(None, "c96_g3_s3_fwesdm")],
                128: [(2048, "c128_g2_s2_fwesdm"), (4096, "c128_g2_s2_fwesdqrm"),
                      (None, "c128_g2_s2_fwoesdqrm")],
                256: [(None, "c64_g2_s2_fwpoem")]}
# Sliding windows (a bounded left side, ``local`` calls): every query block visits about the same
# number of KV blocks, so the persistent grid pays again (H100, 8 x 8192, window (1024, 1024):
# 1.097x the visible fraction of the full time against 1.184x without it). At d_head 128 the
# dynamic schedule evens out the lighter query blocks at the sequence ends: 1.178 [1.173, 1.203]
# against 1.224 [1.160, 1.247] for the static one in the same rounds (H100, 3 rounds,
# results/2026-11-23-h100-edge-halves.md); 1.157 against 1.251 in a second run, and 1.120-1.126
# in SM cycles in five more (results/2026-11-23-h100-targets-and-masks.md). With flags q and r
# the window needs 1.058-1.060 of the old full kernel's cycles for its share, 1.131-1.138 of the
# new one's (which gained more); with intra-warpgroup overlap too 1.101-1.102 against 1.136-1.137
# in one run (5 rounds, both dtypes; time 1.214 / 1.202 against 1.291 / 1.264, the window
# kernels at 1366-1424 MHz against 1503-1560 for the full one; results/2026-11-23-h100-q-regs-
# lazy-rescale.md). CTA pairs multicasting the blocks both CTAs see (de41527, reverted) ran at
# higher clocks but needed 9-22% more cycles (results/2026-11-23-h100-gemm-in-rounds.md). The
# static schedule with overlap (fwoesqrm) needs 1.1-1.6% fewer cycles than the dynamic one at
# windows (256, 256) to (2048, 2048) (H100, 8 x 8192, three calls, both dtypes; time within the
# clocks' spread: results/2026-11-23-h100-window-tile-cost.md, which also splits the cost of a
# tile: about 4700 cycles besides its blocks, of which the edge masks 1560 and the epilogue 1370).
_SM90_LOCAL = {64: [(None, "c96_g3_s3_fwesm")], 128: [(None, "c128_g2_s2_fwoesqrm")],
               256: [(None, "c64_g2_s2_fwpoem")]}
# The d_head variants between run on the next Hopper variant (columns past d_head zero-filled by
# TMA, never stored): 96 on 128, 160-224 on 256 (32 stays on sm80: d_head 32 on the 64 kernel
# measured 0.94x SDPA FA2 at seq 1024).
_SM90_OF_VARIANT = {64: 64, 96: 128, 128: 128, 160: 256, 192: 256, 224: 256, 256: 256}
# (mask, local) of a call: no mask; causal or a window open on the left; a window bounded on the
# left (``local`` implies ``mask``).
MASK_KINDS = ((False, False), (True, False), (True, True))
_SM90_TILES = {(False, False): _SM90_PLAIN, (True, False): _SM90_MASKED,
               (True, True): _SM90_LOCAL}
SM90_TABLE: dict[tuple[str, int, bool, bool, bool], list[tuple[int | None, str]]] = {
    (dtype, d, mask, local, False): [(max_seq, f"sm90_{dtype}_d{hd}_{tile}")
                                     for max_seq, tile in _SM90_TILES[mask, local][hd]]
    for dtype in ("fp16", "bf16")
    for d, hd in _SM90_OF_VARIANT.items()
    for mask, local in MASK_KINDS
}

MIN_BUCKET, MAX_BUCKET = 64, 16384
BUCKETS = tuple(MIN_BUCKET << i for i in range((MAX_BUCKET // MIN_BUCKET).bit_length()))


def seq_bucket(seqlen_q: int) -> int:
    bucket = MIN_BUCKET
    while bucket < seqlen_q and bucket < MAX_BUCKET:
        bucket *= 2
    return bucket


def tuning_key(dtype: str, d_head: int, seqlen_q: int, mask: bool = False,
               softcap: bool = False) -> str:
    letters = FEATURES[(mask, softcap)]
    return f"{dtype}/d{d_head}/q{seq_bucket(seqlen_q)}" + (f"/{letters}" if letters else "")


def tuning_file_path() -> Path:
    env = os.environ.get("FLASH_ATTENTION_TUNING_FILE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "flash_attention" / "tuning.json"


def _load_tuning(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
        if data.get("version") != 1 or not isinstance(entries, dict):
            raise ValueError("unknown format")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring tuning file %s: %s", path, exc)
        return {}
    return {str(k): str(v) for k, v in entries.items()}


_tuning: dict[str, str] | None = None


def tuning_entries() -> dict[str, str]:
    global _tuning
    if _tuning is None:
        _tuning = _load_tuning(tuning_file_path())
    return _tuning


def reload_tuning() -> dict[str, str]:
    """Forget the cached tuning file (after writing a new one or changing the path) and
    recompute the extension's dispatch table from the new one."""
    global _tuning
    _tuning = None
    entries = tuning_entries()
    ops = sys.modules.get(f"{__package__}.ops")
    if ops is not None:  # the extension's dispatch table follows the new choices
        ops.refresh_dispatch()
    return entries


def sm90_variant_for(d_head: int) -> int | None:
    """The Hopper d_head variant that serves d_head (64, 128 or 256), or None."""
    if variant_for(d_head) is None:
        return None
    return next(v for v in SM90_D_HEADS if v >= d_head)


def serves(cfg: KernelConfig | Sm90Config, dtype: str, d_head: int, mask: bool,
           softcap: bool) -> bool:
    """Is cfg dispatch's kind of kernel for this call? Its d_head is the call's variant (a
    larger variant would run it too, but slower); masks serve unmasked calls too; a softcap
    kernel only softcap calls."""
    variant = sm90_variant_for(d_head) if cfg.family == "sm90" else variant_for(d_head)
    return (cfg.dtype == dtype and cfg.d_head == variant and cfg.softcap == softcap
            and (cfg.mask or not mask))


def select_sm90(dtype: str, d_head: int, seqlen_q: int, built: Sequence[KernelConfig | Sm90Config],
                mask: bool = False, softcap: bool = False,
                local: bool = False) -> Sm90Config | None:
    """The Hopper kernel for this problem among the built ones (a tuned one first, then
    SM90_TABLE), or None: the sm80 choice runs everywhere then. ``local``: a sliding window
    bounded on the left (implies ``mask``); a tuning entry of the masked row serves it too."""
    by_name = {c.short: c for c in built if c.family == "sm90"}
    if not by_name:
        return None
    variant = variant_for(d_head) or d_head
    tuned = tuning_entries().get(tuning_key(dtype, variant, seqlen_q, mask, softcap))
    if tuned is not None:
        if tuned in by_name and serves(by_name[tuned], dtype, d_head, mask, softcap):
            return by_name[tuned]
        if not tuned.startswith("sm90_"):
            return None  # the tuning file chose an sm80 kernel for this row
    kinds = [(mask, True), (mask, False)] if local and mask else [(mask, False)]
    for mask_kind, local_kind in kinds:  # a window runs on the masked kernel when its own is absent
        rows = SM90_TABLE.get((dtype, variant, mask_kind, local_kind, softcap), [])
        # The row of this length first, then any other built one of the same kind.
        rows = sorted(rows, key=lambda row: row[0] is not None and seqlen_q > row[0])
        for _, short in rows:
            cfg = by_name.get(short)
            if cfg is not None and serves(cfg, dtype, d_head, mask, softcap):
                return cfg
    return None


def select(dtype: str, d_head: int, seqlen_q: int, built: Sequence[KernelConfig | Sm90Config],
           mask: bool = False, softcap: bool = False) -> KernelConfig:
    """The sm80-family config to run for this problem among the built ones (d_head: the
    call's; the table is by variant): what runs on any GPU, and the fallback of a Hopper
    kernel (select_sm90)."""
    variant = variant_for(d_head)
    if variant is None:
        raise ConfigError(f"d_head={d_head} is not a multiple of 8 up to {D_HEADS[-1]}")
    d_head = variant
    built = [c for c in built if c.family == "sm80"]
    by_name = {c.short: c for c in built}
    tuned = tuning_entries().get(tuning_key(dtype, d_head, seqlen_q, mask, softcap))
    if tuned is not None:
        if tuned in by_name and serves(by_name[tuned], dtype, d_head, mask, softcap):
            return by_name[tuned]
        log.debug("tuned config %s is not in this build or cannot serve the call; using the "
                  "default table", tuned)
    for max_seq, short in DEFAULT_TABLE.get((dtype, d_head, mask, softcap), []):
        if (max_seq is None or seqlen_q <= max_seq) and short in by_name:
            return by_name[short]
    candidates = [c for c in built if serves(c, dtype, d_head, mask, softcap)]
    if candidates:  # exact features first: masks cost a little when none is needed
        return min(candidates, key=lambda c: c.mask != mask)
    need = " and ".join(filter(None, ["masks (causal / window)" if mask else "",
                                      "a softcap" if softcap else ""]))
    raise ConfigError(
        f"this build has no kernel for {dtype} with d_head={d_head}"
        + (f" with {need}" if need else "")
        + "; rebuild with FLASH_ATTENTION_KERNELS=default (or name a config) and "
        "`pip install --no-build-isolation -e .`"
    )
