"""Backward timing on a GPU, side by side in one process: this project's sm80-family backward
(the flash_attention::bwd operator on the forward's saved out and LSE) against SDPA's FA2
backend (autograd.grad with the graph kept), bf16, 16 heads; the cost of deterministic=True;
and forward + backward through autograd (time against SDPA FA2, peak memory against SDPA FA2
and cuDNN). TFLOP/s count the backward as 2.5x the forward's FLOPs (halved for causal).

    PYTHONPATH=src python3 studies/backward_bench.py
"""

from __future__ import annotations

import os
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attention as fa
from flash_attention import ops


def time_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# Other tiles timed beside the default one (built with FLASH_ATTENTION_BWD_KERNELS naming them).
VARIANTS: dict[int, list[str]] = {}


def bench(batch: int, seq: int, d: int, causal: bool, deterministic: bool = False,
          kernel: str = "") -> dict:
    heads = 16
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    out, lse = torch.ops.flash_attention.attention.default(
        q, k, v, None, None, 0, 0, None, causal, -1, -1, 0.0, True, "")

    def ours():
        torch.ops.flash_attention.bwd.default(dout, q, k, v, out, lse, None, None, None, 0, 0,
                                              None, causal, -1, -1, 0.0, deterministic, kernel)

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    dref = dout.transpose(1, 2)

    def sdpa():
        torch.autograd.grad(ref, (qt, kt, vt), dref, retain_graph=True)

    t_ours, t_sdpa = time_ms(ours), time_ms(sdpa)
    flops = 2.5 * 4 * batch * heads * seq * seq * d / (2 if causal else 1)
    return {"batch": batch, "seq": seq, "d": d, "causal": causal, "det": deterministic,
            "kernel": kernel or "default",
            "ours_ms": t_ours, "sdpa_ms": t_sdpa, "ours_tflops": flops / t_ours / 1e9,
            "sdpa_tflops": flops / t_sdpa / 1e9, "ratio": t_sdpa / t_ours}


def train_step(batch: int, seq: int, d: int, causal: bool) -> dict:
    """Forward + backward as a training step does it (autograd, fresh graph each call): time
    of ours and SDPA FA2, and peak memory of ours, SDPA FA2 and SDPA cuDNN."""
    heads = 16
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    tleaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]

    def ours():
        out = fa.attention(*leaves, causal=causal)
        torch.autograd.grad(out, leaves, dout)

    def sdpa(backend):
        def step():
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(*tleaves, is_causal=causal)
            torch.autograd.grad(out, tleaves, dout.transpose(1, 2))
        return step

    def peak(fn) -> float:
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    return {"ours_ms": time_ms(ours), "fa2_ms": time_ms(sdpa(SDPBackend.FLASH_ATTENTION)),
            "ours_mb": peak(ours), "fa2_mb": peak(sdpa(SDPBackend.FLASH_ATTENTION)),
            "cudnn_mb": peak(sdpa(SDPBackend.CUDNN_ATTENTION))}


def main() -> None:
    ops.require()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, 16 heads")
    print(f"{'batch':>5} {'seq':>5} {'d':>4} {'causal':>6} {'det':>5} {'ours ms':>8} "
          f"{'sdpa ms':>8} {'ours TF':>8} {'sdpa TF':>8} {'sdpa/ours':>9}")
    d_heads = [int(d) for d in os.environ.get("BENCH_D", "64,128").split(",")]
    cases = [(16, s, d, c, False) for d in d_heads for s in (1024, 4096) for c in (False, True)]
    cases += [(16, 4096, 128, False, True), (16, 4096, 128, True, True)]
    built = set(torch.ops.flash_attention.bwd_kernels().split(","))
    for case in cases:
        for kernel in ["", *(v for v in VARIANTS.get(case[2], []) if v in built and not case[4])]:
            r = bench(*case, kernel=kernel)
            print(f"{r['batch']:>5} {r['seq']:>5} {r['d']:>4} {r['causal']!s:>6} {r['det']!s:>5} "
                  f"{r['ours_ms']:>8.2f} {r['sdpa_ms']:>8.2f} {r['ours_tflops']:>8.1f} "
                  f"{r['sdpa_tflops']:>8.1f} {r['ratio']:>9.2f}  {r['kernel']}", flush=True)
    print("forward + backward (autograd), bf16, d_head 128, 16 heads; peak memory above the "
          "inputs")
    print(f"{'batch':>5} {'seq':>5} {'causal':>6} {'ours ms':>8} {'fa2 ms':>8} {'fa2/ours':>8} "
          f"{'ours MB':>8} {'fa2 MB':>8} {'cudnn MB':>8}")
    for batch, seq, causal in [(16, 4096, False), (16, 4096, True)]:
        r = train_step(batch, seq, 128, causal)
        print(f"{batch:>5} {seq:>5} {causal!s:>6} {r['ours_ms']:>8.2f} {r['fa2_ms']:>8.2f} "
              f"{r['fa2_ms'] / r['ours_ms']:>8.2f} {r['ours_mb']:>8.0f} {r['fa2_mb']:>8.0f} "
              f"{r['cudnn_mb']:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
