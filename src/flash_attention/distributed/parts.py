"""How a rank's local tensors split into its two zigzag query chunks and how a key prefix of one
rank's K/V is cut, for the two input forms of ring_attention: one sequence per batch row
(`Fixed`: the chunks are halves of dim 1) and a varlen pack of sequences (`Packed`: every
sequence of the pack zigzag-sharded on its own, so a chunk is a set of rows of each sequence).
The ring (ring.py) sees both through the same methods; tensors are 4-D (batch, rows, heads, d),
a pack as batch 1, LSEs (batch, heads, rows). A call's rows and keys come as a layout.Span:
token rows of the chunks for `Fixed`; whole chunks for `Packed`, whose spans are worked out at
a chunk length of 2 (the masks a pack takes, none and causal, cut whole chunks at any length
from 2 up, and sequences of different lengths could not share a window's token slices).

A span's query rows and key rows are an index along the row dimension (`queries`, `keys`): a
slice where they are contiguous (the tensors' views, which the kernels read and add into in
place), else a LongTensor of rows (copies; take() and put() move them in and out)."""

from __future__ import annotations

import itertools

import torch

from .layout import BOTH, Span


def take(x: torch.Tensor, dim: int, index) -> torch.Tensor:
    """x's rows `index` (a slice or a LongTensor) along dim: a view for a slice, else a copy."""
    if isinstance(index, slice):
        return x[(slice(None),) * dim + (index,)]
    return x.index_select(dim, index)


def put(x: torch.Tensor, dim: int, index, rows: torch.Tensor) -> None:
    """Writes back rows that take() copied (a slice's view is x itself: nothing to do)."""
    if not isinstance(index, slice):
        x.index_copy_(dim, index, rows)


class Fixed:
    """Sequences of equal length, one per batch row: chunk i is half i of dim 1."""

    def __init__(self, local_len: int) -> None:
        self.chunk = local_len // 2

    def queries(self, span: Span) -> slice:
        """The span's query rows of the rank's local shard."""
        return slice(*span.local_rows(self.chunk))

    @staticmethod
    def keys(span: Span) -> slice:
        """The span's key rows of the source rank's local K/V."""
        return slice(span.k0, span.k1)

    @staticmethod
    def args(span: Span) -> None:
        """The block operations' varlen arguments: none."""
        return None


def local_rows(cu_seqlens: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """The rows of a pack (offsets cu_seqlens) that rank holds, in local order: of each
    sequence, its chunks rank and 2 ranks - 1 - rank of 2 ranks equal chunks."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    rows = []
    for start, end in itertools.pairwise(cu):
        chunk = (end - start) // (2 * ranks)
        for c in (rank, 2 * ranks - 1 - rank):
            rows.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


class Packed:
    """A varlen pack (global offsets cu_seqlens, every length a multiple of 2 ranks): a rank's
    local pack holds, sequence after sequence, its two chunks of each; chunk i is the i-th
    chunk of every sequence, BOTH the whole local pack."""

    chunk = 2  # the chunk length its spans are worked out at (whole chunks: see the top)

    def __init__(self, cu_seqlens: torch.Tensor, ranks: int, device: torch.device) -> None:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        self.chunks = [int(n) // (2 * ranks) for n in lengths]
        local_start, starts = 0, []
        for c in self.chunks:
            starts.append(local_start)
            local_start += 2 * c
        self.rows = [torch.cat([torch.arange(s + i * c, s + (i + 1) * c)
                                for s, c in zip(starts, self.chunks)] or
                               [torch.zeros(0, dtype=torch.long)]).to(device)
                     for i in (0, 1)]
        self.total = local_start
        part_cu = [0]
        for c in self.chunks:
            part_cu.append(part_cu[-1] + c)
        self.cu_part = torch.tensor(part_cu, dtype=torch.int32, device=device)
        self.cu_all = self.cu_part * 2
        self.max_part = max(self.chunks, default=0)

    def _shape(self, span: Span) -> tuple[bool, int]:
        """(whether the span takes both query chunks, how many key chunks of every sequence it
        reads from the first: 1 or 2)."""
        c = self.chunk
        both = span.chunk == BOTH
        if (span.q0, span.q1, span.k0) != (0, 2 * c if both else c, 0) \
                or span.k1 not in (c, 2 * c) or span.left != -1:
            raise AssertionError(f"{span} is not whole query chunks over a key prefix (a pack "
                                 f"takes no window)")
        return both, span.k1 // c

    def queries(self, span: Span):
        both, _ = self._shape(span)
        return slice(None) if both else self.rows[span.chunk]

    def keys(self, span: Span):
        _, key_chunks = self._shape(span)
        return slice(None) if key_chunks == 2 else self.rows[0]  # every sequence's first

    def args(self, span: Span) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of the span's query chunks
        over the first one or two key chunks of every sequence."""
        both, key_chunks = self._shape(span)
        cu_q, max_q = (self.cu_all, 2 * self.max_part) if both else (self.cu_part, self.max_part)
        if key_chunks == 2:
            return cu_q, self.cu_all, max_q, 2 * self.max_part
        return cu_q, self.cu_part, max_q, self.max_part
