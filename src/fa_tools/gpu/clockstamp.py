"""SM clock cycles spent between two points of a CUDA stream: a one-thread-per-block kernel,
written in PTX here and loaded through the driver API (ctypes, no compiler needed), records
each block's SM id, %clock64 and %globaltimer. Two stamps around a run of calls give, per SM
seen in both, the cycles that passed; their median is the window's length in cycles, and
against the nanoseconds of %globaltimer the mean SM clock.

Why: on an H100 at its power limit the SM clock moves between levels tens of milliseconds
apart (1395-1815 MHz under the gate's load), so the time of 40 ms of calls depends on the
levels it happened to get: per-round medians of one unchanged kernel at 16 x 4096 spread over
3.64-4.30 ms, in steps of the clock (3.822, 4.068, 4.253 ms = 1785, 1680, 1605 MHz), while the
cycles per call of a compute-bound kernel stay put. The A/B gate compares cycles.
"""

from __future__ import annotations

import ctypes
import statistics

_PTX = b"""
.version 7.8
.target sm_80
.address_size 64

.visible .entry fa_clock_stamp(.param .u64 out)
{
    .reg .pred %p<2>;
    .reg .b32 %r<4>;
    .reg .b64 %rd<8>;
    mov.u32 %r1, %tid.x;
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra DONE;
    ld.param.u64 %rd1, [out];
    cvta.to.global.u64 %rd1, %rd1;
    mov.u32 %r2, %ctaid.x;
    mul.wide.u32 %rd2, %r2, 24;
    add.s64 %rd3, %rd1, %rd2;
    mov.u32 %r3, %smid;
    cvt.u64.u32 %rd4, %r3;
    mov.u64 %rd5, %clock64;
    mov.u64 %rd6, %globaltimer;
    st.global.u64 [%rd3], %rd4;
    st.global.u64 [%rd3+8], %rd5;
    st.global.u64 [%rd3+16], %rd6;
DONE:
    ret;
}
\x00"""

_state: dict = {}


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"CUDA driver call {what} failed with error {code}")


def _kernel():
    """(libcuda, CUfunction) of the stamp kernel in the current context, loaded once."""
    if "fn" not in _state:
        import torch

        torch.zeros(1, device="cuda")  # the runtime's primary context, current on this thread
        torch.cuda.synchronize()
        cuda = ctypes.CDLL("libcuda.so.1")
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(_PTX)),
               "cuModuleLoadData")
        _check(cuda.cuModuleGetFunction(ctypes.byref(fn), module, b"fa_clock_stamp"),
               "cuModuleGetFunction")
        _state.update(cuda=cuda, fn=fn,
                      blocks=2 * torch.cuda.get_device_properties(0).multi_processor_count)
    return _state["cuda"], _state["fn"]


class Stamps:
    """Stamps queued on the current stream: `mark()` before and after a run of calls, then,
    after a synchronize, `cycles()` and `mhz()` of the window between the first two marks."""

    def __init__(self):
        import torch

        cuda, fn = _kernel()
        self._cuda, self._fn = cuda, fn
        self._blocks = _state["blocks"]
        # every block writes its row, so no fill is needed (nor queued among the timed calls)
        self._buf = torch.empty((2, self._blocks, 3), dtype=torch.int64, device="cuda")
        self._marks = 0
        self._deltas: list[tuple[int, int]] | None = None

    def mark(self) -> None:
        import torch

        if self._marks >= 2:
            raise RuntimeError("Stamps: two marks per window")
        ptr = ctypes.c_uint64(self._buf[self._marks].data_ptr())
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(ptr), ctypes.c_void_p))
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(self._cuda.cuLaunchKernel(self._fn, self._blocks, 1, 1, 32, 1, 1, 0, stream,
                                         params, None), "cuLaunchKernel")
        self._marks += 1

    def _per_sm(self) -> list[tuple[int, int]]:
        """(cycles, nanoseconds) between the marks, per SM seen in both (read back once)."""
        if self._deltas is None:
            self._deltas = self._read()
        return self._deltas

    def _read(self) -> list[tuple[int, int]]:
        if self._marks != 2:
            raise RuntimeError("Stamps: mark() before and after the window")
        start, end = ({int(sm): (int(c), int(t)) for sm, c, t in rows}
                      for rows in self._buf.cpu().tolist())
        common = sorted(set(start) & set(end))
        if not common:
            raise RuntimeError("Stamps: no SM ran a block of both stamps")
        return [(end[sm][0] - start[sm][0], end[sm][1] - start[sm][1]) for sm in common]

    def cycles(self) -> float:
        return statistics.median(c for c, _ in self._per_sm())

    def mhz(self) -> float:
        return statistics.median(1e3 * c / t for c, t in self._per_sm() if t > 0)
