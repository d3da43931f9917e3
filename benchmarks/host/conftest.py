"""Host-side cost benchmarks (pytest-benchmark). Run with `nox -s hostbench` or
`PYTHONPATH=src pytest benchmarks/host`. Not under tests/, so the test run does not time them.

GPU benchmarks carry the `gpu` marker and are skipped, with the reason printed in the header
and the summary, on a machine without a CUDA GPU of compute capability 8.0+. The header also
names the flash_attention tree being measured: when the gate times a base commit, this same
code runs against the base's src (PYTHONPATH), and the header shows which one was imported.
"""

from __future__ import annotations

import os

import pytest

# Dispatch must not depend on a tuning file of whoever runs the benchmarks: the default table.
os.environ.setdefault("FLASH_ATTENTION_TUNING_FILE", "/nonexistent/hostbench-no-tuning.json")

# Volatile fields of pytest-benchmark's machine_info; left in, every comparison warns that the
# machine differs (the measured clock changes from run to run on the same machine).
_VOLATILE_CPU_KEYS = ("hz_actual", "hz_actual_friendly")


def gpu_skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"{torch.cuda.get_device_name()} is sm_{major}{minor}; the kernels need sm_80+"
    return None


def _measured_tree() -> str:
    import flash_attention

    return os.path.dirname(os.path.abspath(flash_attention.__file__))


def pytest_report_header(config):
    reason = gpu_skip_reason()
    gpu = f"skipped ({reason})" if reason else "on the GPU"
    if not reason:
        import torch

        gpu = f"on {torch.cuda.get_device_name()} (torch {torch.__version__})"
    return [f"host benchmarks of flash_attention from {_measured_tree()}",
            f"GPU benchmarks: {gpu}"]


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU benchmark: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_benchmark_update_machine_info(config, machine_info):
    import torch

    cpu = machine_info.get("cpu") or {}
    for key in _VOLATILE_CPU_KEYS:
        cpu.pop(key, None)
    machine_info["torch"] = torch.__version__
    machine_info["gpu"] = torch.cuda.get_device_name() if gpu_skip_reason() is None else None


def pytest_benchmark_update_commit_info(config, commit_info):
    # commit_info comes from git in the working directory; this says which source was imported
    commit_info["flash_attention_path"] = _measured_tree()


@pytest.fixture(scope="session")
def host_costs(pytestconfig) -> dict[str, float]:
    """Median seconds per call of each GPU contender measured in this session, so that the
    attention() benchmark can record its ratio to SDPA measured in the same run (and the
    summary can print it)."""
    pytestconfig._hostbench_costs = {}
    return pytestconfig._hostbench_costs


def pytest_terminal_summary(terminalreporter):
    costs = getattr(terminalreporter.config, "_hostbench_costs", None)
    if costs and "sdpa" in costs and "attention" in costs:
        ours, sdpa = costs["attention"], costs["sdpa"]
        terminalreporter.write_line(f"host cost per call: attention() {ours * 1e6:.2f} us, "
                                    f"SDPA {sdpa * 1e6:.2f} us, ratio ours/SDPA {ours / sdpa:.3f}")
