"""Attention over a sequence sharded across a process group (the layout of layout.py), forward
and backward through autograd, by a ring (below) or by all-gather (every rank's K and V gathered
at once; dK and dV reduced onto their owners).

Forward, on rank r of P: K and V (the KV heads only) go around the ring, one step per
rank; at step s the rank holds those of rank r - s, and the next step's arrive (links.py: pulled
by the copy engines, or pushed on by NCCL) while it computes the calls its query chunks make on
them (layout.Plan.spans), and merges each call's (out, LSE) into
the rows of its running result that the call covers, in fp32 (merge.py). Backward, the whole
ring: the other way round, own keys last (_ring_backward_own_last), starting from the K/V the
forward held last; each step's transfer started before its calls are computed; the calls' dQ
add into the rank's own, their dK and dV into fp32 accumulators that travel with K and V and
are whole when they reach their owner, at its last step. Each call's backward uses the merged
output and LSE, so its P is its slice of the whole softmax.

A sliding window shortens the ring (layout.Plan.steps): K/V go only as many steps as some rank
needs, to the next ranks (r holds r - s) and, when that is shorter, also to the previous ones
(r holds r + s) at the same time; the zigzag puts a chunk's neighbours on the ranks either side,
so a small window takes one step each way. Its backward goes round as its forward did, each
way's accumulators travelling with its K/V and after its last step going straight to their
owner (one transfer, n ranks back), where the ways' sums are added in a fixed order.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..masks import canonical_window
from ..validation import check_window
from .blocks import block_backward, block_forward
from .layout import Plan, plan_for
from .links import TRANSPORTS, _global, link
from .merge import merge_into
from .parts import Fixed, Packed, put, take

# The ring's two directions: K/V sent to the next rank (rank r holds r - s at step s) and to
# the previous one (r + s), with how many steps each runs (Plan.steps).
_FORWARD, _BACKWARD = 1, -1


def _directions(plan: Plan) -> tuple[tuple[int, int], ...]:
    forward, backward = plan.steps
    return (_FORWARD, forward), (_BACKWARD, backward)


def _held(step: int, direction: int, n: int) -> bool:
    """Whether a direction of n steps holds K/V of another rank's at this step (step 0, the
    rank's own, is the forward direction's)."""
    return step <= n and (step > 0 or direction == _FORWARD)


class _Forward:
    """One rank's forward: its local shard's (out, LSE) in fp32, merged over the key chunks of
    every rank as they arrive (add), by either method. parts: how spans index the local tensors
    (parts.Fixed, parts.Packed); plan: the calls (layout.Plan)."""

    def __init__(self, q, scale, plan: Plan, softcap, rank: int, parts) -> None:
        self.q, self.args, self.rank, self.plan, self.parts = q, (scale, softcap), rank, plan, parts
        self.out: torch.Tensor | None = None  # (B, rows, H, D) fp32 and (B, H, rows) fp32
        self.lse: torch.Tensor | None = None
        self._q: dict = {}  # a pack's query chunk (Span.chunk) -> its rows of q (a copy)

    def add(self, src: int, kv) -> None:
        """The calls the rank's queries make on rank src's keys (kv: K and V, stacked or a
        pair), each merged into the rows it covers (a row no call reaches keeps out 0, LSE
        -inf)."""
        scale, softcap = self.args
        for span in self.plan.spans(self.rank, src):
            rows, keys = self.parts.queries(span), self.parts.keys(span)
            if isinstance(rows, slice):
                q = take(self.q, 1, rows)
            elif span.chunk not in self._q:  # copied once, used at every step
                q = self._q[span.chunk] = self.q.index_select(1, rows)
            else:
                q = self._q[span.chunk]
            o, lse = block_forward(q, take(kv[0], 1, keys), take(kv[1], 1, keys), scale,
                                   span.window, softcap, self.parts.args(span))
            first = self.out is None
            if first:
                b, n, h, d = self.q.shape
                self.out = self.q.new_empty((b, n, h, d), dtype=torch.float32)
                self.lse = self.q.new_empty((b, h, n), dtype=torch.float32)
                if not (isinstance(rows, slice) and rows.indices(n) == (0, n, 1)):
                    self.out.zero_()  # rows this call leaves out: none of their keys seen yet
                    self.lse.fill_(-math.inf)
                    first = False
            out_rows, lse_rows = take(self.out, 1, rows), take(self.lse, 2, rows)
            merge_into(out_rows, lse_rows, o, lse, assign=first)
            put(self.out, 1, rows, out_rows)
            put(self.lse, 2, rows, lse_rows)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out is None:  # no call at all (a window that sees nothing)
            b, n, h, _ = self.q.shape
            return torch.zeros_like(self.q), self.q.new_full((b, h, n), -math.inf,
                                                              dtype=torch.float32)
        return self.out.to(self.q.dtype), self.lse


class _Backward:
    """One rank's backward: dQ of its local shard, summed (fp32) over the key chunks of every
    rank, and each call's dK, dV added into that rank's (fp32) accumulator (add)."""

    def __init__(self, dout, q, out, lse, scale, plan: Plan, softcap, deterministic, rank: int,
                 parts) -> None:
        self.inputs = (q, dout, out, lse)
        self.args = (scale, softcap, deterministic)
        self.rank, self.plan, self.q, self.parts = rank, plan, q, parts
        self.dq_sum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        self._rows: dict = {}  # a pack's query chunk (Span.chunk) -> q, dout, out, lse rows

    def _queries(self, chunk: int, rows) -> tuple[torch.Tensor, ...]:
        """q, dout, out, lse of a span's query rows: views, or a pack's chunk copied once."""
        q, dout, out, lse = self.inputs
        if isinstance(rows, slice):
            return take(q, 1, rows), take(dout, 1, rows), take(out, 1, rows), take(lse, 2, rows)
        if chunk not in self._rows:
            self._rows[chunk] = (q.index_select(1, rows), dout.index_select(1, rows),
                                 out.index_select(1, rows), lse.index_select(2, rows))
        return self._rows[chunk]

    def add(self, src: int, kv, dkv: torch.Tensor) -> None:
        scale, softcap, deterministic = self.args
        for span in self.plan.spans(self.rank, src):
            rows, keys = self.parts.queries(span), self.parts.keys(span)
            q_i, do_i, o_i, lse_i = self._queries(span.chunk, rows)
            sums = (take(self.dq_sum, 1, rows), take(dkv[0], 1, keys), take(dkv[1], 1, keys))
            block_backward(do_i, q_i, take(kv[0], 1, keys), take(kv[1], 1, keys), o_i, lse_i,
                           scale, span.window, softcap, deterministic, self.parts.args(span),
                           sums)
            put(self.dq_sum, 1, rows, sums[0])
            put(dkv[0], 1, keys, sums[1])
            put(dkv[1], 1, keys, sums[2])

    def dq(self) -> torch.Tensor:
        return self.dq_sum


def _ring_forward(q, k, v, group, scale, plan, softcap, parts, transport):
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = _Forward(q, scale, plan, softcap, rank, parts)
    kv = (k, v)
    wire = link(transport, group, kv)
    held = {_FORWARD: kv, _BACKWARD: kv}  # the K/V each direction holds at this step
    directions = _directions(plan)
    for step in range(max(plan.steps) + 1):
        moving = [d for d, n in directions if step < n]  # in flight under this step's calls
        arriving = wire.fetch_kv([(d, step + 1) for d in moving])
        for d, n in directions:
            if _held(step, d, n):
                acc.add((rank - d * step) % ranks, held[d])
        held.update((d, wire.arrived(h)) for d, h in zip(moving, arriving))
    wire.close()
    return (*acc.result(), held[_FORWARD])  # the K/V held last: the next rank's (no window)


def _ring_backward(dout, q, k, v, out, lse, group, scale, plan, softcap, deterministic,
                   parts, transport, kv_next=None):
    """K/V go around as in the forward; the dK/dV of the keys a direction holds travel with
    them in an fp32 accumulator (each rank adds its calls' share), and after the direction's
    last step go straight to their owner, n ranks back the way they came (the schedule of a
    window's ring). With kv_next (the whole ring: the K/V the forward held last) the ring runs
    the other way round, own keys last (_ring_backward_own_last)."""
    if kv_next is not None:
        return _ring_backward_own_last(dout, q, k, v, kv_next, out, lse, group, scale, plan,
                                       softcap, deterministic, parts, transport)
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = _Backward(dout, q, out, lse, scale, plan, softcap, deterministic, rank, parts)
    kv = (k, v)
    directions = _directions(plan)
    # One direction's sum is all a key gets (a window's ring that runs one way): it goes home
    # rounded to K/V's dtype, half the bytes, the same bits as rounding it there.
    rounded = sum(1 for d, n in directions if n > 0 or d == _FORWARD) == 1
    slots = sorted({(d, s % 2) for d, n in directions for s in range(n + 1) if _held(s, d, n)})
    wire = link(transport, group, kv, sums=tuple(slots), home=rounded)
    held = {_FORWARD: kv, _BACKWARD: kv}
    sums: dict[int, object] = {}  # a direction's sum from the previous rank, on its way here
    home: list = []  # this rank's keys' sums, on their way here (or here)
    for step in range(max(plan.steps) + 1):
        moving = [d for d, n in directions if step < n]
        arriving = wire.fetch_kv([(d, step + 1) for d in moving])
        incoming = {d: wire.start(h) for d, h in sums.items()}  # under this step's calls
        sums.clear()
        for d, n in directions:
            if not _held(step, d, n):
                continue
            # This step's calls add into a fresh accumulator while the one of these keys (the
            # previous ranks' sums) is still on its way here; the two are summed when it lands.
            local = wire.accumulator(d, step)
            acc.add((rank - d * step) % ranks, held[d], local)
            if d in incoming:
                local.add_(wire.get(incoming.pop(d)))
            if step < n:  # on with the keys
                sums[d] = wire.pass_on(local, d, step)
            elif n > 0:  # home to the keys' owner, n ranks back
                home.append(wire.send_home(local, d, n, step,
                                           k.dtype if rounded else torch.float32))
            else:  # no step this way: the rank's own keys' sum is home
                home.append(local)
        held.update((d, wire.arrived(h)) for d, h in zip(moving, arriving))
        wire.end_step()
    dkv = None
    for h in home:  # in a fixed order: deterministic
        buf = h if isinstance(h, torch.Tensor) else wire.get(h)
        dkv = buf if dkv is None else dkv.add_(buf)
    wire.close()
    return acc.dq().to(q.dtype), dkv.to(k.dtype)  # type: ignore[union-attr]


def _ring_backward_own_last(dout, q, k, v, kv_next, out, lse, group, scale, plan, softcap,
                            deterministic, parts, transport):
    """The whole ring's backward in the forward's order reversed: at step s = 1 .. P the rank
    holds the K/V of rank r + s, the first (the next rank's) kept from the forward's last step,
    its own last, and the next step's come from rank r + 1 (where they are now). A key's dK/dV
    sum travels with its K/V (fp32, each rank adding its calls' share) and is whole when it
    reaches the owner at step P: no transfer after the last call (the other schedule sends every
    rank's sum home after it), no K/V transfer at all on 2 ranks, and the last addition rounds
    to K/V's dtype in the same pass."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    if plan.steps != (ranks - 1, 0):
        raise AssertionError(f"the own-last backward takes the whole ring, got {plan.steps}")
    acc = _Backward(dout, q, out, lse, scale, plan, softcap, deterministic, rank, parts)
    kv, shape = (k, v), (2, *k.shape)  # own K/V are never sent: no stacked copy
    d = _BACKWARD  # K/V and sums go to the previous rank: r holds r + s at step s
    wire = link(transport, group, kv, sums=tuple(sorted({(d, s % 2) for s in range(1, ranks)})),
                share_kv=ranks > 2, held={d: kv_next})
    held, sums, dkv = kv_next, None, None
    for step in range(1, ranks + 1):
        arriving = wire.fetch_kv([(d, step + 1)]) if step + 1 < ranks else []
        incoming = wire.start(sums) if sums is not None else None  # under this step's calls
        src = (rank + step) % ranks
        if step < ranks:
            local = wire.accumulator(d, step)
            acc.add(src, held, local)
            if incoming is not None:
                local.add_(wire.get(incoming))
            sums = wire.pass_on(local, d, step)
        else:  # the rank's own keys: their sum, rounded once
            local = torch.zeros(shape, dtype=torch.float32, device=k.device)
            acc.add(src, kv, local)
            dkv = local.to(k.dtype) if incoming is None else \
                torch.add(local, wire.get(incoming), out=k.new_empty(shape))
        held = wire.arrived(arriving[0]) if arriving else kv
        wire.end_step()
    wire.close()
    return acc.dq().to(q.dtype), dkv


def _gather_kv(k, v, group, ranks: int) -> list[torch.Tensor]:
    """Every rank's K and V (stacked), by rank."""
    kv = torch.stack((k, v)).contiguous()
    gathered = [torch.empty_like(kv) for _ in range(ranks)]
    dist.all_gather(gathered, kv, group=group)
    return gathered


def _allgather_forward(q, k, v, group, scale, plan, softcap, parts, transport):
    del transport  # NCCL's all-gather moves the K/V
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = _Forward(q, scale, plan, softcap, rank, parts)
    for src, kv in enumerate(_gather_kv(k, v, group, ranks)):
        acc.add(src, kv)
    return (*acc.result(), None)


def _allgather_backward(dout, q, k, v, out, lse, group, scale, plan, softcap, deterministic,
                        parts, transport, kv_next=None):
    del transport, kv_next  # NCCL's all-gather and reduce move the K/V and the sums
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    acc = _Backward(dout, q, out, lse, scale, plan, softcap, deterministic, rank, parts)
    mine = None
    for src, kv in enumerate(_gather_kv(k, v, group, ranks)):  # gathered again: not kept
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        acc.add(src, kv, dkv)
        # src's keys' gradients from every rank, summed on src (in rank order: deterministic)
        dist.reduce(dkv, dst=_global(group, src), op=dist.ReduceOp.SUM, group=group)
        if src == rank:
            mine = dkv
    return acc.dq().to(q.dtype), mine.to(k.dtype)  # type: ignore[union-attr]


METHODS = {"ring": (_ring_forward, _ring_backward),
           "allgather": (_allgather_forward, _allgather_backward)}


# The ring as two operators (torch.library.custom_op): eager autograd and torch.compile see one
# opaque call per direction (dynamo does not trace the ring's point-to-point transfers, host
# reads and link objects), with fake implementations for the shapes. The process group travels
# by name (torch's functional collectives do the same); the layout, plan and checks are made
# inside from the tensors and the ints.


def _setup(q, k, v, cu_seqlens, group, causal: bool, left: int, right: int):
    """(args, parts, plan): the tensors as the ring takes them (a pack gets a batch dimension of
    1), how spans index them, and the calls of this group size and window."""
    ranks = dist.get_world_size(group)
    if cu_seqlens is None:
        parts = Fixed(q.shape[1])
        seqlen = q.shape[1] * ranks
        left, right = canonical_window(causal, (left, right), seqlen, seqlen)
        return (q, k, v), parts, plan_for(ranks, parts.chunk, left, right)
    parts = Packed(cu_seqlens.cpu(), ranks, q.device)
    longest = max(parts.chunks, default=0) * 2 * ranks
    left, right = canonical_window(causal, (left, right), longest, longest)
    if left != -1 or right not in (-1, 0):
        raise ValueError(f"window_size {(left, right)} with cu_seqlens: a varlen pack takes no "
                         f"sliding window in ring_attention (its sequences' chunks differ in "
                         f"length); only (-1, -1) and causal")
    pack = (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))  # batch 1: one pack
    return pack, parts, plan_for(ranks, parts.chunk, left, right)


def _group_named(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _keeps_next_kv(method: str, left: int, right: int, ranks: int) -> bool:
    """Whether the forward hands its backward the K/V it held last, the next rank's (at the
    cost of keeping them from the forward to the backward, one K/V shard): the ring without a
    window on 2 ranks or more, whose backward then starts from them (_ring_backward_own_last).
    Decided from the operator's ints alone, so the fake implementation decides the same."""
    return method == "ring" and ranks > 1 and left == -1 and right in (-1, 0)


@torch.library.custom_op("flash_attention_distributed::ring_attention", mutates_args=())
def _ring_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cu_seqlens: torch.Tensor | None, group_name: str, scale: float, causal: bool,
             left: int, right: int, softcap: float, deterministic: bool, method: str,
             transport: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, LSE, the K/V the backward starts from (_keeps_next_kv; else empty))."""
    del deterministic  # the backward's
    group = _group_named(group_name)
    _check(q, k, v, group, cu_seqlens)
    args, parts, plan = _setup(q, k, v, cu_seqlens, group, causal, left, right)
    forward, _ = METHODS[method]
    out, lse, kv_next = forward(*args, group, scale, plan, softcap, parts, transport)
    if cu_seqlens is not None:
        out, lse = out.squeeze(0), lse.squeeze(0)
    if not _keeps_next_kv(method, left, right, dist.get_world_size(group)):
        return out, lse, k.new_empty(0)
    if cu_seqlens is not None:
        kv_next = kv_next.squeeze(1)
    return out, lse, kv_next


@_ring_op.register_fake
def _(q, k, v, cu_seqlens, group_name, scale, causal, left, right, softcap, deterministic, method,
      transport):
    if q.dim() == 3:  # a pack: (local_total, heads, d) -> LSE (heads, local_total)
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    ranks = dist.get_world_size(_group_named(group_name))
    kv_next = k.new_empty((2, *k.shape)) if _keeps_next_kv(method, left, right, ranks) else \
        k.new_empty(0)
    return torch.empty_like(q), lse, kv_next


@torch.library.custom_op("flash_attention_distributed::ring_attention_backward",
                         mutates_args=())
def _ring_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, kv_next: torch.Tensor,
                      cu_seqlens: torch.Tensor | None, group_name: str, scale: float,
                      causal: bool, left: int, right: int, softcap: float, deterministic: bool,
                      method: str, transport: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dK and dV stacked): one tensor for both, which the autograd formula splits (a custom
    operator's outputs may not share memory, and the finished sums arrive stacked)."""
    group = _group_named(group_name)
    (q_, k_, v_), parts, plan = _setup(q, k, v, cu_seqlens, group, causal, left, right)
    if cu_seqlens is not None:
        dout, out, lse = dout.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0)
        kv_next = kv_next.unsqueeze(1) if kv_next.numel() else kv_next
    _, backward = METHODS[method]
    dq, dkv = backward(dout.contiguous(), q_, k_, v_, out, lse, group, scale, plan, softcap,
                       deterministic, parts, transport, kv_next if kv_next.numel() else None)
    if dkv._base is not None:  # a view of a link's buffer (a workspace slot): copied out
        dkv = dkv.clone()
    if cu_seqlens is not None:
        dq, dkv = dq.squeeze(0), dkv.squeeze(1)
    return dq, dkv


@_ring_backward_op.register_fake
def _(dout, q, k, v, out, lse, kv_next, cu_seqlens, group_name, scale, causal, left, right,
      softcap, deterministic, method, transport):
    return torch.empty_like(q), k.new_empty((2, *k.shape))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens = inputs[:4]
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.args = inputs[4:]
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the LSE and the K/V


def _ring_grad(ctx, dout, _dlse, _dkv_next):
    if dout is None:  # the output reached the loss only through the LSE: nothing flows back
        return (None,) * 13
    q, k, v, out, lse, kv_next, cu_seqlens = ctx.saved_tensors
    dq, dkv = _ring_backward_op(dout, q, k, v, out, lse, kv_next, cu_seqlens, *ctx.args)
    return (dq, dkv[0], dkv[1]) + (None,) * 10


_ring_op.register_autograd(_ring_grad, setup_context=_setup_context)


def _name_of(group) -> str:
    """The name the operators find a process group by (None: the default group)."""
    if isinstance(group, str):
        return group
    return (group if group is not None else dist.group.WORLD).group_name


def _check(q, k, v, group, cu_seqlens) -> None:
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
                   cu_seqlens: torch.Tensor | None = None,
                   window_size: tuple[int, int] = (-1, -1), transport: str = "push"):
    """Attention of a sequence sharded over `group` (zigzag: shard_sequence), each rank passing
    its shards q (batch, local_seq, heads, d_head), k, v (batch, local_seq, kv_heads, d_head).
    Returns this rank's shard of the output (and of the LSE, (batch, heads, local_seq) fp32,
    with return_lse); gradients flow back to q, k, v through autograd (the ring is two custom
    operators, so torch.compile(fullgraph=True) holds it in one graph). group: a process group,
    its name (group.group_name), or None for the default group. causal: the whole
    sequence's causal mask; softcap as in attention(); deterministic: the backward's sums in a
    fixed order. method: "ring" (K/V passed rank to rank under the blocks: memory of one
    rank's K/V in flight; the default, measured as fast as the other on 2 GPUs) or
    "allgather" (every rank's K/V gathered at once, dK/dV reduced to their owners: fewer,
    larger collectives, P times the K/V memory).

    window_size (left, right): a sliding window over the whole sequence, as attention() takes
    it: query i sees keys i - left to i + right, -1 leaves a side unbounded, causal sets right
    to 0. Blocks outside the window are skipped, partial ones run on the slices that hold the
    band, and the ring runs only the steps (in both directions when shorter) that carry keys
    some rank sees (layout.Plan.steps); the all-gather skips the empty blocks.

    Varlen packs: with cu_seqlens (the whole pack's (batch + 1,) offsets, the same on every
    rank, each sequence's length a multiple of 2 x ranks), q, k, v are this rank's local pack
    (local_total, heads, d_head) as shard_packed makes it (every sequence zigzag-sharded on its
    own), causal applies per sequence, and the LSE is (heads, local_total). A pack takes no
    window (ValueError): its sequences' chunks differ in length, so a window's slices would
    differ per sequence.

    transport (the ring's; links.py): "push" (the default) passes K/V (and the backward's dK/dV
    sums) on by NCCL point-to-point, whose kernel waits for SMs the attention kernels hold;
    "pull" copies them from the rank that holds them with the copy engines, out of a
    symmetric-memory workspace, so the transfers run under the attention calls (faster in the
    benchmarks, but a training example with it stalled once: docs/distributed.md); "auto"
    pulls where every rank's GPU can map every other's memory (CUDA peer access), else pushes.
    On CPU tensors (gloo) both are sends and receives."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    causal, (left, right) = check_window(bool(causal), window_size)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed initialised "
                           "(dist.init_process_group)")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse, _ = _ring_op(q, k, v, cu_seqlens, _name_of(group), float(scale), causal, left,
                           right, float(softcap), bool(deterministic), method, transport)
    return (out, lse) if return_lse else out
