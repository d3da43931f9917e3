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
    rank as they arrive (add), by either method."""

    def __init__(self, q, scale, causal, softcap, rank: int, ranks: int) -> None:
        self.q, self.args, self.rank, self.layout = q, (scale, softcap), rank, Layout(ranks)
        self.causal = causal
        self.q_parts = q.chunk(2, dim=1)
        self.outs: list[torch.Tensor | None] = [None, None]
        self.lses: list[torch.Tensor | None] = [None, None]

    def add(self, src: int, kv: torch.Tensor) -> None:
        """The blocks the rank's queries see of rank src's keys (kv: K and V stacked), one call
        per query chunk (_spans)."""
        scale, softcap = self.args
        chunk = kv.shape[2] // 2
        for i, (n, causal) in _spans(self.layout.blocks(self.rank, src, self.causal)).items():
            o, lse = block_forward(self.q_parts[i], kv[0][:, :n * chunk], kv[1][:, :n * chunk],
                                   scale, causal, softcap)
            self.outs[i], self.lses[i] = merge_partials(self.outs[i], self.lses[i], o, lse)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.cat([o.to(self.q.dtype) for o in self.outs], dim=1)  # type: ignore[union-attr]
        return out, torch.cat(self.lses, dim=2)  # type: ignore[arg-type]


class _Backward:
    """One rank's backward: dQ of its query chunks, summed over the key chunks of every rank,
    and each block's dK, dV added into that rank's (fp32) accumulator (add)."""

    def __init__(self, dout, q, out, lse, scale, causal, softcap, deterministic, rank: int,
                 ranks: int) -> None:
        self.parts = (q.chunk(2, 1), dout.chunk(2, 1), out.chunk(2, 1),
                      [part.contiguous() for part in lse.chunk(2, dim=2)])  # rows, as read
        self.args = (scale, causal, softcap, deterministic)
        self.rank, self.layout, self.q = rank, Layout(ranks), q
        self.dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

    def add(self, src: int, kv: torch.Tensor, dkv: torch.Tensor) -> None:
        scale, causal, softcap, deterministic = self.args
        q_parts, do_parts, o_parts, lse_parts = self.parts
        dq_parts = self.dq.chunk(2, dim=1)
        chunk = kv.shape[2] // 2
        for i, (n, diag) in _spans(self.layout.blocks(self.rank, src, causal)).items():
            keys = slice(0, n * chunk)
            dq_b, dk_b, dv_b = block_backward(do_parts[i], q_parts[i], kv[0][:, keys],
                                              kv[1][:, keys], o_parts[i], lse_parts[i], scale,
                                              diag, softcap, deterministic)
            dq_parts[i].add_(dq_b)
            dkv[0][:, keys].add_(dk_b)
            dkv[1][:, keys].add_(dv_b)


def _ring_forward(q, k, v, group, scale, causal, softcap):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    peers = _peers(group, rank, ranks)
    acc = _Forward(q, scale, causal, softcap, rank, ranks)
    kv = torch.stack((k, v)).contiguous()
    for step in range(ranks):
        if step + 1 < ranks:
            kv_next, reqs = _exchange(kv, group, peers)  # in flight under this step's blocks
        acc.add((rank - step) % ranks, kv)
        if step + 1 < ranks:
            _wait(reqs)
            kv = kv_next
    return acc.result()


def _ring_backward(dout, q, k, v, out, lse, group, scale, causal, softcap, deterministic):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    peers = _peers(group, rank, ranks)
    acc = _Backward(dout, q, out, lse, scale, causal, softcap, deterministic, rank, ranks)
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
    return acc.dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _gather_kv(k, v, group, ranks: int) -> list[torch.Tensor]:
    """Every rank's K and V (stacked), by rank."""
    kv = torch.stack((k, v)).contiguous()
    gathered = [torch.empty_like(kv) for _ in range(ranks)]
    dist.all_gather(gathered, kv, group=group)
    return gathered


def _allgather_forward(q, k, v, group, scale, causal, softcap):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = _Forward(q, scale, causal, softcap, rank, ranks)
    for src, kv in enumerate(_gather_kv(k, v, group, ranks)):
        acc.add(src, kv)
    return acc.result()


def _allgather_backward(dout, q, k, v, out, lse, group, scale, causal, softcap, deterministic):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = _Backward(dout, q, out, lse, scale, causal, softcap, deterministic, rank, ranks)
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
    return acc.dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)  # type: ignore[index]


METHODS = {"ring": (_ring_forward, _ring_backward),
           "allgather": (_allgather_forward, _allgather_backward)}


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, causal, softcap, deterministic, method):
        forward, _ = METHODS[method]
        out, lse = forward(q, k, v, group, scale, causal, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, scale, causal, softcap, deterministic)
        ctx.method = method
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        _, backward = METHODS[ctx.method]
        dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def _check(q, k, v, group) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed initialised "
                           "(dist.init_process_group)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be this rank's shard, a 4-D tensor (batch, "
                             f"local_seq, heads, d_head)")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, local "
                         f"sequence and d_head (self-attention over one sharded sequence)")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"heads of q ({q.shape[2]}) must be a multiple of heads of k/v "
                         f"({k.shape[2]})")
    if q.shape[1] % 2:
        raise ValueError(f"this rank's shard has {q.shape[1]} tokens; a zigzag shard is two "
                         f"equal chunks (shard_sequence makes one from a sequence of a multiple "
                         f"of 2 x ranks tokens)")
    backend = dist.get_backend(group)
    want = "nccl" if q.is_cuda else "gloo"
    if backend != want:
        raise ValueError(f"ring_attention on {'CUDA' if q.is_cuda else 'CPU'} tensors needs a "
                         f"{want} process group, got {backend}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                   causal: bool = False, softmax_scale: float | None = None,
                   softcap: float = 0.0, deterministic: bool = False,
                   return_lse: bool = False, method: str = "ring"):
    """Attention of a sequence sharded over `group` (zigzag: shard_sequence), each rank passing
    its shards q (batch, local_seq, heads, d_head), k, v (batch, local_seq, kv_heads, d_head).
    Returns this rank's shard of the output (and of the LSE, (batch, heads, local_seq) fp32,
    with return_lse); gradients flow back to q, k, v through autograd. causal: the whole
    sequence's causal mask; softcap as in attention(); deterministic: the backward's sums in a
    fixed order. method: "ring" (K/V passed rank to rank under the blocks: memory of one
    rank's K/V in flight) or "allgather" (every rank's K/V gathered at once, dK/dV reduced to
    their owners: fewer, larger collectives, P times the K/V memory); no rule chooses between
    them yet (none measured on GPUs)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    _check(q, k, v, group)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = _RingAttention.apply(q, k, v, group, float(scale), bool(causal), float(softcap),
                                    bool(deterministic), method)
    return (out, lse) if return_lse else out
