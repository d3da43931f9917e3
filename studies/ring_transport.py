"""Whether one ring step's K/V transfer hides under its attention call, by transport and by the
forward kernel's tile schedule (one process per GPU, MHA 32/32, d_head 128, bf16, batch 1, the
call unmasked as most ring calls are).

Transports: NCCL's P2P (batch_isend_irecv: a kernel of NCCL's on some SMs) and a copy-engine
pull (the peer's K/V in symmetric memory, torch.distributed._symmetric_memory, copied by
cudaMemcpyAsync on a side stream: no SM of its own). Schedules: the dispatched kernel (a static
persistent grid at this length: a CTA whose SM is still held by NCCL's kernel starts late and
still does its full share of tiles) and the masked row's kernel (the same tile, drawing tiles
from a counter, so late CTAs take fewer).

Per row, the slowest rank's median of --reps (CUDA events), every GPU at once: the transfer
alone, the call alone, and both launched as the ring launches them (transfer first). The step
hides the transfer when "both" is the call alone.

    python3 studies/ring_transport.py [--seq 32768] [--reps 7] [--streams 1,4]
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

DYNAMIC = "fwd_sm90_bf16_d128_r128_c128_s2_fwialdgzm"


def _slowest(fn, reps: int) -> tuple[float, float, float]:
    dist.barrier()
    times = _time_alone(fn, reps)
    t = torch.tensor([statistics.median(times), min(times), max(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(t.tolist())  # type: ignore[return-value]


def _worker(rank: int, ranks: int, port: int, args) -> None:
    join_group(rank, ranks, port)
    import flash_attention as fa

    local = args.seq // ranks
    q, k, v = local_shards(rank, args.seq, ranks, 3)
    kv = torch.stack((k, v)).contiguous()
    nbytes = kv.numel() * kv.element_size()
    prev, nxt = (rank - 1) % ranks, (rank + 1) % ranks

    def attend(config):
        return lambda: fa.attention(q, k, v, config=config)

    def nccl():
        buf = torch.empty_like(kv)
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt),
                                       dist.P2POp(dist.irecv, buf, prev)]), buf

    rows: list[tuple[str, tuple[float, float, float]]] = []

    def run(label, start, finish, call):
        def fn():
            handle = start() if start else None
            if call:
                call()
            if finish:
                finish(handle)
        rows.append((label, _slowest(fn, args.reps)))

    def nccl_wait(handle):
        for r in handle[0]:
            r.wait()

    for name, config in (("dispatched", None), ("dynamic", DYNAMIC)):
        run(f"call alone ({name})", None, None, attend(config))
    run("nccl alone", nccl, nccl_wait, None)
    for name, config in (("dispatched", None), ("dynamic", DYNAMIC)):
        run(f"nccl + call ({name})", nccl, nccl_wait, attend(config))

    # the same bytes through the NCCL transfer, to check the pulled copy against
    reqs, expect = nccl()
    nccl_wait((reqs, expect))
    try:
        import torch.distributed._symmetric_memory as symm_mem

        sym = symm_mem.empty(kv.shape, dtype=kv.dtype, device=kv.device)
        hdl = symm_mem.rendezvous(sym, dist.group.WORLD.group_name)
        sym.copy_(kv)
        torch.cuda.synchronize()
        dist.barrier()
        peer = hdl.get_buffer(prev, list(kv.shape), kv.dtype, 0)
    except Exception as exc:  # the study reports what this host lacks
        if rank == 0:
            print(f"symmetric memory: not available here ({type(exc).__name__}: {exc})")
        peer = None
    if peer is not None:
        dst = torch.empty_like(kv)
        side = [torch.cuda.Stream() for _ in range(max(args.streams))]
        for n in args.streams:
            flat_dst, flat_src = dst.view(-1), peer.view(-1)
            cuts = [i * flat_dst.numel() // n for i in range(n + 1)]

            def pull(n=n, cuts=cuts, flat_dst=flat_dst, flat_src=flat_src):
                here = torch.cuda.current_stream()
                for i in range(n):
                    side[i].wait_stream(here)
                    with torch.cuda.stream(side[i]):
                        flat_dst[cuts[i]:cuts[i + 1]].copy_(flat_src[cuts[i]:cuts[i + 1]])

            def join(_):
                for s in side:
                    torch.cuda.current_stream().wait_stream(s)

            run(f"ce pull alone ({n} streams)", pull, join, None)
            for name, config in (("dispatched", None), ("dynamic", DYNAMIC)):
                run(f"ce pull ({n} streams) + call ({name})", pull, join, attend(config))
        torch.cuda.synchronize()
        same = torch.equal(dst, expect)
        ok = torch.tensor([1 if same else 0], device="cuda")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if rank == 0:
            print(f"ce pull equals the NCCL transfer on every rank: {bool(ok.item())}")
    if rank == 0:
        print(f"# {ranks} GPUs, {local} tokens per GPU, K/V {nbytes / 1e6:.0f} MB per step")
        print("| row | ms (median) | min-max | GB/s of the transfer |")
        print("|---|---|---|---|")
        for label, (med, lo, hi) in rows:
            rate = f"{nbytes / med / 1e6:.0f}" if "alone" in label and "call" not in label \
                else ""
            print(f"| {label} | {med:.2f} | {lo:.2f}-{hi:.2f} | {rate} |")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    return spawn_on_every_gpu("ring_transport", _worker, ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
