"""Per-call host cost of attention() on a tiny problem, with SDPA on the same tensors as the
reference, timed in the same run (GPU only; skipped with the reason elsewhere).

(batch, seq, heads, d_head) = (1, 128, 8, 64), bf16: the kernel takes a few microseconds, less
than the host needs to validate, dispatch and launch a call, so calls queued back to back
measure the host. Each round queues CALLS_PER_ROUND calls (pytest-benchmark's pedantic mode
with iterations) and synchronises once, at its end: the timer synchronises the device before
reading the clock, so a round's time covers every call it queued having run, and the figure
is wall time per call. SDPA gets the same q, k, v seen as (batch, heads, seq, d_head) through
transposed views made once, outside the timing, and its FLASH_ATTENTION backend (FA2's code).
The attention() benchmark records its ratio to SDPA's median (`ratio_to_sdpa` in extra_info).
"""

from __future__ import annotations

import time

import pytest
import torch

SHAPE = (1, 128, 8, 64)
CALLS_PER_ROUND = 200
ROUNDS = 40
WARMUP_ROUNDS = 3


def synced_clock() -> float:
    """perf_counter after the device has finished the work queued so far."""
    torch.cuda.synchronize()
    return time.perf_counter()


@pytest.fixture(scope="module")
def tiny_qkv():
    gen = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(SHAPE, dtype=torch.bfloat16, device="cuda", generator=gen)
                 for _ in range(3))


def _contender(name: str, q, k, v):
    if name == "attention":
        import flash_attention as fa

        return lambda: fa.attention(q, k, v)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(qt, kt, vt)


@pytest.mark.gpu
@pytest.mark.benchmark(group="gpu-call-cost", timer=synced_clock, disable_gc=True)
@pytest.mark.parametrize("name", ["sdpa", "attention"])  # SDPA first: attention() reads it
def test_call_cost(benchmark, name, tiny_qkv, host_costs):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    call = _contender(name, *tiny_qkv)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # entered once, outside the timing
        out = benchmark.pedantic(call, rounds=ROUNDS, iterations=CALLS_PER_ROUND,
                                 warmup_rounds=WARMUP_ROUNDS)
    assert torch.isfinite(out).all()
    median = benchmark.stats.stats.median
    host_costs[name] = median
    benchmark.extra_info["calls_per_round"] = CALLS_PER_ROUND
    benchmark.extra_info["shape_bshd"] = list(SHAPE)
    if name == "attention" and "sdpa" in host_costs:
        benchmark.extra_info["sdpa_median_s"] = host_costs["sdpa"]
        benchmark.extra_info["ratio_to_sdpa"] = median / host_costs["sdpa"]
