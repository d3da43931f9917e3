"""Backward timing on a GPU, side by side in one process: this project's backward as dispatch
picks it (the flash_attention::bwd operator on the forward's saved out and LSE; --variants
adds named kernels of either family) against SDPA's FA2 and cuDNN backends (autograd.grad
with the graph kept), 16 heads; the cost of deterministic=True; and forward + backward
through autograd (time and peak memory against SDPA FA2 and cuDNN, bf16, at seq 2048 and
4096). Each contender is timed at steady clocks (20 calls after about 300 ms of the same
calls, as the gate times), with the SM clock it ran at and its SM cycles per call; --rounds N
times each row N times with the contenders' order rotated per round. TFLOP/s count the
backward as 2.5x the forward's FLOPs (halved for causal).
Shapes default to the issue's grid: 16 heads, batch 16/16/16/16/8/4 for seq 512..16384.

    PYTHONPATH=src python3 studies/backward_bench.py [--d 64,128] [--seqs 1024,4096]
        [--dtypes bf16,fp16] [--peers fa2,cudnn] [--rounds N] [--no-train] [--no-det]
        [--variants K1,K2] [--softcap 30]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attention as fa
from fa_tools.gpu.perfcases import time_sustained_cycles, time_sustained_ms
from flash_attention import ops
from flash_attention.kernels import parse


def time_ms(fn, reps: int = 20) -> float:
    """Median CUDA-event milliseconds of `reps` calls queued back to back after about 300 ms of
    the same calls (perfcases.time_sustained_ms: clocks settled, as the gate times). Until
    2026-11-26 each call was timed alone after 3 warm-up calls, from a cold GPU: d_head 64 at
    16 x 4096 read 7.19-8.22 ms across runs of the same kernel."""
    return statistics.median(time_sustained_ms(fn, reps))


def time_clocked(fn, reps: int = 20) -> tuple[float, float, float]:
    """time_ms's timing with clock stamps around the timed calls: (median milliseconds, millions
    of SM cycles per call, mean SM clock in MHz). Contenders timed one after the other can run
    at different sustained clocks (the GPU's temperature and power history); the cycles do not
    move with the clock."""
    times, mcycles, mhz = time_sustained_cycles(fn, reps)
    return statistics.median(times), mcycles, mhz


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = {"fa2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
BATCH_OF_SEQ = {512: 16, 1024: 16, 2048: 16, 4096: 16, 8192: 8, 16384: 4}


def bench(batch: int, seq: int, d: int, causal: bool, deterministic: bool = False,
          kernel: str = "", dtype: str = "bf16", peers: tuple[str, ...] = ("fa2",),
          rounds: int = 1, softcap: float = 0.0) -> dict:
    heads = 16
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(batch, seq, heads, d, device="cuda", dtype=DTYPES[dtype])
                     for _ in range(4))
    out, lse = torch.ops.flash_attention.attention.default(
        q, k, v, None, None, 0, 0, None, causal, -1, -1, softcap, True, "")

    def ours():
        torch.ops.flash_attention.bwd.default(dout, q, k, v, out, lse, None, None, None, 0, 0,
                                              None, causal, -1, -1, softcap, deterministic,
                                              kernel)

    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    dref = dout.transpose(1, 2)

    def sdpa(backend):
        with sdpa_kernel(backend):
            ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        def step():
            torch.autograd.grad(ref, (qt, kt, vt), dref, retain_graph=True)
        return step

    flops = 2.5 * 4 * batch * heads * seq * seq * d / (2 if causal else 1)
    r = {"batch": batch, "seq": seq, "d": d, "causal": causal, "det": deterministic,
         "dtype": dtype, "kernel": kernel or "default"}
    fns = {"ours": ours}
    for peer in peers:
        try:
            fn = sdpa(BACKENDS[peer])
            fn()  # refusals come from the forward or the backward's first call
            fns[peer] = fn
        except RuntimeError as e:  # the backend refuses the shape
            print(f"  ({peer} unavailable: {str(e).splitlines()[0][:80]})")
    # Each round times every contender once, the order rotated by one per round: a contender's
    # sustained clock depends on what ran just before it (on an H100, ours timed right after
    # cuDNN ran at 1580-1630 MHz where FA2 after it ran at 1800-1840), so no contender always
    # follows the same one.
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            runs[name].append(time_clocked(fns[name]))
    for name, timings in runs.items():
        ms, mcyc, mhz = (statistics.median(t[j] for t in timings) for j in range(3))
        r[f"{name}_ms"], r[f"{name}_mcyc"], r[f"{name}_mhz"] = ms, mcyc, mhz
        r[f"{name}_tflops"] = flops / ms / 1e9
        if name != "ours":
            r[f"{name}_ratio"] = ms / r["ours_ms"]
            r[f"{name}_cyc_ratio"] = mcyc / r["ours_mcyc"]
            # the spread of the ratio over rounds (each round's pair)
            per_round = [p[0] / o[0] for p, o in zip(timings, runs["ours"])]
            r[f"{name}_ratio_lo"], r[f"{name}_ratio_hi"] = min(per_round), max(per_round)
    return r


def train_step_fns(batch: int, seq: int, heads: int, d: int, causal: bool) -> dict:
    """One training step each (forward + backward through autograd, a fresh graph per call,
    bf16): "ours", and SDPA's "fa2" and "cudnn" on the same inputs as (batch, heads, seq, d)
    views. studies/step_profile.py profiles the same steps."""
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

    return {"ours": ours, "fa2": sdpa(BACKENDS["fa2"]), "cudnn": sdpa(BACKENDS["cudnn"])}


def train_step(batch: int, seq: int, d: int, causal: bool) -> dict:
    """Forward + backward as a training step does it (autograd, fresh graph each call): time
    and peak memory of ours, SDPA FA2 and SDPA cuDNN."""
    steps = train_step_fns(batch, seq, 16, d, causal)
    ours, fa2, cudnn = steps["ours"], steps["fa2"], steps["cudnn"]

    def peak(fn) -> float:
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    return {"ours_ms": time_ms(ours), "fa2_ms": time_ms(fa2), "cudnn_ms": time_ms(cudnn),
            "ours_mb": peak(ours), "fa2_mb": peak(fa2), "cudnn_mb": peak(cudnn)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--seqs", default="1024,4096")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--peers", default="fa2", help="SDPA backends timed beside ours: fa2,cudnn")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each row this many times, the contenders' order rotated per "
                         "round; medians printed, with the ratio's range over rounds")
    ap.add_argument("--no-train", action="store_true", help="skip forward + backward")
    ap.add_argument("--softcap", type=float, default=0.0,
                    help="our backward with this softcap (the SDPA peers have none: they stay "
                         "the plain call, the clock's reference)")
    ap.add_argument("--no-det", action="store_true", help="skip deterministic=True")
    ap.add_argument("--variants", default="",
                    help="backward kernels timed beside the default one where their dtype and "
                         "d_head match (built with FLASH_ATTENTION_KERNELS naming them, e.g. "
                         "default,bwd_sm90:r64)")
    args = ap.parse_args()
    ops.require()
    peers = tuple(args.peers.split(",")) if args.peers else ()
    rw = 22 if args.rounds > 1 else 10  # the ratio column's width (with its range)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, 16 heads; ratio = peer "
          "ms / ours ms (> 1: ours faster); MHz: the mean SM clock over each contender's timed "
          "calls; cyc: the ratio of SM cycles per call (the clock taken out)"
          + (f"; medians of {args.rounds} rounds, the contenders' order rotated per round "
             "(the ratio's range over rounds in brackets)" if args.rounds > 1 else ""))
    print(f"{'dtype':>5} {'batch':>5} {'seq':>5} {'d':>4} {'causal':>6} {'det':>5} "
          f"{'ours ms':>8} {'ours TF':>8} {'MHz':>5}"
          + "".join(f" {p + ' ms':>9} {p + ' TF':>8} {'MHz':>5} "
                    f"{p + '/ours':>{rw}} {'cyc':>5}" for p in peers))
    cases = [(dt, BATCH_OF_SEQ.get(s, 16), s, d, c, False) for dt in args.dtypes.split(",")
             for d in map(int, args.d.split(",")) for s in map(int, args.seqs.split(","))
             for c in (False, True)]
    if not args.no_det:  # deterministic=True, bf16, each --d at the --seqs from 4096
        cases += [("bf16", BATCH_OF_SEQ.get(s, 16), s, d, c, True)
                  for d in map(int, args.d.split(",")) for s in map(int, args.seqs.split(","))
                  if s >= 4096 for c in (False, True)]
    built = set(torch.ops.flash_attention.bwd_kernels().split(","))
    variants = [v for v in args.variants.split(",") if v]
    missing = [v for v in variants if v not in built]
    if missing:
        ap.error(f"variants not built: {', '.join(missing)}")
    for dt, *case in cases:
        mine = [v for v in variants if (parse(v).dtype, parse(v).d_head)
                == (dt, case[2])]  # either kind (bwd_sm80_..., bwd_sm90_...)
        for kernel in ["", *mine]:
            r = bench(*case, kernel=kernel, dtype=dt, peers=peers, rounds=args.rounds,
                      softcap=args.softcap)
            line = (f"{dt:>5} {r['batch']:>5} {r['seq']:>5} {r['d']:>4} {r['causal']!s:>6} "
                    f"{r['det']!s:>5} {r['ours_ms']:>8.2f} {r['ours_tflops']:>8.1f} "
                    f"{r['ours_mhz']:>5.0f}")
            for p in peers:
                if f"{p}_ms" in r:
                    ratio = f"{r[p + '_ratio']:.2f}"
                    if args.rounds > 1:
                        ratio += f" ({r[p + '_ratio_lo']:.2f}-{r[p + '_ratio_hi']:.2f})"
                    line += (f" {r[p + '_ms']:>9.2f} {r[p + '_tflops']:>8.1f} "
                             f"{r[p + '_mhz']:>5.0f} {ratio:>{rw}} "
                             f"{r[p + '_cyc_ratio']:>5.2f}")
                else:
                    line += f" {'-':>9} {'-':>8} {'-':>5} {'-':>{rw}} {'-':>5}"
            print(line + f"  {r['kernel']}", flush=True)
    if args.no_train:
        return
    print("forward + backward (autograd), bf16, 16 heads, each --d at seq 2048 and 4096; peak "
          "memory above the inputs")
    if (torch.cuda.get_device_capability()[0] == 9
            and not any(n.startswith("fwd_sm90_") for n in ops.BUILT_NAMES)):
        print("NOTE: this build has no Hopper forward kernel, so the steps below run the sm80 "
              "family's forward, not the one users get (ci/gpu_backward.sh builds that subset; "
              "build the default set to time the step)")
    print(f"{'batch':>5} {'seq':>5} {'d':>4} {'causal':>6} {'ours ms':>8} {'fa2 ms':>8} "
          f"{'fa2/ours':>8} {'cudnn ms':>8} {'cudnn/ours':>10} {'ours MB':>8} {'fa2 MB':>8} "
          f"{'cudnn MB':>8}")
    for d in map(int, args.d.split(",")):
        for seq in (2048, 4096):
            for causal in (False, True):
                r = train_step(16, seq, d, causal)
                print(f"{16:>5} {seq:>5} {d:>4} {causal!s:>6} {r['ours_ms']:>8.2f} "
                      f"{r['fa2_ms']:>8.2f} {r['fa2_ms'] / r['ours_ms']:>8.2f} "
                      f"{r['cudnn_ms']:>8.2f} {r['cudnn_ms'] / r['ours_ms']:>10.2f} "
                      f"{r['ours_mb']:>8.0f} {r['fa2_mb']:>8.0f} {r['cudnn_mb']:>8.0f}",
                      flush=True)


if __name__ == "__main__":
    main()
