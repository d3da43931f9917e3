"""Which chunks of the sequence each rank holds, and which (query chunk, key chunk) blocks a
mask lets a query see. Plain Python over chunk indices: the same answers for any group size,
tested on the CPU for group sizes the machines at hand do not have.

Zigzag: a sequence of length S is cut into 2P chunks of S / 2P tokens; rank r holds chunks r
and 2P - 1 - r (in that order along its local sequence). Under a causal mask chunk i sees
chunks j < i whole, itself causally, and none after it, so every rank's pair holds the same
number of visible blocks (2P + 1 over a whole ring): no rank waits for another.

Sliding windows (`Plan`): query chunk a against key chunk b (c tokens each) is a band, row i
seeing key j iff D - left <= j - i <= D + right with D = (a - b) c: empty (skipped), whole, or
partial. A partial block runs as one call on the slices of its rows and keys that hold the
band, the window shifted onto the slices (aligned bottom-right, as the kernels align it), so
the kernels' windows (each side -1 or >= 0) express every block. The ring then runs only the
steps some rank needs, in both directions when that is shorter (`Plan.steps`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# What a query chunk sees of a key chunk (equal lengths; causal aligned on the diagonal).
FULL, DIAGONAL, NONE = "full", "diagonal", "none"


@dataclass(frozen=True)
class Layout:
    """The zigzag layout of a group of `ranks` ranks."""

    ranks: int

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"a group has at least one rank, got {self.ranks}")

    @property
    def chunks(self) -> int:
        return 2 * self.ranks

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The chunk indices rank holds, in local order."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} is not in a group of {self.ranks}")
        return rank, self.chunks - 1 - rank

    @staticmethod
    def visibility(q_chunk: int, k_chunk: int, causal: bool) -> str:
        """FULL, DIAGONAL (a causal block on the diagonal) or NONE."""
        if not causal or k_chunk < q_chunk:
            return FULL
        return DIAGONAL if k_chunk == q_chunk else NONE

    def blocks(self, q_rank: int, kv_rank: int, causal: bool) -> list[tuple[int, int, str]]:
        """(local q chunk, local kv chunk, visibility) of every visible block between the chunks
        of q_rank and those of kv_rank."""
        out = []
        for i, qc in enumerate(self.chunks_of(q_rank)):
            for j, kc in enumerate(self.chunks_of(kv_rank)):
                vis = self.visibility(qc, kc, causal)
                if vis != NONE:
                    out.append((i, j, vis))
        return out

    def check_length(self, seqlen: int) -> None:
        if seqlen % self.chunks:
            raise ValueError(f"a sequence of {seqlen} tokens does not split into {self.chunks} "
                             f"equal chunks ({self.ranks} ranks x 2); pad it to a multiple of "
                             f"{self.chunks}")


# Span.chunk of a call that takes both of a rank's query chunks (its whole local shard).
BOTH = 2


@dataclass(frozen=True)
class Span:
    """One kernel call of the ring: query rows [q0, q1) of the rank's local query chunk `chunk`
    (0 or 1; BOTH: of its two chunks back to back, rows 0 to 2c) over key rows [k0, k1) of a
    source rank's local K/V (its two chunks back to back), masked by the window (left, right)
    aligned bottom-right on these slices (-1: unbounded)."""

    chunk: int
    q0: int
    q1: int
    k0: int
    k1: int
    left: int
    right: int

    @property
    def window(self) -> tuple[int, int]:
        return self.left, self.right

    def local_rows(self, chunk_len: int) -> tuple[int, int]:
        """The span's query rows in the rank's local order (its two chunks back to back)."""
        base = 0 if self.chunk == BOTH else self.chunk * chunk_len
        return base + self.q0, base + self.q1


def band_slice(rows: int, keys: int, lo: int | None, hi: int | None
               ) -> tuple[int, int, int, int, int, int] | None:
    """The band lo <= j - i <= hi of a block of `rows` query rows i and `keys` key rows j (None:
    that side unbounded; lo <= hi) as one call: (q0, q1, k0, k1, left, right), the rows that
    see a key, the keys they see, and the window that masks exactly the band on those slices,
    aligned bottom-right (a side that bounds nothing there is -1). None: no pair in the band.

    The rows that see a key are q0 = max(0, -hi) to q1 = min(rows, keys - lo); the first sees
    keys from max(0, q0 + lo), the last up to min(keys, q1 + hi) - 1, which it sees: the slices'
    bottom-right corner is in the band, so the shifted bounds straddle its diagonal and both
    window sides come out >= 0."""
    q0 = 0 if hi is None else max(0, -hi)
    q1 = rows if lo is None else min(rows, keys - lo)
    if q0 >= q1:
        return None
    k0 = 0 if lo is None else max(0, q0 + lo)
    k1 = keys if hi is None else min(keys, q1 + hi)
    n_q, n_k = q1 - q0, k1 - k0
    off = n_k - n_q  # the slices' diagonal (bottom-right): j' - i' = off
    # on the slices j' - i' = (j - i) - (k0 - q0): the band's bounds there
    lo_s = None if lo is None else lo - (k0 - q0)
    hi_s = None if hi is None else hi - (k0 - q0)
    left = -1 if lo_s is None or lo_s <= -(n_q - 1) else off - lo_s
    right = -1 if hi_s is None or hi_s >= n_k - 1 else hi_s - off
    if left < -1 or right < -1:
        raise AssertionError(f"band [{lo}, {hi}] of a {rows} x {keys} block: window "
                             f"({left}, {right})")
    return q0, q1, k0, k1, left, right


@dataclass(frozen=True)
class Plan:
    """The calls and ring steps of one ring_attention call: the layout, the chunk length
    `chunk` in tokens and the window (left, right) over the whole sequence, causal folded in
    (right 0) and -1 for an unbounded side (masks.canonical_window)."""

    layout: Layout
    chunk: int
    left: int = -1
    right: int = -1

    def block(self, q_chunk: int, k_chunk: int) -> tuple[int, int, int, int, int, int] | None:
        """band_slice of the block of global chunks (q_chunk, k_chunk); None when empty."""
        d = (q_chunk - k_chunk) * self.chunk  # key j, row i of the block: j - i - d globally
        return band_slice(self.chunk, self.chunk, None if self.left < 0 else d - self.left,
                          None if self.right < 0 else d + self.right)

    def spans(self, q_rank: int, kv_rank: int) -> tuple[Span, ...]:
        """The calls q_rank's query chunks make on kv_rank's keys (none: nothing visible). One
        call per query chunk where the blocks of the two key chunks form one key prefix with a
        mask the kernels take: the first seen whole and some of the second by every row (no
        mask, or causal on the diagonal: always so without a window, as the zigzag puts it);
        otherwise one call per non-empty block. Without a window the two query chunks' calls
        are one (BOTH) where their masks are one mask over the local shard (_both)."""
        return self._spans[q_rank, kv_rank]

    @functools.cached_property
    def _spans(self) -> dict[tuple[int, int], tuple[Span, ...]]:
        ranks = range(self.layout.ranks)
        return {(q, kv): self._pair(q, kv) for q in ranks for kv in ranks}

    def _pair(self, q_rank: int, kv_rank: int) -> tuple[Span, ...]:
        c = self.chunk
        full = (0, c, 0, c, -1, -1)
        out = []
        for i, a in enumerate(self.layout.chunks_of(q_rank)):
            first, second = (self.block(a, b) for b in self.layout.chunks_of(kv_rank))
            if first == full and second is not None and second[:2] == (0, c):
                # Every row sees all of the first chunk and some of the second, so (the band
                # being one interval of the sequence) the second from its first key: the two
                # are one key prefix, bounded at most on the right (second[2:5] is 0, _, -1).
                out.append(Span(i, 0, c, 0, c + second[3], -1, second[5]))
                continue
            for j, s in enumerate((first, second)):
                if s is not None:
                    q0, q1, k0, k1, left, right = s
                    out.append(Span(i, q0, q1, k0 + j * c, k1 + j * c, left, right))
        return self._both(tuple(out))

    def _both(self, spans: tuple[Span, ...]) -> tuple[Span, ...]:
        """The two query chunks' calls as one over the local shard (rows 0 to 2c) where, with no
        window, that one call's mask is theirs: both see the same keys unmasked (a rank's keys
        from the chunks before both of its own, or any keys without a mask), or the rank's own
        keys under a causal mask (chunk 0 causal over the first key chunk, chunk 1 over both:
        causal over the shard, since the local order keeps the chunks' order). Else as they
        are."""
        c = self.chunk
        if self.left != -1 or len(spans) != 2 or [s.chunk for s in spans] != [0, 1]:
            return spans
        a, b = spans
        whole = all((s.q0, s.q1, s.k0, s.left) == (0, c, 0, -1) for s in spans)
        if whole and a.k1 == b.k1 and a.right == b.right == -1:
            return (Span(BOTH, 0, 2 * c, 0, a.k1, -1, -1),)
        if whole and (a.k1, a.right, b.k1, b.right) == (c, 0, 2 * c, 0):
            return (Span(BOTH, 0, 2 * c, 0, 2 * c, -1, 0),)
        return spans

    @functools.cached_property
    def steps(self) -> tuple[int, int]:
        """(forward, backward): the ring steps that carry K/V to the next rank (rank r then
        holds r - s at step s) and to the previous one (r + s). Every offset d = (r - src) mod
        P at which a rank r sees keys of src must be covered, d <= forward or P - d <=
        backward; the pair with the fewest transfers (then the fewest rounds) wins, and when
        that is no fewer than the whole ring's P - 1 the ring runs whole, one way: (P - 1,
        0). (Zigzag puts both neighbours of a chunk on the ranks either side, so a small
        window needs both directions.)"""
        ranks = self.layout.ranks
        needed = {(r - s) % ranks for r in range(ranks) for s in range(ranks)
                  if self.spans(r, s)}
        best = (ranks - 1, 0)
        for forward in range(ranks):
            backward = max((ranks - d for d in needed if d > forward), default=0)
            if (forward + backward, max(forward, backward)) < (sum(best), max(best)):
                best = (forward, backward)
        return best if sum(best) < ranks - 1 else (ranks - 1, 0)


@functools.lru_cache(maxsize=64)
def plan_for(ranks: int, chunk: int, left: int = -1, right: int = -1) -> Plan:
    """The Plan of a group size, chunk length and window, kept for the calls that repeat them
    (its spans and steps are worked out once, over every pair of ranks)."""
    return Plan(Layout(ranks), chunk, left, right)


def _group_size_rank(group) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def shard_sequence(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag chunks of the whole sequence x (every rank passes the same x), along
    `dim`, as one contiguous tensor."""
    ranks, rank = _group_size_rank(group)
    layout = Layout(ranks)
    layout.check_length(x.shape[dim])
    parts = x.chunk(layout.chunks, dim=dim)
    return torch.cat([parts[c] for c in layout.chunks_of(rank)], dim=dim).contiguous()


def gather_sequence(x_local: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's zigzag shard (all_gather), in sequence order."""
    import torch.distributed as dist

    ranks, _ = _group_size_rank(group)
    layout = Layout(ranks)
    pieces = [torch.empty_like(x_local) for _ in range(ranks)]
    dist.all_gather(pieces, x_local.contiguous(), group=group)
    chunks: list[torch.Tensor | None] = [None] * layout.chunks
    for rank, piece in enumerate(pieces):
        for part, c in zip(piece.chunk(2, dim=dim), layout.chunks_of(rank)):
            chunks[c] = part
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def shard_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's local pack of a varlen pack x (total, ...) with offsets cu_seqlens (every
    rank passes the same): of each sequence, in order, its zigzag chunks (rank and 2 ranks - 1
    - rank of 2 ranks equal chunks; each length a multiple of 2 ranks)."""
    from .parts import local_rows

    ranks, rank = _group_size_rank(group)
    layout = Layout(ranks)
    for n in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist():
        layout.check_length(int(n))
    return x.index_select(0, local_rows(cu_seqlens.cpu(), rank, ranks).to(x.device))


def gather_packed(x_local: torch.Tensor, cu_seqlens: torch.Tensor, group=None) -> torch.Tensor:
    """The whole pack from every rank's local pack (all_gather), in pack order."""
    import torch.distributed as dist

    from .parts import local_rows

    ranks, _ = _group_size_rank(group)
    pieces = [torch.empty_like(x_local) for _ in range(ranks)]
    dist.all_gather(pieces, x_local.contiguous(), group=group)
    out = x_local.new_empty(int(cu_seqlens[-1]), *x_local.shape[1:])
    for rank, piece in enumerate(pieces):
        out[local_rows(cu_seqlens.cpu(), rank, ranks).to(x_local.device)] = piece
    return out
