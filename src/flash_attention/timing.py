"""GPU timing with CUDA events on the current stream: warm-up, then one event pair around each
call, median of the repeats. Shared by autotune and the benchmark harness.

Before the timed calls the stream is held busy (a device-side sleep) while the host enqueues
them all, so the events measure back-to-back GPU time and not the host's per-call overhead
(Python validation, dispatch), which would otherwise open gaps between short kernels."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_cuda_ms(fn: Callable[[], object], reps: int = 30, warmup: int = 5) -> list[float]:
    """Milliseconds of each of `reps` calls of fn (after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(2_000_000 + 100_000 * reps)  # cycles: ~1 ms + 50 us per call
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record(stream)
        fn()
        end.record(stream)
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def median_ms(fn: Callable[[], object], reps: int = 30, warmup: int = 5) -> float:
    return statistics.median(time_cuda_ms(fn, reps, warmup))


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, d_head: int,
                    causal: bool = False, window_size: tuple[int, int] | None = None) -> float:
    """Forward FLOPs: two matmuls of 2*Sq*Sk*D each per (batch, head), halved for causal (the
    convention for Sq == Sk). With a window (or causal with Sq != Sk, aligned bottom-right) the
    pairs the mask leaves visible are counted instead (masks.visible_pairs)."""
    window = (-1, -1) if window_size is None else tuple(window_size)
    if window == (-1, -1) and (not causal or seqlen_q == seqlen_k):
        return 4.0 * batch * heads * seqlen_q * seqlen_k * d_head / (2 if causal else 1)
    from .masks import canonical_window, visible_pairs

    left, right = canonical_window(causal, window, seqlen_q, seqlen_k)
    return 4.0 * batch * heads * d_head * visible_pairs(seqlen_q, seqlen_k, left, right)
