"""How a rank's local tensors split into its two zigzag query chunks and how a key prefix of one
rank's K/V is cut, for the two input forms of ring_attention: one sequence per batch row
(`Fixed`: the chunks are halves of dim 1) and a varlen pack of sequences (`Packed`: every
sequence of the pack zigzag-sharded on its own, so a chunk is a set of rows of each sequence).
The ring (ring.py) sees both through the same methods; tensors are 4-D (batch, rows, heads, d),
a pack as batch 1, LSEs (batch, heads, rows). A call's rows and keys come as a layout.Span:
token rows of the chunks for `Fixed`; whole chunks for `Packed`, whose spans are worked out at
a chunk length of 2 (the masks a pack takes, none and causal, cut whole chunks at any length
from 2 up, and sequences of different lengths could not share a window's token slices)."""

from __future__ import annotations

import itertools

import torch

from .layout import Span


class Fixed:
    """Sequences of equal length, one per batch row: chunk i is half i of dim 1."""

    varlen = None  # the block operations' varlen arguments: none

    def __init__(self, local_len: int) -> None:
        self.chunk = local_len // 2

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return x[:, i * self.chunk:(i + 1) * self.chunk]

    def lse_part(self, lse: torch.Tensor, i: int) -> torch.Tensor:
        return lse[:, :, i * self.chunk:(i + 1) * self.chunk].contiguous()  # rows, as read

    @staticmethod
    def query_rows(span: Span) -> slice:
        """The span's query rows of its chunk."""
        return slice(span.q0, span.q1)

    @staticmethod
    def keys(kv: torch.Tensor, span: Span) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the span's key rows (kv: K and V stacked)."""
        return kv[0][:, span.k0:span.k1], kv[1][:, span.k0:span.k1]

    @staticmethod
    def add_keys(dkv: torch.Tensor, span: Span, dk: torch.Tensor, dv: torch.Tensor) -> None:
        dkv[0][:, span.k0:span.k1].add_(dk)
        dkv[1][:, span.k0:span.k1].add_(dv)

    @staticmethod
    def args(span: Span) -> None:
        return None

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=1)

    def join_lse(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=2)


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
    chunk of every sequence."""

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

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return x.index_select(1, self.rows[i])

    def lse_part(self, lse: torch.Tensor, i: int) -> torch.Tensor:
        return lse.index_select(2, self.rows[i])

    def query_rows(self, span: Span) -> slice:
        """The span's query rows of its chunk: all of them."""
        self._key_chunks(span)
        return slice(None)

    def _key_chunks(self, span: Span) -> int:
        """How many key chunks of every sequence the span reads, from the first: 1 or 2."""
        c = self.chunk
        if (span.q0, span.q1, span.k0) != (0, c, 0) or span.k1 not in (c, 2 * c) \
                or span.left != -1:
            raise AssertionError(f"{span} is not a whole query chunk over a key prefix (a pack "
                                 f"takes no window)")
        return span.k1 // c

    def keys(self, kv: torch.Tensor, span: Span) -> tuple[torch.Tensor, torch.Tensor]:
        if self._key_chunks(span) == 2:
            return kv[0], kv[1]
        first = kv.index_select(2, self.rows[0])  # every sequence's first chunk
        return first[0], first[1]

    def add_keys(self, dkv: torch.Tensor, span: Span, dk: torch.Tensor,
                 dv: torch.Tensor) -> None:
        if self._key_chunks(span) == 2:
            dkv[0].add_(dk)
            dkv[1].add_(dv)
        else:
            dkv[0].index_add_(1, self.rows[0], dk.to(dkv.dtype))
            dkv[1].index_add_(1, self.rows[0], dv.to(dkv.dtype))

    def args(self, span: Span) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a query chunk over the
        first one or two key chunks of every sequence."""
        if self._key_chunks(span) == 2:
            return self.cu_part, self.cu_all, self.max_part, 2 * self.max_part
        return self.cu_part, self.cu_part, self.max_part, self.max_part

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        out = parts[0].new_empty(parts[0].shape[0], self.total, *parts[0].shape[2:])
        for rows, p in zip(self.rows, parts):
            out.index_copy_(1, rows, p)
        return out

    def join_lse(self, parts: list[torch.Tensor]) -> torch.Tensor:
        out = parts[0].new_empty(*parts[0].shape[:2], self.total)
        for rows, p in zip(self.rows, parts):
            out.index_copy_(2, rows, p)
        return out
