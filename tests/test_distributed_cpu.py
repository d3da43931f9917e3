"""Context parallelism (flash_attention.distributed) on the CPU: the zigzag layout for any group
size (chunks, balanced causal work, every block exactly once), the sliding-window plan (its
calls cover the window's mask exactly once, its ring steps), the LSE merge, and the forward
and backward of both methods (ring, all-gather) over gloo with 1-4 processes (6 for the
shortened ring) against the reference on the whole sequence (the blocks run the fp32
reference on CPU tensors; the GPU path runs the same code with the package's operators over
NCCL: tests/test_gpu_distributed.py). Causal and not, sliding windows, GQA, softcap."""

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
from flash_attention.distributed import links as links_module
from flash_attention.distributed import ring as ring_module
from flash_attention.distributed.layout import BOTH, DIAGONAL, FULL, Plan, Span, plan_for
from flash_attention.masks import canonical_window, visible
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


def _plan_mask(plan: Plan) -> torch.Tensor:
    """(S, S) int: how many of the plan's calls, over every pair of ranks, compute each (query,
    key) pair of the whole sequence (a call's window read on its slices, as the kernels do)."""
    layout, c = plan.layout, plan.chunk
    seqlen = layout.chunks * c
    count = torch.zeros(seqlen, seqlen, dtype=torch.int64)
    for q_rank, kv_rank in itertools.product(range(layout.ranks), repeat=2):
        # global position of each of kv_rank's local key rows (its two chunks back to back)
        keys = torch.cat([torch.arange(b * c, (b + 1) * c) for b in layout.chunks_of(kv_rank)])
        queries = torch.cat([torch.arange(a * c, (a + 1) * c) for a in layout.chunks_of(q_rank)])
        for span in plan.spans(q_rank, kv_rank):
            seen = visible(span.q1 - span.q0, span.k1 - span.k0, *span.window).long()
            rows = queries[slice(*span.local_rows(c))]
            count[rows[:, None], keys[span.k0:span.k1][None, :]] += seen
    return count


WINDOWS = [-1, 0, 1, 2, 3, 5, 7, 11, 40]


@pytest.mark.parametrize("ranks", range(1, 7))
def test_window_calls_cover_the_mask_exactly_once(ranks):
    """Every (query, key) pair a window (and causal) lets see is computed by exactly one call,
    no other pair is, whatever the chunk length against the window: under a chunk, between one
    and several, beyond the sequence."""
    for c, (left, right), causal in itertools.product((1, 2, 3, 4), itertools.product(
            WINDOWS, repeat=2), (False, True)):
        seqlen = 2 * ranks * c
        window = canonical_window(causal, (left, right), seqlen, seqlen)
        plan = plan_for(ranks, c, *window)
        want = visible(seqlen, seqlen, *window).long()
        assert torch.equal(_plan_mask(plan), want), (ranks, c, left, right, causal)
        forward, backward = plan.steps
        for q_rank, kv_rank in itertools.product(range(ranks), repeat=2):
            d = (q_rank - kv_rank) % ranks
            if plan.spans(q_rank, kv_rank):  # the ring's steps reach every keys seen
                assert d <= forward or ranks - d <= backward, (ranks, c, window, plan.steps)


@pytest.mark.parametrize("ranks", range(1, 9))
def test_plan_without_a_window_is_the_whole_ring_one_call_per_pair_of_ranks(ranks):
    """No window: the ring runs whole, one way, and a rank makes one call on each rank's keys:
    both query chunks over all its keys unmasked, or causal over its own shard, or over the
    first key chunk (a rank after it, causal); the second query chunk alone over all keys (a
    rank before it, causal)."""
    for causal in (False, True):
        plan = plan_for(ranks, 8, -1, 0 if causal else -1)
        assert plan.steps == (ranks - 1, 0)
        for q_rank, kv_rank in itertools.product(range(ranks), repeat=2):
            (span,) = plan.spans(q_rank, kv_rank)
            if not causal:
                want = Span(BOTH, 0, 16, 0, 16, -1, -1)
            elif kv_rank == q_rank:
                want = Span(BOTH, 0, 16, 0, 16, -1, 0)
            elif kv_rank < q_rank:
                want = Span(BOTH, 0, 16, 0, 8, -1, -1)
            else:
                want = Span(1, 0, 8, 0, 16, -1, -1)
            assert span == want, (q_rank, kv_rank, causal)


@pytest.mark.parametrize(("ranks", "chunk", "window", "steps"), [
    (4, 6, (3, 0), (1, 1)),   # under a chunk: the ranks either side (zigzag: both ways)
    (8, 4, (3, 0), (1, 1)),
    (8, 4, (4, 0), (1, 1)),   # a whole chunk back is still the neighbour's
    (8, 4, (5, 0), (2, 2)),   # one key into the chunk two back
    (8, 4, (9, 0), (3, 3)),
    (8, 4, (3, 3), (1, 1)),
    (8, 4, (0, 0), (0, 0)),   # every query sees its own key: no transfer
    (2, 4, (0, 0), (0, 0)),
    (2, 4, (1, 0), (1, 0)),   # 2 ranks: one step is the whole ring
    (3, 4, (1, 0), (2, 0)),   # 3 ranks: both neighbours make the whole ring
    (4, 6, (7, 0), (3, 0)),   # two steps both ways would be no fewer transfers
    (8, 4, (-1, 3), (7, 0)),  # unbounded left: every rank's keys
    (8, 4, (15, 0), (7, 0)),
])
def test_ring_steps_shrink_to_the_window(ranks, chunk, window, steps):
    assert plan_for(ranks, chunk, *window).steps == steps


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


WINDOW_CASES = [  # the same, then window_size; chunks of 24, 12, 8, 6 tokens at 1-4 ranks
    (1, 48, 4, 2, 16, False, 0.0, (3, 2)),     # both sides under a chunk
    (2, 48, 4, 4, 16, True, 0.0, (4, -1)),     # causal: right 0
    (1, 48, 4, 2, 8, False, 0.0, (10, 0)),     # (w, 0): one to two chunks back at 3-4 ranks
    (1, 48, 2, 2, 8, False, 3.0, (20, 13)),    # several chunks, softcap
    (1, 48, 6, 1, 8, False, 0.0, (-1, 5)),     # unbounded left, MQA
    (1, 48, 2, 2, 8, False, 0.0, (7, -1)),     # unbounded right
    (1, 48, 2, 2, 8, True, 5.0, (100, 0)),     # beyond the sequence: plain causal
    (1, 48, 2, 2, 8, False, 0.0, (0, 0)),      # each query its own key only
    (1, 48, 4, 2, 8, True, 0.0, (7, 3)),       # causal with right > 0: right 0, as attention()
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_case(batch, seqlen, heads, kv_heads, d_head, causal, softcap, window=(-1, -1), *,
                seed, method="ring", transport="auto") -> None:
    g = torch.Generator().manual_seed(seed)  # the same whole tensors on every rank
    q = torch.randn(batch, seqlen, heads, d_head, generator=g)
    k = torch.randn(batch, seqlen, kv_heads, d_head, generator=g)
    v = torch.randn(batch, seqlen, kv_heads, d_head, generator=g)
    dout = torch.randn(batch, seqlen, heads, d_head, generator=g)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref, lse_ref = attention_reference(qr, kr, vr, None, True, causal, window, softcap)
    (out_ref * dout).sum().backward()

    ql, kl, vl = (shard_sequence(t).requires_grad_() for t in (q, k, v))
    out, lse = ring_attention(ql, kl, vl, causal=causal, softcap=softcap, return_lse=True,
                              method=method, window_size=window, transport=transport)
    (out * shard_sequence(dout)).sum().backward()
    what = (f"{method} ({transport}), rank {dist.get_rank()} of {dist.get_world_size()}: "
            f"{batch, seqlen, heads, kv_heads}, causal={causal}, window={window}")
    tol = {"atol": 2e-5, "rtol": 1e-4}
    torch.testing.assert_close(out, shard_sequence(out_ref.detach()), **tol, msg=what)
    torch.testing.assert_close(lse, shard_sequence(lse_ref, dim=2), **tol, msg=what)
    torch.testing.assert_close(gather_sequence(out.detach()), out_ref.detach(), **tol, msg=what)
    for name, got, want in (("dq", ql.grad, qr.grad), ("dk", kl.grad, kr.grad),
                            ("dv", vl.grad, vr.grad)):
        torch.testing.assert_close(got, shard_sequence(want), **tol, msg=f"{what}: {name}")


def _check_packed(ranks: int, heads, kv_heads, causal, softcap, seed, method,
                  transport="auto") -> None:
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
                              method=method, cu_seqlens=cu, transport=transport)
    (out * shard_packed(dout, cu)).sum().backward()
    what = f"packed {method} ({transport}), rank {dist.get_rank()} of {ranks}, causal={causal}"
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
        for method, transport in (("ring", "push"), ("ring", "pull"), ("allgather", "auto")):
            for seed, case in enumerate(CASES + WINDOW_CASES):
                if case[1] % (2 * ranks) == 0:
                    _check_case(*case, seed=seed, method=method, transport=transport)
            for seed, (heads, kv_heads, causal, softcap) in enumerate(
                    ((4, 2, True, 0.0), (2, 2, False, 5.0))):
                _check_packed(ranks, heads, kv_heads, causal, softcap, seed, method, transport)
        with pytest.raises(ValueError, match="method must be one of ring, allgather"):
            x = torch.zeros(1, 4, 2, 8)
            ring_attention(x, x, x, method="tree")
        with pytest.raises(ValueError, match="transport must be one of auto, push, pull"):
            x = torch.zeros(1, 4, 2, 8)
            ring_attention(x, x, x, transport="nccl")
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
        with pytest.raises(ValueError, match="window_size left must be -1"):
            x = torch.zeros(1, 2 * ranks, 2, 8)
            ring_attention(x, x, x, window_size=(-2, 0))
        with pytest.raises(ValueError, match="window_size right must be -1"):
            x = torch.zeros(1, 2 * ranks, 2, 8)
            ring_attention(x, x, x, causal=True, window_size=(4, -3))
        with pytest.raises(ValueError, match="a varlen pack takes no sliding window"):
            x = torch.zeros(8, 2, 8)  # the local pack of two sequences of 4 x ranks tokens
            ring_attention(x, x, x, causal=True, window_size=(1, 0),
                           cu_seqlens=torch.tensor([0, 4 * ranks, 8 * ranks]))
        with pytest.raises(ValueError, match="3-D tensor"):
            x = torch.zeros(1, 2 * ranks, 2, 8)
            ring_attention(x, x, x, cu_seqlens=torch.tensor([0, 2 * ranks]))
        # a deterministic backward gives the same gradients twice
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, 4 * ranks, 2, 8, generator=g).requires_grad_()
                   for _ in range(3))
        for method, window in itertools.product(("ring", "allgather"), ((-1, -1), (3, 1))):
            grads = []
            for transport in ("push", "pull"):  # the same sums in the same order either way
                out = ring_attention(q, k, v, causal=True, deterministic=True, method=method,
                                     window_size=window, transport=transport)
                grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
            assert all(torch.equal(a, b) for a, b in zip(*grads)), (method, window)
        dist.barrier()  # no rank tears gloo down while a peer's last transfer is in flight
    finally:
        dist.destroy_process_group()


def _steps_worker(rank: int, ranks: int, port: int, transport: str) -> None:
    """Counts what the ring moves (every tensor links._exchange sends, by the offset of the rank
    it goes to) and whose keys it offers the calls, for causal windows under and over a chunk,
    none, and one's own key. A push sends K/V one rank on per step; a pull of step s's K/V comes
    from s ranks away."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    sent: list[int] = []
    sources: set[int] = set()  # whose keys the calls were offered
    plans: list[Plan] = []
    real_shift, real_add = links_module._exchange, ring_module._Forward.add

    def counted_shift(moves, *args):
        sent.extend(d for _, d in moves)
        return real_shift(moves, *args)

    def counted_add(self, src, kv):
        sources.add(src)
        plans.append(self.plan)
        return real_add(self, src, kv)

    links_module._exchange, ring_module._Forward.add = counted_shift, counted_add
    try:
        seqlen = 48  # chunks of 48 / 2 ranks tokens: 6 at 4 ranks, 4 at 6
        g = torch.Generator().manual_seed(11)
        q, k, v = (torch.randn(1, seqlen, 2, 8, generator=g) for _ in range(3))
        for window, (forward, backward) in (
                ((3, 0), (1, 1)),                      # under a chunk: one step each way
                ((5, 0), (1, 1) if ranks == 4 else (2, 2)),  # over a chunk at 6 ranks
                ((-1, -1), (ranks - 1, 0)),            # the whole ring
                ((0, 0), (0, 0))):                     # own keys only
            sent.clear()
            sources.clear()
            with torch.no_grad():
                ring_attention(shard_sequence(q), shard_sequence(k), shard_sequence(v),
                               causal=True, window_size=window, transport=transport)
            # K/V: each step's transfers, each way
            hops = [-1] * backward + [1] * forward if transport == "push" else \
                list(range(-backward, 0)) + list(range(1, forward + 1))
            assert sorted(sent) == hops, (window, sent)
            reach = {(rank - d) % ranks for d in range(forward + 1)} | {
                (rank + d) % ranks for d in range(backward + 1)}
            seen = {src for src in range(ranks) if plans[-1].spans(rank, src)}
            assert seen <= sources == reach, (window, seen, sources, reach)
            sent.clear()
            _check_case(1, seqlen, 2, 2, 8, True, 0.0, window, seed=5, transport=transport)
            if window == (-1, -1):
                # the whole ring's backward runs own keys last: its first K/V (the next rank's)
                # kept from the forward, P - 2 fetched; the sums passed on P - 1 times, none home
                assert len(sent) == (ranks - 1) + (ranks - 2) + (ranks - 1), (window, sent)
                continue
            # the backward's K/V as the forward's; dK/dV accumulators: one a step each way
            # (from step 0 forward, from step 1 backward) and, after a way's last, one home
            dkv = forward + (forward > 0) + backward
            assert len(sent) == 2 * (forward + backward) + dkv, (window, sent)
        dist.barrier()  # no rank tears gloo down while a peer's last transfer is in flight
    finally:
        links_module._exchange, ring_module._Forward.add = real_shift, real_add
        dist.destroy_process_group()


@pytest.mark.parametrize("transport", ["push", "pull"])
@pytest.mark.parametrize("ranks", [4, 6])
def test_ring_runs_only_the_steps_a_window_needs(ranks, transport):
    """A causal window under a chunk: each rank sends K/V one step each way (2 transfers, not
    ranks - 1) and reads only its neighbours' keys; one over a chunk at 6 ranks: two steps each
    way (4, not 5); the backward moves K/V the same and its dK/dV accumulators go on one step
    less and then home; outputs and gradients still match the reference. A window of one key
    moves nothing, no window the whole ring (its backward one K/V transfer less and no sum
    home: own keys last). (Counted through links._exchange.)"""
    mp.spawn(_steps_worker, args=(ranks, _free_port(), transport), nprocs=ranks, join=True)


def _compile_worker(rank: int, ranks: int, port: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    try:
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, 8 * ranks, 4, 8, generator=g)
        k, v = (torch.randn(1, 8 * ranks, 2, 8, generator=g) for _ in range(2))  # GQA 4/2

        def step(q, k, v):
            out = ring_attention(q * 0.5, k, v, causal=True, window_size=(12, 0))
            return (out.float() ** 2).sum()

        results = []
        for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True),
                   torch.compile(step, fullgraph=True)):  # inductor
            ql, kl, vl = (shard_sequence(t).requires_grad_() for t in (q, k, v))
            loss = fn(ql, kl, vl)
            results.append((loss.detach(), *torch.autograd.grad(loss, (ql, kl, vl))))
        for eager, *compiled in zip(*results):
            for c in compiled:
                torch.testing.assert_close(c, eager, atol=1e-6, rtol=1e-5)
        # a varlen pack, the group passed by name: compiled (aot_eager) as eager, bit for bit
        cu = torch.tensor([0, 4 * ranks, 12 * ranks, 18 * ranks], dtype=torch.int32)
        packed = [shard_packed(torch.randn(18 * ranks, h, 8, generator=g), cu).requires_grad_()
                  for h in (4, 2, 2)]

        def packed_step(q, k, v):
            out, lse = ring_attention(q, k, v, causal=True, cu_seqlens=cu, return_lse=True,
                                      group=_world_name())
            return (out ** 2).sum() + lse.sum()

        runs = []
        for fn in (packed_step, torch.compile(packed_step, backend="aot_eager", fullgraph=True)):
            loss = fn(*packed)
            runs.append((loss.detach(), *torch.autograd.grad(loss, packed)))
        for eager, compiled in zip(*runs):
            torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
        # the operators' registrations (schema, fake tensors, autograd, AOT dispatch)
        ql, kl, vl = (shard_sequence(t).requires_grad_() for t in (q, k, v))
        torch.library.opcheck(ring_module._ring_op, (ql, kl, vl, None, _world_name(), 0.3,
                                                     True, -1, 0, 0.0, False, "ring", "push"))
        dist.barrier()  # no rank tears gloo down while a peer's last transfer is in flight
    finally:
        dist.destroy_process_group()


def _world_name() -> str:
    return dist.group.WORLD.group_name


def test_ring_attention_under_torch_compile():
    """torch.compile(fullgraph=True) of a training step calling ring_attention (aot_eager and
    inductor) gives the eager step's loss and gradients: the ring is two operators
    (torch.library.custom_op, forward and backward) with fake implementations, so dynamo and
    AOTAutograd see one opaque call each way; torch.library.opcheck passes. CPU, gloo."""
    mp.spawn(_compile_worker, args=(2, _free_port()), nprocs=2, join=True)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_ring_attention_over_gloo_matches_the_whole_sequence(ranks):
    mp.spawn(_worker, args=(ranks, _free_port()), nprocs=ranks, join=True)


def test_cases_split_for_every_group_size_tested():
    for ranks, case in itertools.product([1, 2, 3, 4], CASES):
        if ranks in (1, 2):
            assert case[1] % (2 * ranks) == 0, (ranks, case)
    assert sum(case[1] % 24 == 0 for case in CASES) == len(CASES)  # 3 and 4 ranks: all split
