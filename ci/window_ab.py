"""Sliding-window candidates side by side on a GPU (the features issue's window target): each
config's time for window (1024, 1024) at 8 x 8192 x 16 heads, d_head 128, against the dispatched
full (non-causal) kernel, all interleaved over ROUNDS rounds, each timing after 300 ms of the
same calls (steady clocks). Prints window / (visible fraction x full) per config, the median
with the range of the rounds' values.
    python3 ci/window_ab.py [--dtype bf16|fp16] [--rounds 3] CONFIG [CONFIG ...]
(CONFIG: a built sm90 config with masks, or `dispatched`)."""

import argparse
import statistics as st

import torch

import flash_attention as fa
from fa_tools.gpu.perfcases import time_sustained_ms
from flash_attention.masks import visible

ap = argparse.ArgumentParser()
ap.add_argument("configs", nargs="+")
ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()

dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
b, s, window = 8, 8192, (1024, 1024)
q, k, v = (torch.randn(b, s, 16, 128, device="cuda", dtype=dt) for _ in range(3))
out = torch.empty_like(q)
frac = visible(s, s, *window, "cuda").float().mean().item()


def call(config):
    opts = {} if config == "dispatched" else {"config": config}
    return lambda: fa.attention(q, k, v, out=out, window_size=window, **opts)


full_ms: list[float] = []
win_ms: dict[str, list[float]] = {c: [] for c in args.configs}
for r in range(args.rounds):
    full_ms.append(st.median(time_sustained_ms(lambda: fa.attention(q, k, v, out=out), 10)))
    for c in args.configs:
        win_ms[c].append(st.median(time_sustained_ms(call(c), 10)))
    print(f"round {r + 1}/{args.rounds} done", flush=True)
full = st.median(full_ms)
print(f"window {window} {b}x{s} {args.dtype} d128, visible fraction {frac:.4f}, full "
      f"{full:.3f} ms [{min(full_ms):.3f}, {max(full_ms):.3f}]")
for c, ms in win_ms.items():
    ratios = [w / (frac * f) for w, f in zip(ms, full_ms)]
    print(f"{c:36s} window {st.median(ms):.3f} ms [{min(ms):.3f}, {max(ms):.3f}]  "
          f"window/(fraction*full) = {st.median(ratios):.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}]")
