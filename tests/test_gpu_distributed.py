"""Context parallelism on GPUs: ring_attention over NCCL with one process per GPU (2 GPUs, and 3
and 4 where the machine has them), bf16, GQA, causal and not, sliding windows (under a chunk,
and over one at 3 and 4 GPUs: partial blocks on slices; at 4 GPUs the first runs the ring one
step each way), one sequence of 1536 tokens and a varlen pack (sharded sequence by sequence),
against the fp32 reference on the whole sequence by FlashAttention's rule (the error at most
twice that of the single-GPU call of the package's kernels on the whole sequence, plus a small
floor), output and gradients; the ring by both transports (links.py) and under
torch.compile(fullgraph=True). Skipped, with the reason, on a machine with fewer than 2 GPUs."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"multi-GPU test: {torch.cuda.device_count()} GPU(s) "
                                        "here, 2 needed")]

FLOOR = 2e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _errors(got, ref32, single):
    return ((got.float() - ref32).abs().max().item(),
            (single.float() - ref32).abs().max().item())


def _check_packed(rank: int, ranks: int, method: str, transport: str, causal: bool) -> None:
    """A varlen pack of 3 sequences sharded sequence by sequence (cu_seqlens): out and grads
    against the fp32 reference per sequence, by FlashAttention's rule against the single-GPU
    varlen call on the whole pack."""
    from flash_attention.distributed import gather_packed, ring_attention, shard_packed
    from flash_attention.interface import flash_attn_varlen_func
    from flash_attention.reference import attention_reference

    lengths = [128 * ranks, 64 * ranks, 320 * ranks]
    cu = torch.tensor([0, lengths[0], lengths[0] + lengths[1], sum(lengths)],
                      dtype=torch.int32, device="cuda")
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(sum(lengths), h, 128, generator=g).cuda().bfloat16()
                     for h in (8, 2, 2, 8))
    qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
    ref = torch.cat([attention_reference(qr[None, a:b], kr[None, a:b], vr[None, a:b],
                                         causal=causal)[0][0]
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    ref_grads = torch.autograd.grad((ref * dout.float()).sum(), (qr, kr, vr))
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    single = flash_attn_varlen_func(qs, ks, vs, cu, cu, max(lengths), max(lengths),
                                    causal=causal)
    single_grads = torch.autograd.grad((single * dout).sum(), (qs, ks, vs))
    ql, kl, vl = (shard_packed(t, cu).requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, causal=causal, method=method, cu_seqlens=cu,
                         transport=transport)
    grads = torch.autograd.grad((out * shard_packed(dout, cu)).sum(), (ql, kl, vl))
    what = f"packed {method} ({transport}), rank {rank} of {ranks}, causal={causal}"
    err, err_single = _errors(gather_packed(out.detach(), cu), ref.detach(), single)
    assert err <= 2 * err_single + FLOOR, f"{what}: out {err:.3e} vs {err_single:.3e}"
    for name, mine, want, theirs in zip("qkv", grads, ref_grads, single_grads):
        err, err_single = _errors(gather_packed(mine, cu), want, theirs)
        assert err <= 2 * err_single + FLOOR, f"{what}: d{name} {err:.3e} vs {err_single:.3e}"


def _same_both_ways(q, k, v, dout, window) -> None:
    """The ring's two transports, deterministic: the same sums in the same order, so the same
    bits (a pull that read a slot before its write, or after the next one, would differ); run
    twice each, the workspace reused."""
    from flash_attention.distributed import ring_attention, shard_sequence

    ql, kl, vl, dl = (shard_sequence(t) for t in (q, k, v, dout))
    results = []
    for transport in ("push", "pull", "push", "pull"):
        xs = [t.clone().requires_grad_() for t in (ql, kl, vl)]
        out = ring_attention(*xs, causal=True, window_size=window, deterministic=True,
                             transport=transport)
        results.append((out, *torch.autograd.grad((out * dl).sum(), xs)))
    for name, *runs in zip(("out", "dq", "dk", "dv"), *results):
        assert all(torch.equal(runs[0], r) for r in runs[1:]), f"{name}, window {window}"


def _compiled_as_eager(q, k, v, dout, window) -> None:
    """torch.compile(fullgraph=True) (inductor) of the step: the ring is two custom operators,
    so the graph holds it whole; its output and gradients equal the eager call's bit for bit
    (both deterministic: the kernels' dQ atomics otherwise sum in a different order each run)."""
    from flash_attention.distributed import ring_attention, shard_sequence

    def attend(ql, kl, vl):
        return ring_attention(ql, kl, vl, causal=True, window_size=window, deterministic=True)

    results = []
    for fn in (attend, torch.compile(attend, fullgraph=True)):  # its backward compiled too
        ql, kl, vl = (shard_sequence(t).requires_grad_() for t in (q, k, v))
        out = fn(ql, kl, vl)
        results.append((out, *torch.autograd.grad((out * shard_sequence(dout)).sum(),
                                                  (ql, kl, vl))))
    for name, want, got in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=f"compiled {name}")


def _worker(rank: int, ranks: int, port: int, method: str, transport: str) -> None:
    import flash_attention as fa
    from flash_attention.distributed import gather_sequence, ring_attention, shard_sequence
    from flash_attention.reference import attention_reference

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=ranks)
    try:
        # windows over 1536 tokens: chunks of 384 (2 GPUs), 256 (3) or 192 (4)
        for causal, seed, window in ((False, 0, (-1, -1)), (True, 1, (-1, -1)),
                                     (False, 2, (100, 37)), (True, 3, (300, 0))):
            g = torch.Generator().manual_seed(seed)
            whole = [torch.randn(1, 1536, h, 128, generator=g).cuda().bfloat16()
                     for h in (8, 2, 2, 8)]
            q, k, v, dout = whole
            qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
            ref, _ = attention_reference(qr, kr, vr, causal=causal, window_size=window)
            ref_grads = torch.autograd.grad((ref * dout.float()).sum(), (qr, kr, vr))
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            single = fa.attention(qs, ks, vs, causal=causal, window_size=window)
            single_grads = torch.autograd.grad((single * dout).sum(), (qs, ks, vs))

            ql, kl, vl = (shard_sequence(t).requires_grad_() for t in (q, k, v))
            out = ring_attention(ql, kl, vl, causal=causal, method=method, window_size=window,
                                 transport=transport)
            grads = torch.autograd.grad((out * shard_sequence(dout)).sum(), (ql, kl, vl))
            if method == "ring" and transport == "pull" and causal:
                _same_both_ways(q, k, v, dout, window)
            if method == "ring" and transport == "push" and causal:
                _compiled_as_eager(q, k, v, dout, window)
            what = (f"{method} ({transport}), rank {rank} of {ranks}, causal={causal}, "
                    f"window={window}")
            err, err_single = _errors(gather_sequence(out.detach()), ref.detach(), single)
            assert err <= 2 * err_single + FLOOR, f"{what}: out {err:.3e} vs {err_single:.3e}"
            for name, mine, want, theirs in zip("qkv", grads, ref_grads, single_grads):
                err, err_single = _errors(gather_sequence(mine), want, theirs)
                assert err <= 2 * err_single + FLOOR, (
                    f"{what}: d{name} {err:.3e} vs {err_single:.3e}")
        for causal in (False, True):
            _check_packed(rank, ranks, method, transport, causal)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("method", "transport"),
                         [("ring", "pull"), ("ring", "push"), ("allgather", "auto")])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_ring_attention_over_nccl_matches_the_whole_sequence(require_extension, ranks, method,
                                                             transport):
    """Both ring transports (copy-engine pulls over symmetric memory, NCCL pushes; pulls also
    bitwise equal to pushes with deterministic=True) and the all-gather."""
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"multi-GPU test: {torch.cuda.device_count()} GPU(s) here, {ranks} needed")
    mp.spawn(_worker, args=(ranks, _free_port(), method, transport), nprocs=ranks, join=True)
