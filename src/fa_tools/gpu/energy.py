"""The GPU's total energy counter (NVML, millijoules since the driver loaded): read before and
after a run of calls, it gives the energy per call beside the cycles and the time.

NVML comes from the `pynvml` module (nvidia-ml-py) when it imports, else from libnvidia-ml.so.1
through ctypes. Where neither works, or the GPU has no such counter, `open_counter` says why
and nothing is measured (None): never a made-up number. The counter is updated by the driver
at its own pace (tens of milliseconds apart on some GPUs), so `granularity` polls it for a
moment and reports the smallest step and the time between updates: a window shorter than a
few updates cannot be resolved by it.
"""

from __future__ import annotations

import ctypes
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

_NVML_SUCCESS = 0


class EnergyUnavailable(RuntimeError):
    """NVML or its energy counter cannot be used here (the message says why)."""


@dataclass
class Counter:
    """One GPU's energy counter: read() gives millijoules, or None if a read fails."""

    reader: Callable[[], int]
    source: str  # "pynvml" or "ctypes libnvidia-ml.so.1"

    def read(self) -> int | None:
        try:
            return int(self.reader())
        except Exception:  # a failed read is no data, never an exception in a measurement
            return None


class Window:
    """Energy over a run of calls: start() before them, stop(calls) after they finished (the
    stream synchronised); per_call is then millijoules per call, or None."""

    def __init__(self, counter: Counter | None):
        self.counter = counter
        self._start: int | None = None
        self.per_call: float | None = None

    def start(self) -> None:
        self._start = self.counter.read() if self.counter else None

    def stop(self, calls: int) -> None:
        end = self.counter.read() if self.counter else None
        if self._start is None or end is None or calls <= 0 or end < self._start:
            self.per_call = None
            return
        self.per_call = (end - self._start) / calls


def _device_uuid() -> str | None:
    """The NVML UUID ("GPU-...") of torch's current device, when torch knows it."""
    try:
        import torch

        uuid = torch.cuda.get_device_properties(torch.cuda.current_device()).uuid
    except Exception:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def _pynvml_counter(uuid: str | None) -> Counter:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    if uuid is not None:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())  # bytes: every version
    elif pynvml.nvmlDeviceGetCount() == 1:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    else:
        raise EnergyUnavailable("cannot tell which NVML device is torch's (no UUID)")
    counter = Counter(lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), "pynvml")
    pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)  # raises where unsupported
    return counter


def _ctypes_counter(uuid: str | None) -> Counter:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as exc:
        raise EnergyUnavailable(f"libnvidia-ml.so.1 does not load: {exc}") from exc

    def check(code: int, what: str) -> None:
        if code != _NVML_SUCCESS:
            raise EnergyUnavailable(f"NVML {what} failed with error {code}")

    check(lib.nvmlInit_v2(), "nvmlInit_v2")
    handle = ctypes.c_void_p()
    if uuid is not None:
        check(lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)),
              "nvmlDeviceGetHandleByUUID")
    else:
        count = ctypes.c_uint()
        check(lib.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
        if count.value != 1:
            raise EnergyUnavailable("cannot tell which NVML device is torch's (no UUID)")
        check(lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)),
              "nvmlDeviceGetHandleByIndex_v2")
    value = ctypes.c_ulonglong()

    def read() -> int:
        check(lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(value)),
              "nvmlDeviceGetTotalEnergyConsumption")
        return value.value

    read()  # raises where unsupported
    return Counter(read, "ctypes libnvidia-ml.so.1")


def open_counter() -> tuple[Counter | None, str]:
    """(the counter of torch's current GPU, "") or (None, why not)."""
    uuid = _device_uuid()
    reasons = []
    for name, make in (("pynvml", _pynvml_counter), ("ctypes", _ctypes_counter)):
        try:
            return make(uuid), ""
        except ImportError as exc:
            reasons.append(f"{name}: not installed ({exc})")
        except Exception as exc:  # NVML errors of either binding: unsupported, no permission
            reasons.append(f"{name}: {type(exc).__name__}: {exc}")
    return None, "; ".join(reasons)


@dataclass
class Granularity:
    """What polling the counter showed: how often its value changed and by how much."""

    supported: bool
    source: str = ""
    reason: str = ""
    poll_ms: float = 0.0
    reads: int = 0
    changes: int = 0
    step_mj_min: float | None = None  # smallest nonzero change between two reads
    interval_ms_min: float | None = None  # between two changes of the value
    interval_ms_median: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if not self.supported:
            return f"n/a ({self.reason})"
        if self.changes < 2:
            return (f"{self.source}: the counter changed {self.changes} time(s) in "
                    f"{self.poll_ms:.0f} ms of polling ({self.reads} reads)")
        return (f"{self.source}: smallest step {self.step_mj_min:g} mJ, updates every "
                f"{self.interval_ms_median:.1f} ms (median; shortest {self.interval_ms_min:.1f}"
                f" ms) over {self.poll_ms:.0f} ms of polling")


def changes_of(samples: list[tuple[float, int]]) -> tuple[list[float], list[int]]:
    """From (seconds, millijoules) reads in time order: the times at which the value changed
    and the sizes of those changes."""
    times, steps = [], []
    for (_, prev), (t, value) in itertools.pairwise(samples):
        if value != prev:
            times.append(t)
            steps.append(value - prev)
    return times, steps


def summarise(samples: list[tuple[float, int]], source: str) -> Granularity:
    times, steps = changes_of(samples)
    intervals = [1e3 * (b - a) for a, b in itertools.pairwise(times)]
    span = 1e3 * (samples[-1][0] - samples[0][0]) if len(samples) > 1 else 0.0
    positive = [s for s in steps if s > 0]
    return Granularity(True, source, poll_ms=span, reads=len(samples), changes=len(times),
                       step_mj_min=min(positive) if positive else None,
                       interval_ms_min=min(intervals) if intervals else None,
                       interval_ms_median=statistics.median(intervals) if intervals else None)


def granularity(counter: Counter | None, reason: str = "", poll_s: float = 0.2
                ) -> Granularity:
    """Poll the counter as fast as it answers for poll_s seconds."""
    if counter is None:
        return Granularity(False, reason=reason or "no energy counter")
    samples: list[tuple[float, int]] = []
    end = time.perf_counter() + poll_s
    while (now := time.perf_counter()) < end:
        value = counter.read()
        if value is None:
            return Granularity(False, counter.source, reason="a read of the counter failed")
        samples.append((now, value))
    return summarise(samples, counter.source)
