"""Choosing a kernel for a call: a tuning file if one exists and names a built kernel, else the
default tables by dtype, d_head, features and sequence length, else any built kernel of that
dtype and d_head that has the features the call needs (a kernel with masks also serves unmasked
calls; a softcap kernel serves only softcap calls).

Features: ``mask`` (causal or a sliding window), ``softcap``. The default tables are data: the
ROWS of each forward kind (flash_attention.kernels.fwd_sm80 and fwd_sm90), one decision each
with a one-line reason, which each kind's ``select`` reads. docs/dispatch.md holds the
measurements behind every row and names the results file that measured it
(tests/test_dispatch_docs.py keeps the two in step).

The tuning file (written by ``python -m flash_attention.autotune``) is JSON:
``{"version": 1, "device": "...", "entries": {"bf16/d128/q4096": "<kernel name>", ...}}`` where
the ``q`` bucket is seqlen_q rounded up to a power of two (64 .. 16384), with ``/m``, ``/t`` or
``/mt`` appended for calls with masks and/or a softcap. Names of the old scheme are read as
their current names (kernels.legacy). Its path is
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

from .kernels import Call, ConfigError, KernelConfig, fwd_sm80, fwd_sm90
from .kernels.fwd_sm80 import D_HEADS, variant_for
from .kernels.legacy import current_name

log = logging.getLogger(__name__)

# (mask, softcap) of each feature set of a call -> its flag letters
FEATURES = {(False, False): "", (True, False): "m", (False, True): "t", (True, True): "mt"}

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
    return {str(k): current_name(str(v)) for k, v in entries.items()}


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


def select_sm90(dtype: str, d_head: int, seqlen_q: int, built: Sequence[KernelConfig],
                mask: bool = False, softcap: bool = False,
                local: bool = False) -> fwd_sm90.Config | None:
    """The Hopper kernel for this problem among the built ones (a tuned one first, then
    fwd_sm90.select), or None: the sm80 choice runs everywhere then. ``local``: a sliding window
    bounded on the left (implies ``mask``); a tuning entry of the masked row serves it too."""
    call = Call(dtype, d_head, seqlen_q, mask, local, softcap)
    tuned = tuning_entries().get(tuning_key(dtype, variant_for(d_head) or d_head, seqlen_q, mask,
                                            softcap))
    if tuned is not None:
        cfg = next((c for c in built if c.name == tuned and isinstance(c, fwd_sm90.Config)), None)
        if cfg is not None and cfg.serves(call):
            return cfg
        if not tuned.startswith(fwd_sm90.KIND + "_"):
            return None  # the tuning file chose an sm80 kernel for this row
    return fwd_sm90.select(call, built)


def select_sm90_varlen(dtype: str, d_head: int, built: Sequence[KernelConfig],
                       mask: bool = False, softcap: bool = False,
                       local: bool = False) -> fwd_sm90.Config | None:
    """The Hopper kernel for varlen calls of this kind among the built ones
    (fwd_sm90.VARLEN_ROWS; no tuning file entry applies), or None (the sm80 choice runs
    them)."""
    return fwd_sm90.select_varlen(Call(dtype, d_head, 1, mask, local, softcap), built)


def select_sm90_one_wave(dtype: str, d_head: int, built: Sequence[KernelConfig],
                         mask: bool = False, softcap: bool = False,
                         local: bool = False) -> tuple[fwd_sm90.Config, ...]:
    """The built Hopper kernels that run a call of this kind when its tiles fit in one wave
    (fwd_sm90.ONE_WAVE_ROWS, in tier order; the extension checks the fit per call), or ()."""
    return fwd_sm90.select_one_wave(Call(dtype, d_head, 1, mask, local, softcap), built)


def select_sm90_key_pad(dtype: str, d_head: int, seqlen_q: int, built: Sequence[KernelConfig],
                        mask: bool = False, softcap: bool = False,
                        local: bool = False) -> fwd_sm90.Config | None:
    """The built Hopper kernel that runs a call of this kind and length when it pads the keys at
    least 1/8 less than the row's kernel (fwd_sm90.KEY_PAD_ROWS; the extension checks seqlen_k
    per call), or None."""
    return fwd_sm90.select_key_pad(Call(dtype, d_head, seqlen_q, mask, local, softcap), built)


def select(dtype: str, d_head: int, seqlen_q: int, built: Sequence[KernelConfig],
           mask: bool = False, softcap: bool = False) -> fwd_sm80.Config:
    """The sm80-family config to run for this problem among the built ones (a tuned one
    first, then fwd_sm80.select): what runs on any GPU, and the fallback of a Hopper kernel
    (select_sm90). ConfigError when the build has none."""
    variant = variant_for(d_head)
    if variant is None:
        raise ConfigError(f"d_head={d_head} is not a multiple of 8 up to {D_HEADS[-1]}")
    call = Call(dtype, d_head, seqlen_q, mask, False, softcap)
    tuned = tuning_entries().get(tuning_key(dtype, variant, seqlen_q, mask, softcap))
    if tuned is not None:
        cfg = next((c for c in built if c.name == tuned and isinstance(c, fwd_sm80.Config)), None)
        if cfg is not None and cfg.serves(call):
            return cfg
        log.debug("tuned config %s is not in this build or cannot serve the call; using the "
                  "default table", tuned)
    cfg = fwd_sm80.select(call, built)
    if cfg is not None:
        return cfg
    need = " and ".join(filter(None, ["masks (causal / window)" if mask else "",
                                      "a softcap" if softcap else ""]))
    raise ConfigError(
        f"this build has no kernel for {dtype} with d_head={variant}"
        + (f" with {need}" if need else "")
        + "; rebuild with FLASH_ATTENTION_KERNELS=default (or name a config) and "
        "`pip install --no-build-isolation -e .`"
    )
