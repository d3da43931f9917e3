"""Context parallelism (flash_attention.distributed) on the CPU: the zigzag layout for any group
size (chunks, balanced causal work, every block exactly once), the LSE merge, and the forward
and backward of both methods (ring, all-gather) over gloo with 1-4 processes against the
reference on the whole sequence (the blocks run the fp32 reference on CPU tensors; the GPU path
runs the same code with the package's operators over NCCL: tests/test_gpu_distributed.py).
Causal and not, GQA, softcap."""

from __future__ import annotations

import itertools
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_attention.distributed import (
    Layout,
    gather_packed,
    gather_sequence,
    merge_partials,
    ring_attention,
    shard_packed,
    shard_sequence,
)
from flash_attention.distributed.layout import DIAGONAL, FULL
from flash_attention.reference import attention_reference


@pytest.mark.parametrize("ranks", range(1, 9))
def test_zigzag_layout_balances_causal_work_and_covers_every_block_once(ranks):
    layout = Layout(ranks)
    held = sorted(c for r in range(ranks) for c in layout.chunks_of(r))
    assert held == list(range(2 * ranks)), "each chunk on exactly one rank"
    seen = []
    for rank in range(ranks):
        work = [vis for src in range(ranks) for _, _, vis in layout.blocks(rank, src, True)]
        assert work.count(FULL) == 2 * ranks - 1 and work.count(DIAGONAL) == 2, rank
        for src in range(ranks):
            for i, j, _ in layout.blocks(rank, src, True):
                seen.append((layout.chunks_of(rank)[i], layout.chunks_of(src)[j]))
    assert sorted(seen) == sorted((a, b) for a in range(2 * ranks) for b in range(a + 1))
    full = [b for r in range(ranks) for s in range(ranks) for b in layout.blocks(r, s, False)]
    assert len(full) == 4 * ranks * ranks and all(vis == FULL for _, _, vis in full)


def test_layout_refuses_what_does_not_split():
    with pytest.raises(ValueError, match="does not split into 6 equal chunks"):
        Layout(3).check_length(100)
    with pytest.raises(ValueError, match="rank 3 is not in a group of 2"):
        Layout(2).chunks_of(3)
    with pytest.raises(ValueError, match="at least one rank"):
        Layout(0)


def test_merge_of_partials_is_attention_over_the_union():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 5, 3, 8), torch.randn(2, 12, 3, 8), torch.randn(2, 12, 3, 8)
    whole, whole_lse = attention_reference(q, k, v)
    a, la = attention_reference(q, k[:, :7], v[:, :7])
    b, lb = attention_reference(q, k[:, 7:], v[:, 7:])
    out, lse = merge_partials(*merge_partials(None, None, a, la), b, lb)
    torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-6, rtol=1e-5)
    empty = torch.full_like(la, -math.inf)  # a partial that saw no key changes nothing
    out2, lse2 = merge_partials(a, la, torch.zeros_like(a), empty)
    assert torch.equal(out2, a) and torch.equal(lse2, la)
    out3, lse3 = merge_partials(torch.zeros_like(a), empty, torch.zeros_like(a), empty)
    assert torch.equal(out3, torch.zeros_like(a)) and bool(torch.isinf(lse3).all())


def test_ring_needs_an_initialised_group():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"torch\.distributed initialised"):
        ring_attention(q, q, q)


# ---- the ring over gloo ---------------------------------------------------------------------

CASES = [  # batch, seqlen, heads, kv_heads, d_head, causal, softcap
    (2, 48, 4, 4, 16, False, 0.0),
    (1, 48, 4, 2, 16, True, 0.0),
    (2, 24, 6, 1, 8, True, 5.0),
    (1, 72, 2, 2, 32, False, 3.0),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_case(batch, seqlen, heads, kv_heads, d_head, causal, softcap, seed,
                method="ring") -> None:
    g = torch.Generator().manual_seed(seed)  # the same whole tensors on every rank
    q = torch.randn(batch, seqlen, heads, d_head, generator=g)
    k = torch.randn(batch, seqlen, kv_heads, d_head, generator=g)
    v = torch.randn(batch, seqlen, kv_heads, d_head, generator=g)
    dout = torch.randn(batch, seqlen, heads, d_head, generator=g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = attention_reference(qr, kr, vr, None, True, causal, (-1, -1), softcap)
    (out_ref * dout).sum().backward()

    ql, kl, vl = (shard_sequence(t).requires_grad_() for t in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, causal=causal, softcap=softcap, return_lse=True,
                              method=method)
    (out * shard_sequence(dout)).sum().backward()
    what = (f"{method}, rank {dist.get_rank()} of {dist.get_world_size()}: "
            f"{batch, seqlen, heads, kv_heads}")
    tol = {"atol": 2e-5, "rtol": 1e-4}
    torch.testing.assert_close(out, shard_sequence(out_ref.detach()), **tol, msg=what)
    torch.testing.assert_close(lse, shard_sequence(lse_ref, dim=2), **tol, msg=what)
    torch.testing.assert_close(gather_sequence(out.detach()), out_ref.detach(), **tol, msg=what)
    for name, got, want in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad),
                            ("dv", vl.grad, vr.grad)):
        torch.testing.assert_close(got, shard_sequence(want), **tol, msg=f"{what}: {name}")


def _check_packed(ranks: int, heads, kv_heads, causal, softcap, seed, method) -> None:
    """A varlen pack of three sequences (3, 1 and 5 times 2 x ranks tokens), sharded sequence by
    sequence: outputs, LSEs and gradients against the reference on each whole sequence."""
    g = torch.Generator().manual_seed(seed)
    lengths = [2 * ranks * m for m in (3, 1, 5)]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    total, d = int(cu[-1]), 8
    q = torch.randn(total, heads, d, generator=g)
    k, v = (torch.randn(total, kv_heads, d, generator=g) for _ in range(2))
    dout = torch.randn(total, heads, d, generator=g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    outs, lses = [], []
    for s0, s1 in itertools.pairwise(cu.tolist()):
        o, lse = attention_reference(qr[None, s0:s1], kr[None, s0:s1], vr[None, s0:s1], None,
                                     True, causal, (-1, -1), softcap)
        outs.append(o[0])
        lses.append(lse[0])
    out_ref, lse_ref = torch.cat(outs), torch.cat(lses, dim=1)
    (out_ref * dout).sum().backward()

    ql, kl, vl = (shard_packed(t, cu).requires_grad_() for t in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, causal=causal, softcap=softcap, return_lse=True,
                              method=method, cu_seqlens=cu)
    (out * shard_packed(dout, cu)).sum().backward()
    what = f"packed {method}, rank {dist.get_rank()} of {ranks}, causal={causal}"
    tol = {"atol": 2e-5, "rtol": 1e-4}
    torch.testing.assert_close(out, shard_packed(out_ref.detach(), cu), **tol, msg=what)
    torch.testing.assert_close(lse, shard_packed(lse_ref.T, cu).T, **tol, msg=what)
    torch.testing.assert_close(gather_packed(out.detach(), cu), out_ref.detach(), **tol, msg=what)
    for name, got, want in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad),
                            ("dv", vl.grad, vr.grad)):
        torch.testing.assert_close(got, shard_packed(want, cu), **tol, msg=f"{what}: {name}")


def _worker(rank: int, ranks: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        for method in ("ring", "allgather"):
            for seed, case in enumerate(CASES):
                if case[1] % (2 * ranks) == 0:
                    _check_case(*case, seed=seed, method=method)
            for seed, (heads, kv_heads, causal, softcap) in enumerate(
                    ((4, 2, True, 0.0), (2, 2, False, 5.0))):
                _check_packed(ranks, heads, kv_heads, causal, softcap, seed, method)
        with pytest.raises(ValueError, match="method must be one of ring, allgather"):
            x = torch.zeros(1, 4, 2, 8)
            ring_attention(x, x, x, method="tree")
        with pytest.raises(ValueError, match="two equal chunks"):
            x = torch.zeros(1, 3, 2, 8)
            ring_attention(x, x, x)
        with pytest.raises(ValueError, match="multiple of 2 x ranks"):
            x = torch.zeros(2 * ranks + 1, 2, 8)
            ring_attention(x, x, x, cu_seqlens=torch.tensor([0, 2 * ranks + 1]))
        if ranks > 1:  # every rank raises (none hangs in the ring)
            x = torch.zeros(1, 2 * (ranks + rank % 2), 2, 8)
            with pytest.raises(ValueError, match="the ranks' shards differ"):
                ring_attention(x, x, x)
        with pytest.raises(ValueError, match="3-D tensor"):
            x = torch.zeros(1, 2 * ranks, 2, 8)
            ring_attention(x, x, x, cu_seqlens=torch.tensor([0, 2 * ranks]))
        # a deterministic backward gives the same gradients twice
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, 4 * ranks, 2, 8, generator=g).requires_grad_()
                   for _ in range(3))
        grads = []
        for _ in range(2):
            out = ring_attention(q, k, v, causal=True, deterministic=True)
            grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        grads = []
        for _ in range(2):
            out = ring_attention(q, k, v, causal=True, deterministic=True, method="allgather")
            grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    finally:
        dist.destroy_process_group()


def _compile_worker(rank: int, ranks: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, 8 * ranks, 4, 8, generator=g)
        k, v = (torch.randn(1, 8 * ranks, 2, 8, generator=g) for _ in range(2))  # GQA 4/2

        def step(q, k, v):
            return (ring_attention(q, k, v, causal=True) ** 2).sum()

        results = []
        for fn in (step, torch.compile(step, backend="aot_eager")):
            ql, kl, vl = (shard_sequence(t).requires_grad_() for t in (q, k, v))
            loss = fn(ql, kl, vl)
            results.append((loss.detach(), *torch.autograd.grad(loss, (ql, kl, vl))))
        for eager, compiled in zip(*results):
            torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)
    finally:
        dist.destroy_process_group()


def test_ring_attention_under_torch_compile():
    """torch.compile of a step calling ring_attention gives the eager step's loss and gradients:
    the code around it is compiled, the ring runs eagerly behind a graph break (dynamo does not
    trace P2P operations unless TORCHDYNAMO_ENABLE_P2P_COMPILATION is set, so fullgraph=True is
    refused there). CPU, gloo."""
    mp.spawn(_compile_worker, args=(2, _free_port()), nprocs=2, join=True)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_ring_attention_over_gloo_matches_the_whole_sequence(ranks):
    mp.spawn(_worker, args=(ranks, _free_port()), nprocs=ranks, join=True)


def test_cases_split_for_every_group_size_tested():
    for ranks, case in itertools.product([1, 2, 3, 4], CASES):
        if ranks in (1, 2):
            assert case[1] % (2 * ranks) == 0, (ranks, case)
    assert sum(case[1] % 24 == 0 for case in CASES) == len(CASES)  # 3 and 4 ranks: all split
