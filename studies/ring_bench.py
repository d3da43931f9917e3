"""Context parallelism on the GPUs of one host, side by side in one run: forward and forward +
backward of attention over one sequence sharded over every GPU (flash_attention.distributed:
the ring by copy-engine pulls and by NCCL pushes, and the all-gather), against PyTorch's
context_parallel over SDPA (its cuDNN and flash backends, load-balanced for causal), and
against one GPU running the whole sequence alone (this package's attention), one process per
GPU over NCCL.

Rows: per total sequence length S and mask, each contender's milliseconds per call (the slowest
rank's CUDA-event time; median over --reps calls after warm-up calls, the spread min-max), its
TFLOP/s per GPU (the mask's attention FLOPs of the whole sequence over time x GPUs), and the
scaling efficiency T_one_gpu(S) / (P x T_P(S)): 1.0 is perfect strong scaling, every byte of
communication hidden; and the time per token against one GPU's at the same tokens per GPU,
T_P(S) / (P x T_one_gpu(S / P)) (issue 47's measure: 1.0 ideal for attention, whose work grows
as S squared; one GPU's kernels run a little better on the longer sequence, so this one is the
easier of the two by that much). --long S times one forward + backward at S tokens (GQA) on
every GPU with the ring and reports peak memory per GPU. --window L gives every mask a sliding
window of L keys back (and L ahead when not causal), the FLOPs those of the pairs it keeps;
torch's context_parallel is left out then (SDPA takes no window).

    python3 studies/ring_bench.py [--seqs 32768,65536,131072] [--heads 32/32] [--d 128]
        [--reps 5] [--long 524288] [--window 4096] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, ranks: int, port: int) -> None:
    """This process's GPU and its NCCL group (one process per GPU of the host)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=ranks, device_id=torch.device(rank))


def local_shards(rank: int, seq: int, ranks: int, count: int) -> list[torch.Tensor]:
    """count random (1, seq / ranks, 32, 128) bf16 tensors of this rank (MHA 32 heads, d 128)."""
    g = torch.Generator(device="cuda").manual_seed(rank)
    return [torch.randn(1, seq // ranks, 32, 128, device="cuda", dtype=torch.bfloat16,
                        generator=g) for _ in range(count)]


def spawn_on_every_gpu(study: str, worker, args) -> int:
    """worker(rank, ranks, port, args) in one process per GPU of the host (the ring studies);
    2 with a message where the host has fewer than 2 GPUs."""
    ranks = torch.cuda.device_count()
    if ranks < 2:
        print(f"{study}: {ranks} GPU(s) here; context parallelism needs 2 or more")
        return 2
    mp.spawn(worker, args=(ranks, _free_port(), args), nprocs=ranks, join=True)
    return 0


def window_of(causal: bool, window: int) -> tuple[int, int]:
    """--window's (left, right) for a mask: L back, and L ahead unless causal; (-1, -1) none."""
    return (window, 0 if causal else window) if window > 0 else (-1, -1)


def flops(seq: int, heads: int, d: int, causal: bool, backward: bool,
          window: tuple[int, int] = (-1, -1)) -> float:
    """Attention FLOPs of one sequence: 4 S^2 H d forward (two GEMMs), 2.5x that with the
    backward (five GEMMs); half under a causal mask; a window's: 4 H d per pair it keeps."""
    if window != (-1, -1):
        from flash_attention.masks import visible_pairs

        f = 4.0 * visible_pairs(seq, seq, *window) * heads * d
    else:
        f = 4.0 * seq * seq * heads * d * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def _time(fn, reps: int, warmup: int = 2) -> list[float]:
    """ms of each of reps calls on this rank; every rank starts each call together."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def _slowest(times: list[float]) -> list[float]:
    """Each call's time on the slowest rank."""
    t = torch.tensor(times, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _ours(q, k, v, dout, causal, method, window=(-1, -1), transport="auto"):
    from flash_attention.distributed import ring_attention, shard_sequence

    ql, kl, vl = (shard_sequence(t).requires_grad_() for t in (q, k, v))
    dl = shard_sequence(dout)

    def fwd():
        with torch.no_grad():
            ring_attention(ql, kl, vl, causal=causal, method=method, window_size=window,
                           transport=transport)

    def step():
        out = ring_attention(ql, kl, vl, causal=causal, method=method, window_size=window,
                             transport=transport)
        torch.autograd.grad(out, (ql, kl, vl), dl)

    return fwd, step


def _torch_cp(q, k, v, dout, causal, backend, mesh):
    """PyTorch's context_parallel over SDPA on the (batch, heads, seq, d) layout; kv heads
    repeated to q's (SDPA's CP path takes equal heads). Returns (fwd, step) run inside the
    context (entered here, left by the caller through the returned exit)."""
    import contextlib

    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import sdpa_kernel

    group = q.shape[2] // k.shape[2]
    qt, kt, vt, dt = (t.transpose(1, 2).contiguous() for t in
                      (q, k.repeat_interleave(group, 2), v.repeat_interleave(group, 2), dout))
    stack = contextlib.ExitStack()
    # torch's load balancing (on by default) refuses is_causal=False: off for such calls
    from torch.distributed.tensor.experimental import _attention as cp_attention

    options = cp_attention._cp_options
    balance = options.enable_load_balance
    options.enable_load_balance = causal
    stack.callback(lambda: setattr(options, "enable_load_balance", balance))
    stack.enter_context(context_parallel(mesh, buffers=(qt, kt, vt, dt),
                                         buffer_seq_dims=(2, 2, 2, 2)))
    stack.enter_context(sdpa_kernel([backend]))
    for t in (qt, kt, vt):
        t.requires_grad_()
    # the context resizes its buffers back on exit, which a tensor that requires grad refuses
    stack.callback(lambda: [t.requires_grad_(False) for t in (qt, kt, vt)])

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def step():
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        torch.autograd.grad(out, (qt, kt, vt), dt)

    return fwd, step, stack


def _one_gpu(q, k, v, dout, causal, window=(-1, -1)):
    import flash_attention as fa

    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            fa.attention(qs, ks, vs, causal=causal, window_size=window)

    def step():
        out = fa.attention(qs, ks, vs, causal=causal, window_size=window)
        torch.autograd.grad(out, (qs, ks, vs), dout)

    return fwd, step


def _measure(name, make, reps, rank, rows_out, key):
    """Time a contender's fwd and step on every rank; record the slowest rank's times."""
    stack = None
    try:
        made = make()
        fwd, step = made[0], made[1]
        stack = made[2] if len(made) > 2 else None
        for what, fn in (("fwd", fwd), ("fwd+bwd", step)):
            rows_out.setdefault(key, {}).setdefault(name, {})[what] = _slowest(_time(fn, reps))
    except Exception as exc:  # a peer that fails here is reported, not fatal
        err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if rank == 0:
            traceback.print_exc()
        rows_out.setdefault(key, {})[name] = {"error": err}
    finally:
        if stack is not None:
            stack.close()
        torch.cuda.empty_cache()


def _worker(rank: int, ranks: int, port: int, args, result_path: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=ranks, device_id=torch.device(rank))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (ranks,))
    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    rows: dict = {}
    for seq in (int(s) for s in args.seqs.split(",")):
        for causal in (True, False):
            _one_shape(seq, causal, heads, kv_heads, args, rank, mesh, rows)
    if args.long:
        rows["long"] = _long_run(args, rank, ranks)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _one_shape(seq, causal, heads, kv_heads, args, rank, mesh, rows) -> None:
    """Every contender at one total sequence length and mask (rows[key][name][fwd|fwd+bwd])."""
    from torch.nn.attention import SDPBackend

    key = f"{seq}|{causal}"
    window = window_of(causal, args.window)
    g = torch.Generator(device="cuda").manual_seed(seq)
    q = torch.randn(1, seq, heads, args.d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, seq, kv_heads, args.d, device="cuda", dtype=torch.bfloat16,
                        generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    if rank == 0:
        print(f"# S {seq}, causal={causal}, window={window}", flush=True)
    for name, method, transport in (("ours ring pull", "ring", "pull"),
                                    ("ours ring push", "ring", "push"),
                                    ("ours allgather", "allgather", "auto")):
        _measure(name, lambda m=method, t=transport: _ours(q, k, v, dout, causal, m, window, t),
                 args.reps, rank, rows, key)
    for label, backend in (("torch cp cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("torch cp flash", SDPBackend.FLASH_ATTENTION)):
        if window != (-1, -1):
            break  # SDPA takes no window
        _measure(label, lambda b=backend: _torch_cp(q, k, v, dout, causal, b, mesh),
                 args.reps, rank, rows, key)
    # one GPU alone on the whole sequence, and on one GPU's share of it (rank 0; the others
    # wait at the barrier)
    if rank == 0:
        share = seq // dist.get_world_size()
        for name, n in (("one gpu", seq), ("one gpu, S/P", share)):
            fwd, step = _one_gpu(q[:, :n], k[:, :n], v[:, :n], dout[:, :n], causal, window)
            rows[key][name] = {"fwd": _time_alone(fwd, args.reps),
                               "fwd+bwd": _time_alone(step, args.reps)}
    dist.barrier()
    torch.cuda.empty_cache()


def _time_alone(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def _long_run(args, rank, ranks) -> dict:
    """One forward + backward at --long tokens (GQA 32/8, d 128, causal) with the ring: each
    rank makes only its own shard (the whole sequence never exists on one GPU)."""
    from flash_attention.distributed import ring_attention

    seq = args.long
    local = seq // ranks
    torch.cuda.reset_peak_memory_stats()
    g = torch.Generator(device="cuda").manual_seed(rank)
    q = torch.randn(1, local, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, local, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    dout = torch.randn_like(q)

    def step():
        out = ring_attention(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    times = _slowest(_time(step, reps=2, warmup=1))
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"seq": seq, "ms": times, "peak_GiB_per_gpu": peak.item(),
            "tflops_per_gpu": flops(seq, 32, 128, True, True) / (statistics.median(times) * 1e-3)
            / ranks / 1e12}


def report(rows: dict, ranks: int, heads: int, d: int, window: int = 0) -> list[dict]:
    table = []
    print(f"\n# context parallelism, {ranks} x {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, bf16, heads {heads}, d_head {d}"
          + (f", window {window}" if window > 0 else "") + "; ms median [min-max], "
          f"TFLOP/s per GPU, scaling = T(one GPU) / ({ranks} x T)")
    for key, contenders in rows.items():
        if key == "long":
            continue
        seq, causal = key.split("|")
        seq, causal = int(seq), causal == "True"
        print(f"S {seq} ({seq // ranks} per GPU), causal={causal}:")
        one = contenders.get("one gpu", {})
        share = contenders.get("one gpu, S/P", {})
        for name, res in contenders.items():
            if "error" in res:
                print(f"  {name:16s} failed: {res['error']}")
                table.append({"seq": seq, "causal": causal, "name": name, "error": res["error"]})
                continue
            for what in ("fwd", "fwd+bwd"):
                t = res[what]
                med = statistics.median(t)
                alone = name.startswith("one gpu")
                gpus, tokens = (1, seq // ranks) if name == "one gpu, S/P" else (
                    1 if alone else ranks, seq)
                tf = flops(tokens, heads, d, causal, what == "fwd+bwd",
                           window_of(causal, window)) / (med * 1e-3) / gpus / 1e12
                scale = statistics.median(one[what]) / (ranks * med) if one and not alone else None
                # the time per token against one GPU's at the same tokens per GPU (S / P)
                per_token = (med / (ranks * statistics.median(share[what]))
                             if share and not alone else None)
                print(f"  {name:16s} {what:8s} {med:9.2f} ms [{min(t):.2f}-{max(t):.2f}] "
                      f"{tf:6.0f} TFLOP/s/GPU" + (f"  scaling {scale:.2f}" if scale else "")
                      + (f"  per token {per_token:.2f}x one GPU's at S/P" if per_token else ""))
                table.append({"seq": seq, "causal": causal, "window": window_of(causal, window),
                              "name": name, "what": what,
                              "ms": med, "spread": [min(t), max(t)], "tflops_per_gpu": tf,
                              "scaling": scale, "per_token_vs_share": per_token})
    if "long" in rows:
        lr = rows["long"]
        print(f"long: S {lr['seq']} GQA 32/8 causal fwd+bwd with the ring: "
              f"{statistics.median(lr['ms']):.0f} ms ({lr['tflops_per_gpu']:.0f} TFLOP/s/GPU), "
              f"peak {lr['peak_GiB_per_gpu']:.1f} GiB per GPU")
        table.append({"long": lr})
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="32768,65536,131072")
    ap.add_argument("--heads", default="32/32", help="query/kv heads (torch's CP gets kv "
                    "heads repeated to the query heads)")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--long", type=int, default=0, help="also one fwd+bwd at this many tokens")
    ap.add_argument("--window", type=int, default=0, help="a sliding window of this many keys "
                    "back (and ahead when not causal); 0: none")
    ap.add_argument("--json")
    args = ap.parse_args()
    ranks = torch.cuda.device_count()
    if ranks < 2:
        print(f"ring_bench: {ranks} GPU(s) here; context parallelism needs 2 or more")
        return 2
    path = f"/tmp/ring_bench_{os.getpid()}.json"
    mp.spawn(_worker, args=(ranks, _free_port(), args, path), nprocs=ranks, join=True)
    with open(path) as f:
        rows = json.load(f)
    heads = int(args.heads.split("/")[0])
    table = report(rows, ranks, heads, args.d, args.window)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpus": ranks, "device": torch.cuda.get_device_name(), "heads": args.heads,
                       "d": args.d, "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
