"""Decode steps on a GPU, side by side in one process: flash_attn_with_kvcache (contiguous cache,
and paged caches of 16- and 256-row pages through a shuffled block table; the split heuristic,
and one pass with num_splits=1) against SDPA (enable_gqa=True, its preferred contiguous (batch,
heads, seq, d) layout, the backend it picks) and the GPU's copy bandwidth. One new token per
sequence (seqlen_q 1), every sequence at the cache's full length, no append (the step's
attention alone), called from Python and replayed from a CUDA graph (rows "graph"). Each
contender is timed at steady clocks (time_sustained_ms: 20 calls after about 300 ms of the
same calls); --rounds N rotates the contenders' order per round and the table gives the median
and the spread (min-max) over rounds. The KV fraction is the cache bytes read per second over
the copy's (bytes read + written per second).

    PYTHONPATH=src python3 studies/decode_bench.py [--shapes 1x4096,16x32768] [--rounds 2]
        [--heads 32/8] [--d 128] [--dtype bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from fa_tools.gpu.perfcases import time_sustained_ms
from flash_attention.interface import flash_attn_with_kvcache

SHAPES = "1x4096,1x32768,1x131072,16x4096,16x32768,64x4096,64x16384"


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up call on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def contenders(batch, seqlen, heads, kv_heads, d, dtype, kernels=()):
    """name -> callable, and the cache's bytes (K and V). kernels: decode kernels by name,
    timed on the contiguous cache beside the one dispatch picks."""
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=dtype)
    kc = torch.randn(batch, seqlen, kv_heads, d, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    out = {
        "ours": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens),
        "ours 1 split": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                         num_splits=1),
    }
    for name in kernels:
        out[name] = (lambda name=name: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                               kernel=name))
    # The cache in SDPA's layout, (batch, kv_heads, seq, d) storage read through a transposed
    # view (flash_attn's (batch, seq, kv_heads, d) is the default): each head's rows contiguous.
    kt, vt = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    out["ours bhsd"] = lambda: flash_attn_with_kvcache(q, kt.transpose(1, 2), vt.transpose(1, 2),
                                                       cache_seqlens=lens)
    for page in (16, 256):
        per = seqlen // page
        perm = torch.randperm(batch * per, device="cuda")
        table = perm.view(batch, per).to(torch.int32)
        kp = torch.empty(batch * per, page, kv_heads, d, device="cuda", dtype=dtype)
        kp[perm] = kc.view(batch * per, page, kv_heads, d)
        vp = torch.empty_like(kp)
        vp[perm] = vc.view(batch * per, page, kv_heads, d)
        out[f"ours paged {page}"] = (lambda kp=kp, vp=vp, table=table: flash_attn_with_kvcache(
            q, kp, vp, cache_seqlens=lens, block_table=table))
    qs = q.transpose(1, 2).contiguous()
    out["sdpa"] = lambda: F.scaled_dot_product_attention(qs, kt, vt, enable_gqa=True)
    # The same calls replayed from CUDA graphs, as serving engines run decode steps: the GPU's
    # time without the host's per-call cost.
    for name in ("ours", "ours bhsd", "ours paged 16", "sdpa"):
        out[name + " graph"] = graphed(out[name])
    src = torch.empty(2 * kc.numel(), device="cuda", dtype=dtype)
    dst = torch.empty_like(src)
    out["copy"] = lambda: dst.copy_(src)
    return out, 2 * kc.numel() * kc.element_size()


def profile_kernels(fns) -> None:
    """Each CUDA kernel's mean time per call over 20 calls of each fn (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / 20) for e in prof.key_averages()
                if e.device_time_total > 0]
        print(f"  profile {name}: " + "; ".join(f"{k[:60]} {us:.1f} us" for k, us in
                                                 sorted(rows, key=lambda r: -r[1])))


def peer(name: str) -> str:
    """SDPA's row to compare a row of ours with: its graph replay for a graph replay."""
    return "sdpa graph" if name.endswith(" graph") else "sdpa"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kernels", default="", help="decode kernels to time by name as well "
                    "(comma-separated; built ones)")
    ap.add_argument("--profile", action="store_true",
                    help="also print each CUDA kernel's time per call of the graph replays "
                         "(torch.profiler over 20 replays)")
    ap.add_argument("--json")
    args = ap.parse_args()
    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"# decode step, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.dtype}, heads {heads}/{kv_heads}, d_head {args.d}, seqlen_q 1; us per call, "
          f"median over {args.rounds} rounds [min-max]")
    rows = []
    for shape in args.shapes.split(","):
        batch, seqlen = (int(x) for x in shape.split("x"))
        fns, kv_bytes = contenders(batch, seqlen, heads, kv_heads, args.d, dtype,
                                   [k for k in args.kernels.split(",") if k])
        names = list(fns)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                times[n].append(statistics.median(time_sustained_ms(fns[n], reps=20)) * 1e3)
        med = {n: statistics.median(t) for n, t in times.items()}
        if args.profile:
            profile_kernels({n: f for n, f in fns.items() if n.endswith(" graph")})
        copy_bw = 2 * kv_bytes / (med["copy"] * 1e-6)
        row = {"batch": batch, "seqlen_k": seqlen, "kv_bytes": kv_bytes,
               "us": med, "spread": {n: (min(t), max(t)) for n, t in times.items()},
               "copy_GBps": copy_bw / 1e9,
               "kv_fraction": {n: kv_bytes / (med[n] * 1e-6) / copy_bw for n in names
                               if n not in ("copy",)},
               "sdpa_over_ours": {n: med[peer(n)] / med[n] for n in names
                                  if n.startswith("ours")}}
        rows.append(row)
        print(f"b{batch} kv{seqlen} ({kv_bytes / 2**20:.0f} MiB), copy {copy_bw / 1e9:.0f} GB/s:")
        for n in names:
            lo, hi = row["spread"][n]
            frac = row["kv_fraction"].get(n)
            print(f"  {n:16s} {med[n]:9.1f} us [{lo:.1f}-{hi:.1f}]"
                  + (f"  KV at {frac:.2f} of copy" if frac is not None else "")
                  + (f"  SDPA/ours {med[peer(n)] / med[n]:.2f}x" if n.startswith("ours") else ""),
                  flush=True)
        del fns
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
