"""Choosing a kernel for a call: a tuning file if one exists and names a built kernel, else the
default tables by dtype, d_head, features and sequence length, else any built kernel of that
dtype and d_head that has the features the call needs (a kernel with masks also serves unmasked
calls; a softcap kernel serves only softcap calls).

Features: ``mask`` (causal or a sliding window), ``softcap``. The default tables are data: the
rows of SM80_ROWS and SM90_ROWS, one decision each with a one-line reason. docs/dispatch.md
holds the measurements behind every row and names the results file that measured it
(tests/test_dispatch_docs.py keeps the two in step). DEFAULT_TABLE and SM90_TABLE expand the
rows per dtype, d_head variant (32, 64, ..., 256; a call's d_head maps to the smallest variant
not below it) and features.

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
from dataclasses import dataclass
from pathlib import Path

from .config import D_HEADS, DTYPES, ConfigError, KernelConfig, variant_for
from .config_sm90 import D_HEADS as SM90_D_HEADS
from .config_sm90 import Sm90Config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    """One decision of a default table: calls of the kinds in ``calls`` at the d_head variants
    ``d_heads`` with seqlen_q up to ``max_seq`` (None: longer than the key's other rows) run
    ``kernel``. ``key`` names the row in docs/dispatch.md, which holds the measurements behind
    ``why``."""

    key: str
    calls: tuple[str, ...]
    d_heads: tuple[int, ...]
    max_seq: int | None
    kernel: str
    why: str


# sm80 family: runs on every GPU, and where a Hopper kernel cannot. Kernel: the short form after
# "<dtype>_d<variant>_"; masked calls run it with flag m, softcap calls with flag t (both: mt).
ANY = ("plain", "masked", "softcap")
NO_SOFTCAP = ("plain", "masked")
SM80_ROWS = (
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

# Hopper (sm_90a): the binding runs these on sm_90 GPUs for fixed-length calls whose tensors TMA
# can address (16-byte aligned, strides multiples of 8 elements), else the sm80 row of the call.
# Kernel: the short form after "sm90_<dtype>_". A call's d_head variant runs on the next Hopper
# d_head (columns past it zero-filled by TMA, never stored); d_head 32 and softcap calls have no
# Hopper row. Calls: "plain"; "masked" (causal or a window open on the left); "local" (a window
# bounded on the left, which runs the masked row's kernel when its own is not built).
SM90_ROWS = (
    Row("sm90 plain d64 q<=4096", ("plain",), (64,), 4096, "d64_c96_g3_s3_fwesn",
        "3 consumer warpgroups, persistent; the tile hand-over (n) saves cycles in every row"),
    Row("sm90 plain d64 q>4096", ("plain",), (64,), None, "d64_c96_g3_s3_fwesnqr",
        "Q in registers and the lazy rescale gain 3-4% from 8192, lose at 1024-2048"),
    Row("sm90 plain d128 q<=512", ("plain",), (96, 128), 512, "d128_c128_g2_s2_fwes",
        "CTA pairs, and Q in registers with the lazy rescale, lose at 512"),
    Row("sm90 plain d128 q<=2048", ("plain",), (96, 128), 2048, "d128_c128_g2_s2_fwesxqr",
        "CTA pairs multicasting K/V buy clock at 1024-2048; q and r cut cycles"),
    Row("sm90 plain d128 q>2048", ("plain",), (96, 128), None, "d128_c128_g2_s2_fwoesqr",
        "from 4096 one CTA per tile with overlap, q and r needs 5-6% fewer cycles than pairs"),
    Row("sm90 plain d256", ("plain",), (160, 192, 224, 256), None, "d256_c64_g2_s2_fwpoer",
        "ping-pong, overlap and the lazy rescale; no room for the persistent grid's O buffer"),
    Row("sm90 masked d64", ("masked",), (64,), None, "d64_c96_g3_s3_fwesdm",
        "the dynamic tile schedule evens out the uneven causal tiles over the SMs"),
    Row("sm90 masked d128 q<=2048", ("masked",), (96, 128), 2048, "d128_c128_g2_s2_fwesdm",
        "dynamic schedule; q and r save cycles but cost time at 1024-2048"),
    Row("sm90 masked d128 q<=4096", ("masked",), (96, 128), 4096, "d128_c128_g2_s2_fwesdqrm",
        "q and r: fewer cycles, and the time follows at 4096"),
    Row("sm90 masked d128 q>4096", ("masked",), (96, 128), None, "d128_c128_g2_s2_fwoesdqrm",
        "intra-warpgroup overlap on top leads by 3-5% from 8192"),
    Row("sm90 masked d256", ("masked",), (160, 192, 224, 256), None, "d256_c64_g2_s2_fwpoem",
        "ping-pong and overlap beat the plain masked tile; no room for the O buffer"),
    Row("sm90 local d64", ("local",), (64,), None, "d64_c96_g3_s3_fwesm",
        "persistent grid: a window's query blocks cost about the same (as at d_head 128)"),
    Row("sm90 local d128", ("local",), (96, 128), None, "d128_c128_g2_s2_fwoesqrm",
        "static persistent schedule with overlap, q and r: fewest cycles per window tile"),
    Row("sm90 local d256", ("local",), (160, 192, 224, 256), None, "d256_c64_g2_s2_fwpoem",
        "the masked row's kernel: no room for the persistent grid's O buffer"),
)


def _rows_for(rows: Sequence[Row], calls: str, d_head: int) -> list[Row]:
    """The rows of a table that serve these calls at this d_head variant, shortest first."""
    mine = [row for row in rows if calls in row.calls and d_head in row.d_heads]
    return sorted(mine, key=lambda row: (row.max_seq is None, row.max_seq or 0))


# Config flag letters of each (mask, softcap) feature set.
FEATURES = {(False, False): "", (True, False): "m", (False, True): "t", (True, True): "mt"}

# (dtype, d_head variant, mask, softcap) -> [(largest seqlen_q it serves or None, config)]
DEFAULT_TABLE: dict[tuple[str, int, bool, bool], list[tuple[int | None, str]]] = {
    (dtype, d, mask, softcap): [
        (row.max_seq, f"{dtype}_d{d}_{row.kernel}{letters}")
        for row in _rows_for(SM80_ROWS, "softcap" if softcap else "masked" if mask else "plain", d)
    ]
    for dtype in DTYPES
    for d in D_HEADS
    for (mask, softcap), letters in FEATURES.items()
}

# (mask, local) of a call -> its name in SM90_ROWS: no mask; causal or a window open on the
# left; a window bounded on the left (``local`` implies ``mask``).
MASK_KINDS = {(False, False): "plain", (True, False): "masked", (True, True): "local"}

# (dtype, d_head variant of the call, mask, local, softcap) -> rows as DEFAULT_TABLE's
SM90_TABLE: dict[tuple[str, int, bool, bool, bool], list[tuple[int | None, str]]] = {
    (dtype, d, mask, local, False): [(row.max_seq, f"sm90_{dtype}_{row.kernel}")
                                     for row in _rows_for(SM90_ROWS, calls, d)]
    for dtype in DTYPES
    for d in D_HEADS
    for (mask, local), calls in MASK_KINDS.items()
    if _rows_for(SM90_ROWS, calls, d)
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
