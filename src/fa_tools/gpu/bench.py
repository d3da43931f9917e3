"""Benchmark harness: attention() (or with --pass bwd its backward) against PyTorch SDPA's
FLASH_ATTENTION (FA2) and CUDNN_ATTENTION backends, in the same process on the same inputs, timed
with CUDA events (median of interleaved rounds). Prints a markdown table; --json keeps every
number."""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import logging
import statistics
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

# (batch, seqlen) of the standard table: 16 heads, batch shrinking as sequences grow.
STANDARD_SHAPES = [(16, 512), (16, 1024), (16, 2048), (16, 4096), (8, 8192), (4, 16384)]
PEERS = ("sdpa_fa2", "sdpa_cudnn")
GEMM_N = 8192  # the GEMM peer of --gemm: bf16 GEMM_N^3, the tensor cores' dense rate


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        batch, seqlen = item.lower().split("x")
        out.append((int(batch), int(seqlen)))
    return out


def environment() -> dict:
    import torch

    info = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.max.sm,clocks.mem",
             "--format=csv,noheader"], capture_output=True, text=True, check=True).stdout
        info["driver_clocks"] = smi.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        info["driver_clocks"] = None
    return info


def run(dtypes: list[str], d_heads: list[int], shapes: list[tuple[int, int]], heads: int = 16,
        configs: str | None = None, reps: int = 10, rounds: int = 3,
        causal: bool = False, sustained: bool = True, gemm: bool = False,
        pass_: str = "fwd") -> list[dict]:
    """One row per (dtype, d_head, shape, config): our median time and TFLOP/s beside SDPA's
    FA2 and cuDNN backends timed in the same interleaved rounds (all causal with `causal`,
    FLOPs halved). `configs` names kernels or selections (comma-separated); kernels of another
    dtype/d_head, or without masks when causal, are left out. None: dispatch. `sustained`:
    each contender's calls timed after 300 ms of the same calls (steady clocks under the power
    limit, perfcases.time_sustained_ms); else 10-call bursts after an idle gap. `gemm`: the
    cuBLAS bf16 GEMM (GEMM_N^3) is one more contender of each row's rounds, so that its rate
    meets the row's at the same state of the GPU (clocks drift as it warms over a run).
    `pass_` "bwd": the backward alone (backward_kernels names its configs), FLOPs 2.5x."""
    import flash_attention as fa

    if pass_ == "bwd":
        return [_measure_bwd_row(dtype, d_head, batch, seqlen, heads, kernel, reps, rounds,
                                 causal, sustained, gemm)
                for dtype in dtypes for d_head in d_heads
                for (batch, seqlen) in shapes
                for kernel in backward_kernels(configs, dtype, d_head)]
    wanted = fa.resolve(configs) if configs else None
    rows = []
    for dtype in dtypes:
        for d_head in d_heads:
            chosen = ([c for c in wanted if c.direction == "fwd" and c.dtype == dtype
                       and c.d_head == d_head and (c.mask or not causal) and not c.softcap]
                      if wanted else [None])
            for (batch, seqlen), config in itertools.product(shapes, chosen):
                rows.append(_measure_row(dtype, d_head, batch, seqlen, heads, config, reps,
                                         rounds, causal, sustained, gemm))
    return rows


def backward_kernels(configs: str | None, dtype: str, d_head: int) -> list[str]:
    """The backward kernels a --pass bwd row times for (dtype, d_head): of `configs` (a kernel
    selection, flash_attention.kernels.resolve: its backward kernels), those of the dtype whose
    d_head variant is the one a call of d_head runs on, without a softcap, in order (its rows
    are fixed-length calls: a varlen kernel, flag j, is left out); "" (the operator's choice)
    when configs is None."""
    from flash_attention.kernels import resolve

    if not configs:
        return [""]
    wanted = [c for c in resolve(configs) if c.direction == "bwd" and c.dtype == dtype
              and not c.softcap and not getattr(c, "varlen", False) and c.d_head >= d_head]
    variant = {c.KIND: min(x.d_head for x in wanted if x.KIND == c.KIND) for c in wanted}
    return [c.name for c in wanted if c.d_head == variant[c.KIND]]


def _measure_row(dtype: str, d_head: int, batch: int, seqlen: int, heads: int, config,
                 reps: int, rounds: int, causal: bool = False, sustained: bool = True,
                 gemm: bool = False) -> dict:
    import torch

    import flash_attention as fa
    from flash_attention.timing import attention_flops

    from .perfcases import contenders

    tdtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    q, k, v = (torch.randn(batch, seqlen, heads, d_head, device="cuda", dtype=tdtype)
               for _ in range(3))
    out = torch.empty_like(q)
    fns = contenders(q, k, v, out, config=config, causal=causal)
    flops = attention_flops(batch, heads, seqlen, seqlen, d_head, causal)
    # What ran: the named config, or dispatch's choice after its run-time fallback.
    right = 0 if causal else -1
    chosen = config.name if config else fa.ops.extension().explain(q, k, v, -1, right, False)
    row = {"dtype": dtype, "d_head": d_head, "batch": batch, "seqlen": seqlen, "heads": heads,
           "causal": causal, "config": chosen, "pass": "fwd"}
    return _time_row(row, fns, flops, reps, rounds, sustained, gemm)


def _measure_bwd_row(dtype: str, d_head: int, batch: int, seqlen: int, heads: int, kernel: str,
                     reps: int, rounds: int, causal: bool = False, sustained: bool = True,
                     gemm: bool = False) -> dict:
    """The backward of one shape (perfcases' bwd case: ours is the backward operator on the
    forward's out and LSE, the peers SDPA's backward through autograd.grad), named kernel or
    the operator's choice."""
    import torch

    from flash_attention import backward
    from flash_attention.kernels import Call, bwd_sm80, bwd_sm90

    from .perfcases import Case, Inputs, training_contenders

    case = Case(dtype, d_head, batch, seqlen, heads=heads, causal=causal, kind="bwd")
    fns = training_contenders(case, Inputs.make(case), kernel=kernel)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    if not kernel:  # what the operator picks for this fixed-length call
        call = Call(dtype, d_head)
        picked = ((bwd_sm90.select(call, backward.built()) if hopper else None)
                  or bwd_sm80.select(call, backward.built()))
        kernel = picked.name if picked else "?"
    row = {"dtype": dtype, "d_head": d_head, "batch": batch, "seqlen": seqlen, "heads": heads,
           "causal": causal, "config": kernel, "pass": "bwd"}
    return _time_row(row, fns, case.flops(), reps, rounds, sustained, gemm)


def _time_row(row: dict, fns: dict, flops: float, reps: int, rounds: int, sustained: bool,
              gemm: bool) -> dict:
    """Times the contenders `fns` (ours and the SDPA peers that run the row) in interleaved
    rounds and adds to `row` their median times, rates, SM cycles and ratios."""
    import torch

    from .perfcases import time_cuda_ms, time_sustained_cycles

    for name in set(PEERS) - set(fns):
        log.warning("%s cannot run %s d%d %dx%d", name, row["dtype"], row["d_head"],
                    row["batch"], row["seqlen"])
    if gemm:
        a, b = (torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        fns["gemm"] = lambda: torch.matmul(a, b)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    mcycles: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):  # interleaved rounds: drift hits every contender alike
        for name, fn in fns.items():
            if sustained:  # and the SM cycles of the timed calls (clock stamps around them)
                times, cycles, _ = time_sustained_cycles(fn, reps)
                samples[name] += times
                mcycles[name].append(cycles)
            else:
                samples[name] += time_cuda_ms(fn, reps=reps, warmup=3)
    row["timing"] = "sustained" if sustained else "burst"
    for name in ("ours", *PEERS):
        got = samples.get(name)
        row[f"{name}_ms"] = statistics.median(got) if got else None
        row[f"{name}_ms_min"] = min(got) if got else None
        row[f"{name}_ms_max"] = max(got) if got else None
        row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9 if got else None
        cyc = mcycles.get(name)
        row[f"{name}_mcycles"] = statistics.median(cyc) if cyc else None
    if gemm:
        got, cyc, gemm_flops = samples["gemm"], mcycles["gemm"], 2 * GEMM_N**3
        row["gemm_tflops"] = gemm_flops / statistics.median(got) / 1e9
        row["gemm_tflops_min"] = gemm_flops / max(got) / 1e9
        row["gemm_tflops_max"] = gemm_flops / min(got) / 1e9
        row["ratio_gemm"] = row["ours_tflops"] / row["gemm_tflops"]
        # FLOPs per SM cycle against the GEMM's: the same ratio at equal clocks
        row["cycle_ratio_gemm"] = (flops / row["ours_mcycles"] * statistics.median(cyc)
                                   / gemm_flops if cyc and row["ours_mcycles"] else None)
    for name in PEERS:
        row[f"ratio_{name}"] = (row[f"{name}_ms"] / row["ours_ms"]
                                if row[f"{name}_ms"] else None)
        # the same in SM cycles per call: the clock each contender ran at taken out
        row[f"cycle_ratio_{name}"] = (row[f"{name}_mcycles"] / row["ours_mcycles"]
                                      if row[f"{name}_mcycles"] and row["ours_mcycles"]
                                      else None)
    log.info("%s %s d%d %dx%d: ours %.1f, fa2 %s, cudnn %s TFLOP/s", row["pass"], row["dtype"],
             row["d_head"], row["batch"], row["seqlen"], row["ours_tflops"],
             _fmt(row["sdpa_fa2_tflops"]), _fmt(row["sdpa_cudnn_tflops"]))
    return row


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def _best(row: dict, peer: str) -> str:
    ours, theirs = row.get("ours_ms_min"), row.get(f"{peer}_ms_min")
    return f" ({theirs / ours:.3f})" if ours and theirs else ""


def markdown(rows: list[dict], env: dict) -> str:
    lines = [
        f"GPU: {env.get('gpu')} ({env.get('driver_clocks')}), torch {env.get('torch')}, "
        f"commit {env.get('commit')}, {env.get('date')}. "
        + ("Calls timed in 10-call bursts after an idle gap (boost clocks). "
           if rows and rows[0].get("timing") == "burst" else
           "Calls timed after 300 ms of continuous work (clocks settled under the power "
           "limit). ")
        + ("The backward alone (FLOPs 2.5x the forward's). "
           if rows and rows[0].get("pass") == "bwd" else "")
        + "TFLOP/s from median times; "
        "ratio = peer time / our time (> 1: we are faster), from medians and, in brackets, "
        "from the fastest sample of each; cycles: the same ratio of SM cycles per call (clock "
        "stamps around the timed calls), which the clock each ran at does not move.",
        "",
        "| dtype | d | batch x seq | heads | ours TFLOP/s | SDPA FA2 TFLOP/s | ours/FA2 | "
        "SDPA cuDNN TFLOP/s | ours/cuDNN | ours/cuDNN cycles | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['d_head']}{' causal' if r.get('causal') else ''} | "
            f"{r['batch']}x{r['seqlen']} | {r['heads']} | "
            f"{_fmt(r['ours_tflops'])} | {_fmt(r['sdpa_fa2_tflops'])} | "
            f"{_fmt(r['ratio_sdpa_fa2'], '.3f')}{_best(r, 'sdpa_fa2')} | "
            f"{_fmt(r['sdpa_cudnn_tflops'])} | "
            f"{_fmt(r['ratio_sdpa_cudnn'], '.3f')}{_best(r, 'sdpa_cudnn')} | "
            f"{_fmt(r.get('cycle_ratio_sdpa_cudnn'), '.3f')} | `{r['config']}` |"
        )
    return "\n".join(lines) + "\n"


def command(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("fa-tools bench: skipped, no CUDA GPU on this machine", file=sys.stderr)
        return 3
    env = environment()
    rows = run(args.dtypes.split(","), [int(d) for d in args.d_heads.split(",")],
               parse_shapes(args.shapes), args.heads, args.configs, args.reps, args.rounds,
               args.causal, not args.burst, args.gemm, args.pass_)
    table = markdown(rows, env) + (gemm_lines(rows) if args.gemm else "")
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    if args.md:
        args.md.write_text(table)
    return 0


def gemm_lines(rows: list[dict]) -> str:
    """The rows against the cuBLAS GEMM timed in their rounds (run(gemm=True))."""
    lines = ["", f"Against the cuBLAS bf16 GEMM {GEMM_N}^3 timed in each row's rounds: ours / "
             "GEMM in TFLOP/s and, in brackets, in FLOPs per SM cycle (equal clocks).", "",
             "| dtype | batch x seq | config | GEMM TFLOP/s (samples) | ours / GEMM | cycles |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['batch']}x{r['seqlen']} | `{r['config']}` | "
            f"{r['gemm_tflops']:.1f} ({r['gemm_tflops_min']:.1f}-{r['gemm_tflops_max']:.1f}) | "
            f"{r['ratio_gemm']:.3f} | {_fmt(r['cycle_ratio_gemm'], '.3f')} |")
    return "\n".join(lines) + "\n"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time attention() or its backward against SDPA FA2 and "
                       "cuDNN", description=__doc__)
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="fwd",
                   help="bwd: the backward alone (the operator on the forward's out and LSE "
                   "against SDPA's backward through autograd.grad; FLOPs 2.5x the forward's), "
                   "--configs then naming backward kernels or selections (bwd_*, bwd:default, "
                   "bwd_sm90:r64)")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--d-heads", default="128")
    p.add_argument("--shapes", default=",".join(f"{b}x{s}" for b, s in STANDARD_SHAPES),
                   help="batch x seqlen list, e.g. 16x4096,8x8192")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--configs", default=None,
                   help="kernel names and/or selections (default, fwd_sm90:prog, ...), "
                        "comma-separated (default: the kernel dispatch picks)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--burst", action="store_true",
                   help="time 10-call bursts after an idle gap (boost clocks) instead of calls "
                   "after 300 ms of continuous work (clocks settled under the power limit)")
    p.add_argument("--causal", action="store_true",
                   help="causal attention for all contenders (TFLOP/s from halved FLOPs)")
    p.add_argument("--gemm", action="store_true",
                   help="time a cuBLAS bf16 GEMM 8192^3 (the GPU's tensor-core rate) in each "
                   "row's rounds too, and tabulate each row against it")
    p.add_argument("--json", type=Path, help="write all numbers here")
    p.add_argument("--md", type=Path, help="write the markdown table here")
    p.set_defaults(func=command)
