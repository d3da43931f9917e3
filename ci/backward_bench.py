"""Backward timing on a GPU, side by side in one process: this project's sm80-family backward
(the flash_attention::bwd operator on the forward's saved out and LSE) against SDPA's FA2
backend (autograd.grad with the graph kept), bf16, 16 heads; and the cost of
deterministic=True. TFLOP/s count the backward as 2.5x the forward's FLOPs (halved for causal).

    PYTHONPATH=src python3 ci/backward_bench.py
"""

from __future__ import annotations

import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attention as fa  # noqa: F401  (loads the extension and registers the operators)
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


def bench(batch: int, seq: int, d: int, causal: bool, deterministic: bool = False) -> dict:
    heads = 16
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seq, heads, d, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    out, lse = torch.ops.flash_attention.attention.default(
        q, k, v, None, None, 0, 0, None, causal, -1, -1, 0.0, True, "")

    def ours():
        torch.ops.flash_attention.bwd.default(dout, q, k, v, out, lse, None, None, None, 0, 0,
                                              None, causal, -1, -1, 0.0, deterministic, "")

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    dref = dout.transpose(1, 2)

    def sdpa():
        torch.autograd.grad(ref, (qt, kt, vt), dref, retain_graph=True)

    t_ours, t_sdpa = time_ms(ours), time_ms(sdpa)
    flops = 2.5 * 4 * batch * heads * seq * seq * d / (2 if causal else 1)
    return {"batch": batch, "seq": seq, "d": d, "causal": causal, "det": deterministic,
            "ours_ms": t_ours, "sdpa_ms": t_sdpa, "ours_tflops": flops / t_ours / 1e9,
            "sdpa_tflops": flops / t_sdpa / 1e9, "ratio": t_sdpa / t_ours}


def main() -> None:
    ops.require()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, 16 heads")
    print(f"{'batch':>5} {'seq':>5} {'d':>4} {'causal':>6} {'det':>5} {'ours ms':>8} "
          f"{'sdpa ms':>8} {'ours TF':>8} {'sdpa TF':>8} {'sdpa/ours':>9}")
    cases = [(16, s, d, c, False) for d in (64, 128) for s in (1024, 4096) for c in (False, True)]
    cases += [(16, 4096, 128, False, True), (16, 4096, 128, True, True)]
    for case in cases:
        r = bench(*case)
        print(f"{r['batch']:>5} {r['seq']:>5} {r['d']:>4} {r['causal']!s:>6} {r['det']!s:>5} "
              f"{r['ours_ms']:>8.2f} {r['sdpa_ms']:>8.2f} {r['ours_tflops']:>8.1f} "
              f"{r['sdpa_tflops']:>8.1f} {r['ratio']:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
