"""Sliding-window candidates side by side on a GPU (the features issue's window target): each
config's time for window (1024, 1024) at 8 x 8192 x 16 heads, d_head 128, against the dispatched
full (non-causal) kernel, all interleaved over ROUNDS rounds, each timing after 300 ms of the
same calls (steady clocks; perfcases.window_vs_full). Prints each contender's time and SM clock
and window / (visible fraction x full) per config, in time and in SM cycles: the median with
the range of the rounds' values.
    python3 studies/window_ab.py [--dtype bf16|fp16] [--rounds 3] CONFIG [CONFIG ...]
(CONFIG: a built fwd_sm90 kernel with masks, or `dispatched`)."""

import argparse

from fa_tools.gpu.perfcases import window_vs_full

ap = argparse.ArgumentParser()
ap.add_argument("configs", nargs="+")
ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
ap.add_argument("--rounds", type=int, default=3)
args = ap.parse_args()
print("\n".join(window_vs_full(args.configs, args.dtype, args.rounds).lines()))
