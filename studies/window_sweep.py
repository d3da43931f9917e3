"""Where the sliding-window kernel's cycles go (diagnostic, GPU machine): SM cycles per call of
each masked config at windows (w, w) for every w of --windows, and of full (non-causal) configs,
on 8 x 8192 x 16 heads, d_head 128, interleaved over --rounds rounds (each timing after 300 ms of
the same calls). Per masked config it fits cycles = (tiles x T0 + blocks x b) / SMs over the
windows (least squares): b is the SM cycles of one KV block of one tile, T0 the fixed cost of a
tile, printed in blocks; per full config it prints the cycles of one block (its T0 spread over
64 blocks) and the clock it ran at.
    python3 studies/window_sweep.py [--dtype bf16] [--rounds 3] [--windows 256,512,1024,2048]
        --masked CONFIG ... --full CONFIG|dispatched ..."""

import argparse
import statistics

import torch

import flash_attention as fa
from fa_tools.gpu.perfcases import time_sustained_cycles
from flash_attention.kernels import parse
from flash_attention.masks import kv_blocks

ap = argparse.ArgumentParser()
ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--windows", default="256,512,1024,2048")
ap.add_argument("--masked", nargs="*", default=[])
ap.add_argument("--full", nargs="*", default=["dispatched"])
args = ap.parse_args()

B, S, H, D = 8, 8192, 16, 128
sms = torch.cuda.get_device_properties(0).multi_processor_count
dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=dt) for _ in range(3))
out = torch.empty_like(q)
windows = [int(w) for w in args.windows.split(",")]


def blocks_of(config: str, w: int) -> tuple[int, int]:
    """(tiles, KV blocks) of one call; w < 0: no window."""
    cfg = parse(config if config.startswith("fwd_sm90_") else "fwd_sm90_bf16_d128_r128_c128_s2_f")
    br, bc = cfg.block_r, cfg.block_c
    counts = [kv_blocks(r0, br, bc, S, S, w, w).count for r0 in range(0, S, br)]
    return len(counts) * B * H, sum(counts) * B * H


contenders = {}  # label -> (fn, config, w)
for c in args.full:
    opts = {} if c == "dispatched" else {"config": c}
    contenders[f"full {c}"] = ((lambda o=opts: fa.attention(q, k, v, out=out, **o)), c, -1)
for c in args.masked:
    for w in windows:
        contenders[f"({w},{w}) {c}"] = (
            (lambda c=c, w=w: fa.attention(q, k, v, out=out, config=c, window_size=(w, w))), c, w)

samples = {label: [] for label in contenders}  # (ms, Mcycles, MHz) per round
for r in range(args.rounds):
    for label, (fn, _, _) in contenders.items():
        ms, mcyc, mhz = time_sustained_cycles(fn, 10)
        samples[label].append((statistics.median(ms), mcyc, mhz))
    print(f"round {r + 1}/{args.rounds} done", flush=True)


def med(xs):
    return statistics.median(xs)


print(f"\n{B}x{S}x{H} heads d{D} {args.dtype}, {sms} SMs, median of {args.rounds} rounds "
      "[range]; cycles per block = cycles per call x SMs / blocks")
print(f"{'contender':48s} {'ms':>8s} {'Mcycles':>8s} {'MHz':>6s} {'tiles':>6s} {'blocks':>7s} "
      f"{'cyc/block':>9s}")
for label, (_, c, w) in contenders.items():
    ms, mc, mhz = (med([s[i] for s in samples[label]]) for i in range(3))
    lo, hi = min(s[1] for s in samples[label]), max(s[1] for s in samples[label])
    tiles, blocks = blocks_of(c, w)
    print(f"{label:48s} {ms:8.3f} {mc:8.3f} {mhz:6.0f} {tiles:6d} {blocks:7d} "
          f"{mc * 1e6 * sms / blocks:9.0f}  [{lo:.3f}, {hi:.3f}]")

for c in args.masked:
    # Least squares of cycles x SMs = T0 x tiles + b x blocks over the windows.
    rows = torch.tensor([(*blocks_of(c, w), med([s[1] for s in samples[f"({w},{w}) {c}"]])
                          * 1e6 * sms) for w in windows], dtype=torch.float64)
    t0, b = torch.linalg.lstsq(rows[:, :2], rows[:, 2:]).solution.flatten().tolist()
    resid = ((rows[:, :2] @ torch.tensor([t0, b], dtype=torch.float64) - rows[:, 2])
             / rows[:, 2]).abs().max().item()
    print(f"fit {c}: b = {b:.0f} cycles per block, T0 = {t0:.0f} cycles per tile = "
          f"{t0 / b:.2f} blocks (worst residual {resid:.2%})")
