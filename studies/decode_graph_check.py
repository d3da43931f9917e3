"""Do CUDA graph replays of decode steps compute what eager calls compute, and at what speed?

For each case (a decode step over its own cache: plain, with an append + rotary, paged), the
step is called eagerly, captured in a CUDA graph and replayed back to back, then called eagerly
again. Printed per case: the replays' time per step (and the K/V bytes per second that implies),
whether the graph's output equals the eager one bitwise (decode kernels are deterministic), the
largest difference, and both outputs against the fp32 reference by FlashAttention's rule
(kvcache_reference on copies of the caches taken before the first call). Run it once with
FLASH_ATTENTION_PDL=0 and once without, to tell a launch-order race from a bench artifact:

    PYTHONPATH=src python3 studies/decode_graph_check.py [--shapes 16x8192,1x32768] [--replays 200]
        [--interleave LAYERS]

--interleave also keeps a graph of every case alive at once (LAYERS layers each) and replays
them in turn, checking each against its eager outputs after its replays.
"""

from __future__ import annotations

import argparse
import os

import torch
from decode_bench import graphed, span_us  # studies/ is the script's directory, on sys.path

import flash_attention as fa
from flash_attention.interface import flash_attn_with_kvcache
from flash_attention.reference import kvcache_reference


def make_case(kind: str, batch: int, seqlen: int, heads: int, kv_heads: int, d: int):
    """(step, reference output fp32, low-precision reference output, K/V bytes read a step)."""
    dt = torch.bfloat16
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=dt)
    kc = torch.randn(batch, seqlen, kv_heads, d, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    kw: dict = {}
    if kind == "append":
        kw["k"], kw["v"] = (torch.randn(batch, 1, kv_heads, d, device="cuda", dtype=dt)
                            for _ in range(2))
        angles = torch.arange(seqlen, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")
        kw["rotary_cos"], kw["rotary_sin"] = angles.cos().to(dt), angles.sin().to(dt)
        lens = lens - 1
    ref_args = dict(q=q, k_cache=kc.clone(), v_cache=vc.clone(), k=kw.get("k"), v=kw.get("v"),
                    rotary_cos=kw.get("rotary_cos"), rotary_sin=kw.get("rotary_sin"),
                    cache_seqlens=lens, causal=True, rotary_interleaved=True)
    ref = kvcache_reference(**ref_args).out.float()
    low = kvcache_reference(**ref_args, upcast=False).out.float()
    if kind.startswith("paged"):
        page = int(kind[5:])
        per = seqlen // page
        perm = torch.randperm(batch * per, device="cuda")
        table = perm.view(batch, per).to(torch.int32)
        pools = []
        for c in (kc, vc):
            pool = torch.empty(batch * per, page, kv_heads, d, device="cuda", dtype=dt)
            pool[perm] = c.view(batch * per, page, kv_heads, d)
            pools.append(pool)
        kc, vc = pools
        kw["block_table"] = table

    def step():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, **kw)
    return step, ref, low, 2 * kc.numel() * kc.element_size()


def check(name: str, step, ref, low, kv_bytes: int, replays: int) -> None:
    fa.kvcache_errors()  # clear
    eager = step().float()
    replay, out = graphed(step)
    for _ in range(10):
        replay()
    us = span_us(replay, replays)
    got = out.float()
    again = step().float()
    torch.cuda.synchronize()
    bound = 2 * (low - ref).abs().max().item() + 1e-5
    print(f"{name:24s} {us:8.1f} us/step ({kv_bytes / us / 1e3:6.0f} GB/s of K/V)  "
          f"graph==eager {torch.equal(got, eager)} "
          f"(max diff {(got - eager).abs().max().item():.3g})"
          f"  eager again==eager {torch.equal(again, eager)}  "
          f"err graph {(got - ref).abs().max().item():.3g} eager "
          f"{(eager - ref).abs().max().item():.3g} (rule {bound:.3g})  "
          f"nan {bool(torch.isnan(got).any())}  status {fa.kvcache_errors()}", flush=True)


def interleaved(cases, rounds: int, replays: int) -> None:
    """Every case's graph captured first (kept alive together, as a serving engine keeps one per
    batch size), then replayed case after case for `rounds` rounds; after each case's replays
    its outputs against its eager ones (bitwise)."""
    graphs = []
    for name, step in cases:
        want = [o.clone() for o in step()]
        replay, got = graphed(step)
        graphs.append((name, replay, got, want))
    for r in range(rounds):
        bad = []
        for name, replay, got, want in graphs:
            for _ in range(replays):
                replay()
            torch.cuda.synchronize()
            if not all(torch.equal(g, w) for g, w in zip(got, want, strict=True)):
                diff = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
                bad.append(f"{name} (max diff {diff:.3g})")
        print(f"interleaved round {r}: {len(graphs) - len(bad)} of {len(graphs)} graphs equal "
              f"their eager steps" + (f"; differ: {', '.join(bad)}" if bad else ""), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16x8192,1x32768")
    ap.add_argument("--kinds", default="plain,append,paged64")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--interleave", type=int, default=0, metavar="LAYERS",
                    help="also: every case as a graph of LAYERS layers (each its own cache), all "
                         "graphs alive, replayed in turn over 3 rounds")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, FLASH_ATTENTION_PDL="
          f"{os.environ.get('FLASH_ATTENTION_PDL', '1 (default)')}, GQA 32/8 d128 bf16, causal")
    for shape in args.shapes.split(","):
        batch, seqlen = (int(x) for x in shape.split("x"))
        for kind in args.kinds.split(","):
            torch.manual_seed(0)
            step, ref, low, kv_bytes = make_case(kind, batch, seqlen, 32, 8, 128)
            check(f"{kind} {shape}", step, ref, low, kv_bytes, args.replays)
    if args.interleave:
        cases = []
        for shape in args.shapes.split(","):
            batch, seqlen = (int(x) for x in shape.split("x"))
            for kind in args.kinds.split(","):
                steps = [make_case(kind, batch, seqlen, 32, 8, 128)[0]
                         for _ in range(args.interleave)]
                cases.append((f"{kind} {shape}", lambda steps=steps: [s() for s in steps]))
        interleaved(cases, 3, 50)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
