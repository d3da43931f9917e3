"""Attention over a sequence sharded across a process group (the layout of layout.py), forward
and backward through autograd, by a ring (below) or by all-gather (every rank's K and V gathered
at once; dK and dV reduced onto their owners).

Forward, on rank r of P: K and V (stacked, the KV heads only) go around the ring, one step per
rank; at step s the rank holds those of rank r - s, sends them on to r + 1 while it computes the
blocks its query chunks see of them (layout.blocks), and merges each block's (out, LSE) into its
running result in fp32 (merge.py). Backward: K and V go around again, each step's transfer
started before its blocks are computed; the blocks' dQ add into the rank's own, their dK and dV
into fp32 accumulators that travel with K and V and come home after P steps. Each block's
backward uses the merged output and LSE, so its P is its slice of the whole softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .blocks import block_backward, block_forward
from .layout import DIAGONAL, FULL, Layout
from .merge import merge_partials
from .parts import Fixed, Packed


def _peers(group, rank: int, ranks: int) -> tuple[int, int]:
    """The global ranks of the next and the previous rank of the ring."""
    nxt, prev = (rank + 1) % ranks, (rank - 1) % ranks
    if group is None or group is dist.group.WORLD:
        return nxt, prev
    return dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)


def _exchange(t: torch.Tensor, group, peers: tuple[int, int]) -> tuple[torch.Tensor, list]:
    """Start sending t to the next rank and receiving the previous rank's t into a new buffer."""
    buf = torch.empty_like(t)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peers[0], group),
                                   dist.P2POp(dist.irecv, buf, peers[1], group)])
    return buf, reqs


def _wait(reqs: list) -> None:
    for req in reqs:
        req.wait()


def _spans(blocks: list[tuple[int, int, str]]) -> dict[int, tuple[int, bool]]:
    """The blocks one rank's query chunks see of another rank's two key chunks, as one call per
    query chunk: {i: (n, causal)}, query chunk i over the first n key chunks (1 or 2) whose
    last is diagonal when causal. Zigzag makes this always possible: a query chunk that sees the
    later key chunk sees the earlier one whole, and the diagonal is only ever the last one seen
    (causal aligned bottom-right over the two chunks is then exactly the two blocks' masks)."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for i, j, vis in blocks:
        seen.setdefault(i, []).append((j, vis))
    out = {}
    for i, parts in seen.items():
        parts.sort()
        if [j for j, _ in parts] != list(range(len(parts))) or any(
                vis != FULL for _, vis in parts[:-1]):
            raise AssertionError(f"blocks {parts} of query chunk {i} are not one key prefix")
        out[i] = (len(parts), parts[-1][1] == DIAGONAL)
    return out


class _Forward:
    """One rank's forward: its two query chunks' (out, LSE), merged over the key chunks of every
    rank as they arrive (add), by either method. parts: how the local tensors split into the
    chunks (parts.Fixed, parts.Packed)."""

    def __init__(self, q, scale, causal, softcap, rank: int, ranks: int, parts) -> None:
        self.q, self.args, self.rank, self.layout = q, (scale, softcap), rank, Layout(ranks)
        self.causal, self.parts = causal, parts
        self.q_parts = [parts.part(q, i) for i in (0, 1)]
        self.outs: list[torch.Tensor | None] = [None, None]
        self.lses: list[torch.Tensor | None] = [None, None]

    def add(self, src: int, kv: torch.Tensor) -> None:
        """The blocks the rank's queries see of rank src's keys (kv: K and V stacked), one call
        per query chunk (_spans)."""
        scale, softcap = self.args
        for i, (n, causal) in _spans(self.layout.blocks(self.rank, src, self.causal)).items():
            k, v = self.parts.keys(kv, n)
            o, lse = block_forward(self.q_parts[i], k, v, scale, causal, softcap,
                                   self.parts.args(n))
            self.outs[i], self.lses[i] = merge_partials(self.outs[i], self.lses[i], o, lse)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.parts.join([o.to(self.q.dtype) for o in self.outs])
        return out, self.parts.join_lse(self.lses)


class _Backward:
    """One rank's backward: dQ of its query chunks, summed over the key chunks of every rank,
    and each block's dK, dV added into that rank's (fp32) accumulator (add)."""

    def __init__(self, dout, q, out, lse, scale, causal, softcap, deterministic, rank: int,
                 ranks: int, parts) -> None:
        self.chunks = [(parts.part(q, i), parts.part(dout, i), parts.part(out, i),
                        parts.lse_part(lse, i)) for i in (0, 1)]
        self.args = (scale, causal, softcap, deterministic)
        self.rank, self.layout, self.q, self.parts = rank, Layout(ranks), q, parts
        self.dq_parts = [torch.zeros(c[0].shape, dtype=torch.float32, device=q.device)
                         for c in self.chunks]

    def add(self, src: int, kv: torch.Tensor, dkv: torch.Tensor) -> None:
        scale, causal, softcap, deterministic = self.args
        for i, (n, diag) in _spans(self.layout.blocks(self.rank, src, causal)).items():
            q_i, do_i, o_i, lse_i = self.chunks[i]
            k, v = self.parts.keys(kv, n)
            dq_b, dk_b, dv_b = block_backward(do_i, q_i, k, v, o_i, lse_i, scale, diag, softcap,
                                              deterministic, self.parts.args(n))
            self.dq_parts[i].add_(dq_b)
            self.parts.add_keys(dkv, n, dk_b, dv_b)

    def dq(self) -> torch.Tensor:
        return self.parts.join(self.dq_parts)


def _ring_forward(q, k, v, group, scale, causal, softcap, parts):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    peers = _peers(group, rank, ranks)
    acc = _Forward(q, scale, causal, softcap, rank, ranks, parts)
    kv = torch.stack((k, v)).contiguous()
    for step in range(ranks):
        if step + 1 < ranks:
            kv_next, reqs = _exchange(kv, group, peers)  # in flight under this step's blocks
        acc.add((rank - step) % ranks, kv)
        if step + 1 < ranks:
            _wait(reqs)
            kv = kv_next
    return acc.result()


def _ring_backward(dout, q, k, v, out, lse, group, scale, causal, softcap, deterministic,
                   parts):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    peers = _peers(group, rank, ranks)
    acc = _Backward(dout, q, out, lse, scale, causal, softcap, deterministic, rank, ranks,
                    parts)
    kv = torch.stack((k, v)).contiguous()
    dkv_reqs: list = []
    dkv_next = kv  # replaced by the first incoming accumulator before it is read
    for step in range(ranks):
        if step + 1 < ranks:
            kv_next, kv_reqs = _exchange(kv, group, peers)
        # This step's blocks add into a fresh accumulator while the one of these keys (the
        # previous ranks' sums) is still on its way here; the two are summed when it lands.
        local = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        acc.add((rank - step) % ranks, kv, local)
        if step == 0:
            dkv = local
        else:
            _wait(dkv_reqs)
            dkv = dkv_next.add_(local)
        if ranks > 1:  # dK, dV of these keys go on with them; the last step sends them home
            dkv_next, dkv_reqs = _exchange(dkv, group, peers)
        if step + 1 < ranks:
            _wait(kv_reqs)
            kv = kv_next
    if ranks > 1:
        _wait(dkv_reqs)
        dkv = dkv_next
    return acc.dq().to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _gather_kv(k, v, group, ranks: int) -> list[torch.Tensor]:
    """Every rank's K and V (stacked), by rank."""
    kv = torch.stack((k, v)).contiguous()
    gathered = [torch.empty_like(kv) for _ in range(ranks)]
    dist.all_gather(gathered, kv, group=group)
    return gathered


def _allgather_forward(q, k, v, group, scale, causal, softcap, parts):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = _Forward(q, scale, causal, softcap, rank, ranks, parts)
    for src, kv in enumerate(_gather_kv(k, v, group, ranks)):
        acc.add(src, kv)
    return acc.result()


def _allgather_backward(dout, q, k, v, out, lse, group, scale, causal, softcap, deterministic,
                        parts):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = _Backward(dout, q, out, lse, scale, causal, softcap, deterministic, rank, ranks,
                    parts)
    mine = None
    for src, kv in enumerate(_gather_kv(k, v, group, ranks)):  # gathered again: not kept
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        acc.add(src, kv, dkv)
        # src's keys' gradients from every rank, summed on src (in rank order: deterministic)
        dst = src if group is None or group is dist.group.WORLD else dist.get_global_rank(group,
                                                                                          src)
        dist.reduce(dkv, dst=dst, op=dist.ReduceOp.SUM, group=group)
        if src == rank:
            mine = dkv
    return acc.dq().to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)  # type: ignore[index]


METHODS = {"ring": (_ring_forward, _ring_backward),
           "allgather": (_allgather_forward, _allgather_backward)}


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, causal, softcap, deterministic, method, parts):
        forward, _ = METHODS[method]
        out, lse = forward(q, k, v, group, scale, causal, softcap, parts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, scale, causal, softcap, deterministic, parts)
        ctx.method = method
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        _, backward = METHODS[ctx.method]
        dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None


def _check(q, k, v, group, cu_seqlens) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed initialised "
                           "(dist.init_process_group)")
    ranks = dist.get_world_size(group)
    rank_dims = 3 if cu_seqlens is not None else 4
    form = "(local_total, heads, d_head) of a pack" if rank_dims == 3 else \
        "(batch, local_seq, heads, d_head)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank_dims:
            raise ValueError(f"{name} must be this rank's shard, a {rank_dims}-D tensor {form}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    rows = 1 if rank_dims == 4 else 0
    if q.shape[:rows + 1] != k.shape[:rows + 1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, local "
                         f"sequence and d_head (self-attention over one sharded sequence)")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"heads of q ({q.shape[-2]}) must be a multiple of heads of k/v "
                         f"({k.shape[-2]})")
    if cu_seqlens is None:
        if q.shape[1] % 2:
            raise ValueError(f"this rank's shard has {q.shape[1]} tokens; a zigzag shard is two "
                             f"equal chunks (shard_sequence makes one from a sequence of a "
                             f"multiple of 2 x ranks tokens)")
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
                or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
            raise ValueError("cu_seqlens must be the whole pack's (batch + 1,) integer offsets")
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        odd = [n for n in lengths if n < 0 or n % (2 * ranks)]
        if odd or int(cu_seqlens[0]) != 0:
            raise ValueError(f"every sequence of the pack must have a length that is a "
                             f"multiple of 2 x ranks = {2 * ranks} (offsets from 0), got "
                             f"{odd[:4] or [int(cu_seqlens[0])]}")
        if q.shape[0] * ranks != int(cu_seqlens[-1]):
            raise ValueError(f"this rank's pack has {q.shape[0]} rows; the pack's "
                             f"{int(cu_seqlens[-1])} tokens over {ranks} ranks make "
                             f"{int(cu_seqlens[-1]) // ranks} (shard_packed makes them)")
    backend = dist.get_backend(group)
    want = "nccl" if q.is_cuda else "gloo"
    if backend != want:
        raise ValueError(f"ring_attention on {'CUDA' if q.is_cuda else 'CPU'} tensors needs a "
                         f"{want} process group, got {backend}")
    _check_same_shards(q, k, group, ranks)


def _check_same_shards(q, k, group, ranks: int) -> None:
    """Every rank's shards must have the same shapes and dtype (the ring exchanges buffers of
    this rank's size): one small all_gather, read on the host, so that a mismatch is a
    ValueError on every rank rather than a hang or an NCCL error mid-ring."""
    if ranks == 1:
        return
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    mine = torch.tensor([*q.shape, *k.shape, dtypes.index(q.dtype) if q.dtype in dtypes else -1],
                        dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(every, mine, group=group)
    shapes = [tuple(t.tolist()) for t in every]
    if len(set(shapes)) > 1:
        raise ValueError("the ranks' shards differ (q shape, k shape, dtype per rank): "
                         + "; ".join(f"rank {r}: {s[:q.dim()]}, {s[q.dim():-1]}, "
                                     f"{dtypes[s[-1]] if s[-1] >= 0 else 'other'}"
                                     for r, s in enumerate(shapes))
                         + "; every rank passes its shard of the same sequence (shard_sequence)")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   causal: bool = False, softmax_scale: float | None = None,
                   softcap: float = 0.0, deterministic: bool = False,
                   return_lse: bool = False, method: str = "ring",
                   cu_seqlens: torch.Tensor | None = None):
    """Attention of a sequence sharded over `group` (zigzag: shard_sequence), each rank passing
    its shards q (batch, local_seq, heads, d_head), k, v (batch, local_seq, kv_heads, d_head).
    Returns this rank's shard of the output (and of the LSE, (batch, heads, local_seq) fp32,
    with return_lse); gradients flow back to q, k, v through autograd. causal: the whole
    sequence's causal mask; softcap as in attention(); deterministic: the backward's sums in a
    fixed order. method: "ring" (K/V passed rank to rank under the blocks: memory of one
    rank's K/V in flight; the default, measured as fast as the other on 2 GPUs) or
    "allgather" (every rank's K/V gathered at once, dK/dV reduced to their owners: fewer,
    larger collectives, P times the K/V memory).

    Varlen packs: with cu_seqlens (the whole pack's (batch + 1,) offsets, the same on every
    rank, each sequence's length a multiple of 2 x ranks), q, k, v are this rank's local pack
    (local_total, heads, d_head) as shard_packed makes it (every sequence zigzag-sharded on its
    own), causal applies per sequence, and the LSE is (heads, local_total)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    _check(q, k, v, group, cu_seqlens)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if cu_seqlens is None:
        parts = Fixed(q.shape[1])
        args = (q, k, v)
    else:
        parts = Packed(cu_seqlens.cpu(), dist.get_world_size(group), q.device)
        args = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))  # batch 1: one pack
    out, lse = _RingAttention.apply(*args, group, float(scale), bool(causal), float(softcap),
                                    bool(deterministic), method, parts)
    if cu_seqlens is not None:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out
