"""Which chunks of the sequence each rank holds, and which (query chunk, key chunk) blocks a
mask lets a query see. Plain Python over chunk indices: the same answers for any group size,
tested on the CPU for group sizes the machines at hand do not have.

Zigzag: a sequence of length S is cut into 2P chunks of S / 2P tokens; rank r holds chunks r
and 2P - 1 - r (in that order along its local sequence). Under a causal mask chunk i sees
chunks j < i whole, itself causally, and none after it, so every rank's pair holds the same
number of visible blocks (2P + 1 over a whole ring): no rank waits for another.
"""

from __future__ import annotations

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
