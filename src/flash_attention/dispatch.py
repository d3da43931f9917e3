"""Choosing a kernel for a call: a tuning file if one exists and names a built kernel, else the
default table by dtype, d_head and sequence length, else any built kernel of that dtype and
d_head.

The default table comes from a sweep of the tune set on an H200 (docs/results.md): B_r=128
with 4 warps and B_c=64 win at every measured length. At d_head 64 the table keeps Q resident
in registers (no slice_q): 314 TFLOP/s against 316 for B_c=128, which spills 16 bytes; default
kernels must not spill. Very short query sequences (<= 64 rows) use B_r=64.

The tuning file (written by ``python -m flash_attention.autotune``) is JSON:
``{"version": 1, "device": "...", "entries": {"bf16/d128/q4096": "<short form>", ...}}`` where
the ``q`` bucket is seqlen_q rounded up to a power of two (64 .. 16384). Its path is
$FLASH_ATTENTION_TUNING_FILE, else ~/.cache/flash_attention/tuning.json. It is read once per
process (``reload_tuning()`` reads it again), so dispatch costs no file access per call.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .config import ConfigError, KernelConfig

log = logging.getLogger(__name__)

# (dtype, d_head) -> [(largest seqlen_q it serves or None for the rest, config short form)]
DEFAULT_TABLE: dict[tuple[str, int], list[tuple[int | None, str]]] = {
    (dtype, d): [
        (64, f"{dtype}_d{d}_r64_c64_w4_fseqkvbor"),
        (None, f"{dtype}_d{d}_r128_c64_w4_{'fseqkvbor' if d == 128 else 'fsekvbor'}"),
    ]
    for dtype in ("fp16", "bf16")
    for d in (64, 128)
}

MIN_BUCKET, MAX_BUCKET = 64, 16384


def seq_bucket(seqlen_q: int) -> int:
    bucket = MIN_BUCKET
    while bucket < seqlen_q and bucket < MAX_BUCKET:
        bucket *= 2
    return bucket


def tuning_key(dtype: str, d_head: int, seqlen_q: int) -> str:
    return f"{dtype}/d{d_head}/q{seq_bucket(seqlen_q)}"


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
    """Forget the cached tuning file (after writing a new one or changing the path)."""
    global _tuning
    _tuning = None
    return tuning_entries()


def select(dtype: str, d_head: int, seqlen_q: int, built: list[KernelConfig]) -> KernelConfig:
    """The config to run for this problem among the built ones."""
    by_name = {c.short: c for c in built}
    tuned = tuning_entries().get(tuning_key(dtype, d_head, seqlen_q))
    if tuned is not None:
        if tuned in by_name:
            return by_name[tuned]
        log.debug("tuned config %s is not in this build; using the default table", tuned)
    for max_seq, short in DEFAULT_TABLE.get((dtype, d_head), []):
        if (max_seq is None or seqlen_q <= max_seq) and short in by_name:
            return by_name[short]
    for cfg in built:
        if cfg.dtype == dtype and cfg.d_head == d_head:
            return cfg
    raise ConfigError(
        f"this build has no kernel for {dtype} with d_head={d_head}; rebuild with "
        "FLASH_ATTENTION_KERNELS=default (or name a config) and "
        "`pip install --no-build-isolation -e .`"
    )
