"""GPU tests carry the `gpu` marker and are skipped, with the reason printed, on a machine
without a CUDA GPU of compute capability 8.0+. The extension is required (not skipped) when
FLASH_ATTENTION_REQUIRE_EXT=1, as in CI after the build."""

from __future__ import annotations

import os

import pytest
import torch


def gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"{torch.cuda.get_device_name()} is sm_{major}{minor}; the kernels need sm_80+"
    return None


def pytest_report_header(config):
    reason = gpu_skip_reason()
    if reason:
        return f"GPU tests: skipped ({reason})"
    return f"GPU tests: on {torch.cuda.get_device_name()} (torch {torch.__version__})"


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def require_extension():
    import flash_attention as fa

    if not fa.is_built():
        if os.environ.get("FLASH_ATTENTION_REQUIRE_EXT") == "1":
            pytest.fail("flash_attention._C is not built but FLASH_ATTENTION_REQUIRE_EXT=1")
        pytest.skip("flash_attention._C is not built (pip install --no-build-isolation -e .)")


@pytest.fixture
def require_sm90(require_extension):
    """The extension, on an sm_90 GPU (the Hopper kernels: varlen, FP8); else skipped."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{torch.cuda.get_device_name()} is not sm_90: the Hopper (sm_90a) kernels "
                    "run there alone")
