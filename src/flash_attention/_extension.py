"""Loading the compiled extension lazily, so the package imports without it."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from types import ModuleType

BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e .` from the repository root "
    "(FLASH_ATTENTION_KERNELS chooses the kernel sets or configs, e.g. default,ci; "
    "FLASH_ATTENTION_ARCHS the GPUs, e.g. 80,90)"
)


class ExtensionNotBuilt(RuntimeError):
    """The CUDA extension flash_attention._C is missing or fails to load."""


@lru_cache(maxsize=1)
def extension() -> ModuleType:
    try:
        from . import _C  # type: ignore[attr-defined]
    except ImportError as exc:
        raise ExtensionNotBuilt(
            f"the flash_attention CUDA extension is not available ({exc}); {BUILD_HINT}"
        ) from exc
    return _C


def is_built() -> bool:
    try:
        extension()
    except ExtensionNotBuilt:
        return False
    return True


def build_info() -> dict | None:
    """What the build recorded (kernel selection, configs, archs, nvcc and torch versions)."""
    path = Path(__file__).with_name("build_info.json")
    return json.loads(path.read_text()) if path.exists() else None


def ptxas_log_path() -> Path:
    return Path(__file__).with_name("ptxas.log")
