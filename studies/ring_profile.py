"""Where the ring's time goes on the GPUs of one host (a diagnostic for the scaling tables of
studies/ring_bench.py): one process per GPU over NCCL, MHA 32/32, d_head 128, bf16, batch 1.

1. The compute alone: the kernel calls one rank makes in a ring forward (its shard's queries
   over each rank's keys, here its own keys P times: no transfer), timed on rank 0 while the
   other GPUs idle, then on every GPU at once. The gap is what running all GPUs together costs
   before any byte moves (clocks under the host's power, shared memory bandwidth).
2. The ring forward and forward + backward under torch.profiler on rank 0: CUDA time per kernel
   kind (attention, backward, merge, NCCL, other) against the wall time of the call.
3. One ring step taken apart (every GPU at once): the K/V transfer alone (NCCL send to the
   next rank, receive from the previous), one attention call alone, and both launched as the
   ring launches them (transfer first): the step takes the longer of the two when they
   overlap, their sum when they do not.

4. One GPU's forward + backward at S / P tokens under the profiler (the time-per-token
   reference of ring_bench), kernel by kernel beside the ring's.

    python3 studies/ring_profile.py [--seq 65536] [--causal] [--reps 5] [--transport push]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist
from ring_bench import (  # studies/ runs as scripts: a sibling
    _time_alone,
    join_group,
    local_shards,
    spawn_on_every_gpu,
)


def _kind(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if "merge_kernel" in low:
        return "merge"
    if "bwd_" in low and ("kernel" in low or "convert" in low or "preprocess" in low):
        return "backward kernels"
    if "fwd_kernel" in low:
        return "forward kernels"
    return "other"


def _profile(fn, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
    wall = start.elapsed_time(end)
    kinds: dict[str, float] = {}
    names: dict[str, tuple[float, int]] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0)
        if evt.device_type.name != "CUDA" or t <= 0:
            continue
        kinds[_kind(evt.key)] = kinds.get(_kind(evt.key), 0.0) + t / 1e3
        total, count = names.get(evt.key[:90], (0.0, 0))
        names[evt.key[:90]] = (total + t / 1e3, count + evt.count)
    print(f"## {label}: wall {wall:.2f} ms on rank 0; CUDA time by kind (ms): "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda x: -x[1])))
    for key, (t, count) in sorted(names.items(), key=lambda x: -x[1][0])[:20]:
        print(f"    {t:8.2f} ms  x{count:<3d} {key}")
    _timeline(prof)


def _timeline(prof) -> None:
    """The call's GPU work in time order (from the profiler's trace): each kernel or copy of
    20 us or more with its stream, and the idle gaps of 20 us or more on the stream the
    attention kernels run on (where the GPU waits: a transfer, a barrier, the host)."""
    import json
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"]
             and e.get("dur", 0) >= 20]
    if not gpu:
        return
    t0 = gpu[0]["ts"]
    main = next((e["args"].get("stream") for e in gpu if "fwd_kernel" in e["name"]
                 or "bwd_kernel" in e["name"]), None)
    print(f"    timeline (ms from the first GPU event; attention stream {main}):")
    last_end = None
    for e in gpu:
        stream = e["args"].get("stream")
        if stream == main and last_end is not None and e["ts"] - last_end >= 20:
            print(f"      {(last_end - t0) / 1e3:7.3f}  idle {(e['ts'] - last_end) / 1e3:.3f}")
        if e.get("dur", 0) >= 20:
            print(f"      {(e['ts'] - t0) / 1e3:7.3f}  {e['dur'] / 1e3:6.3f} s{stream} "
                  f"{e['name'][:70]}")
        if stream == main:
            last_end = max(last_end or 0, e["ts"] + e.get("dur", 0))
    for e in syncs:
        print(f"      host {e['name']} at {(e['ts'] - t0) / 1e3:.3f} for {e['dur'] / 1e3:.3f}")


def _worker(rank: int, ranks: int, port: int, args) -> None:
    join_group(rank, ranks, port)
    import flash_attention as fa
    from flash_attention.distributed import ring_attention

    local = args.seq // ranks
    q, k, v, dout = local_shards(rank, args.seq, ranks, 4)

    def compute():  # the ring forward's kernel calls without transfers: P calls on local keys
        for _ in range(ranks):
            fa.attention(q, k, v, causal=args.causal)

    if rank == 0:
        alone = _time_alone(compute, args.reps)
        print(f"# {ranks} GPUs, S {args.seq} ({local} per GPU), causal={args.causal}")
        print(f"compute alone (rank 0, others idle): {statistics.median(alone):.2f} ms "
              f"[{min(alone):.2f}-{max(alone):.2f}] for {ranks} calls of {local}x{local}")
    dist.barrier()
    together = _time_alone(compute, args.reps)
    t = torch.tensor([statistics.median(together)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"compute on every GPU at once: {t.item():.2f} ms (the slowest rank's median)")
    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    kv = torch.stack((k, v)).contiguous()

    def transfer():
        buf = torch.empty_like(kv)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % ranks),
                                       dist.P2POp(dist.irecv, buf, (rank - 1) % ranks)])
        return reqs

    def shift():
        for r in transfer():
            r.wait()

    def attend():
        fa.attention(q, k, v, causal=args.causal)

    def both():
        reqs = transfer()
        attend()
        for r in reqs:
            r.wait()

    parts = []
    for fn in (shift, attend, both):
        dist.barrier()
        t = torch.tensor([statistics.median(_time_alone(fn, args.reps))], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        parts.append(t.item())
    if rank == 0:
        rate = kv.numel() * kv.element_size() / parts[0] / 1e6
        print(f"one step: transfer {parts[0]:.2f} ms ({rate:.0f} GB/s), attention "
              f"{parts[1]:.2f} ms, both {parts[2]:.2f} ms (the slowest rank's medians)")

    def fwd():
        with torch.no_grad():
            ring_attention(ql, kl, vl, causal=args.causal, transport=args.transport)

    def step():
        out = ring_attention(ql, kl, vl, causal=args.causal, transport=args.transport)
        torch.autograd.grad(out, (ql, kl, vl), dout)

    def one_gpu():  # the reference: one GPU's forward + backward at S / P tokens
        out = fa.attention(ql, kl, vl, causal=args.causal)
        torch.autograd.grad(out, (ql, kl, vl), dout)

    for label, fn in (("ring forward", fwd), ("ring forward + backward", step),
                      (f"one GPU forward + backward at {local} tokens", one_gpu)):
        if rank == 0:
            _profile(fn, label)
        else:
            fn()
            torch.cuda.synchronize()
            dist.barrier()
            fn()
            torch.cuda.synchronize()
        dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=65536)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transport", default="push", choices=("push", "pull", "auto"))
    return spawn_on_every_gpu("ring_profile", _worker, ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
