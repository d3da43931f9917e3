"""Causal and sliding-window masks, FlashAttention's conventions, in plain Python and torch.

Query i sees key j iff ``i + off - left <= j <= i + off + right`` with ``off = seqlen_k -
seqlen_q`` (the diagonal aligned bottom-right), each side unbounded when its window is -1.
``causal=True`` sets right = 0. A row that sees no key gives output 0 and LSE -inf.

:func:`kv_blocks` mirrors ``flash::window_blocks`` (src/csrc/common/mask.cuh): which KV blocks a
query block visits and which of them need masking; :func:`block_mask` mirrors
``flash::WindowMask``: the element mask of one such block, as a range of column - row. The block
emulation uses both, and the tests check them against the element-wise rule, so the kernel's
index arithmetic has a CPU-tested twin. The backward's twins: :func:`bwd_block_mask` the sm80
family's masked pass (a range of query columns per key row), :func:`query_blocks` mirrors
``bwd::Window::rows`` as both backward families use it (the query blocks a KV block visits),
:func:`dq_turn` the deterministic order's turn (``accumulate_dq`` in sm80/backward_kernel.cuh,
``BackwardTile::dq_turn`` in sm90/backward_tile.cuh).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def canonical_window(causal: bool, window_size: tuple[int, int], seqlen_q: int,
                     seqlen_k: int) -> tuple[int, int]:
    """(left, right) with causal folded in (right = 0) and every side that bounds nothing
    written as -1: left >= seqlen_k and right >= seqlen_q can exclude no key of any row."""
    left, right = window_size
    if causal:
        right = 0
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_q:
        right = -1
    return left, right


def visible(seqlen_q: int, seqlen_k: int, left: int, right: int,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: which keys each query row sees."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    rel = j - i - (seqlen_k - seqlen_q)  # key - row - off
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= rel >= -left
    if right >= 0:
        ok &= rel <= right
    return ok


def visible_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """How many (query, key) pairs `visible` marks, in closed form per row (no mask is made):
    the FLOP count of a causal or windowed call."""
    off = seqlen_k - seqlen_q
    rows = torch.arange(seqlen_q, dtype=torch.int64)
    lo = (rows + off - left).clamp(min=0) if left >= 0 else torch.zeros_like(rows)
    hi = (rows + off + right).clamp(max=seqlen_k - 1) if right >= 0 else torch.full_like(
        rows, seqlen_k - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


@dataclass(frozen=True)
class KvBlocks:
    """KV blocks [first, last] of one query block (empty when last < first); those in
    [full_first, full_last] are seen whole by every row of the block and need no mask."""

    first: int
    last: int
    full_first: int
    full_last: int

    @property
    def count(self) -> int:
        return max(0, self.last - self.first + 1)

    def needs_mask(self, j: int) -> bool:
        return j < self.full_first or j > self.full_last


def kv_blocks(q_row0: int, block_r: int, block_c: int, seqlen_q: int, seqlen_k: int,
              left: int, right: int) -> KvBlocks:
    """The KV blocks query block [q_row0, q_row0 + block_r) visits; as the kernel computes it."""
    off = seqlen_k - seqlen_q
    row_first, row_last = q_row0, min(q_row0 + block_r, seqlen_q) - 1
    key_lo = 0 if left < 0 else max(0, row_first + off - left)
    key_hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, row_last + off + right)
    if key_hi < key_lo:
        return KvBlocks(0, -1, 0, -1)
    first, last = key_lo // block_c, key_hi // block_c
    full_first = first if left < 0 else -(-(row_last + off - left) // block_c)
    full_last = last if right < 0 else (row_first + off + right - block_c + 1) // block_c
    full_last = min(full_last, seqlen_k // block_c - 1)
    return KvBlocks(first, last, max(full_first, first), min(full_last, last))


BIG = 1 << 24  # WindowMask::kBig: beyond any |column - row| inside one block pair


def block_mask(q_row0: int, kv_col0: int, rows: int, cols: int, seqlen_q: int, seqlen_k: int,
               left: int, right: int) -> torch.Tensor:
    """(rows, cols) bool: which elements of the block at (q_row0, kv_col0) are visible, computed
    as the kernel does: a range of c - r (block column minus CTA row) clamped to 32 bits, and
    the columns before seqlen_k."""
    base = kv_col0 - (q_row0 + seqlen_k - seqlen_q)
    lo = -BIG if left < 0 else max(-BIG, min(BIG, -left - base))
    hi = BIG if right < 0 else max(-BIG, min(BIG, right - base))
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    d = c - r
    return (c < seqlen_k - kv_col0) & (d >= lo) & (d <= hi)


def bwd_block_mask(k_row0: int, q_row0: int, keys: int, cols: int, seqlen_q: int,
                   seqlen_k: int, left: int, right: int) -> torch.Tensor:
    """(keys, cols) bool: which elements of S^T's block at (k_row0, q_row0) the sm80 backward's
    masked pass keeps, computed as it does (``store_p_ds<true>`` in sm80/backward_kernel.cuh):
    per key row a range of query columns [key + lo_base, min(key + hi_base, q_valid - 1)], with
    b = k_row0 - q_row0 - off and the bases b - right and b + left clamped to +-BIG, empty past
    k_valid. (The kernel subtracts its thread's first column from both bounds; that shift
    changes nothing here.)"""
    b = k_row0 - q_row0 - (seqlen_k - seqlen_q)
    lo_base = -BIG if right < 0 else max(-BIG, min(BIG, b - right))
    hi_base = BIG if left < 0 else max(-BIG, min(BIG, b + left))
    q_valid, k_valid = seqlen_q - q_row0, seqlen_k - k_row0
    key = torch.arange(keys)[:, None]
    col = torch.arange(cols)[None, :]
    hi = torch.minimum(key + hi_base, torch.full_like(key, q_valid - 1))
    return (key < k_valid) & (col >= key + lo_base) & (col <= hi)


def query_blocks(k_row0: int, block_c: int, block_r: int, seqlen_q: int, seqlen_k: int,
                 left: int, right: int) -> range:
    """The query blocks of block_r rows the KV block [k_row0, k_row0 + block_c) visits in the
    backward (``bwd::Window::rows`` of its first and last key; empty when no row sees them)."""
    off = seqlen_k - seqlen_q
    k_last = min(k_row0 + block_c, seqlen_k) - 1
    lo = 0 if right < 0 else max(0, k_row0 - off - right)
    hi = seqlen_q - 1 if left < 0 else min(seqlen_q - 1, k_last - off + left)
    return range(lo // block_r, hi // block_r + 1) if hi >= lo else range(0)


def dq_turn(i: int, kv_block: int, block_r: int, block_c: int, seqlen_q: int, seqlen_k: int,
            left: int, right: int) -> int:
    """The deterministic backward's turn of KV block kv_block at query block i: how many KV
    blocks add their dQ to the block before it (the last KV block that sees it first)."""
    off = seqlen_k - seqlen_q
    q_last = min(i * block_r + block_r, seqlen_q) - 1
    key_hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, q_last + off + right)
    return key_hi // block_c - kv_block


def rotated_start(kv_block: int, n_q: int, n_kv: int) -> int:
    """The Hopper backward's rotated deterministic order (no mask: every KV block sees every
    query block; n_q a multiple of n_kv): the query block KV block kv_block visits first, r =
    n_q / n_kv apart, so that the KV blocks reach a query block one after another rather than
    all at block 0."""
    return kv_block * (n_q // n_kv)


def rotated_dq_turn(i: int, kv_block: int, n_q: int, n_kv: int) -> int:
    """The rotated order's turn of KV block kv_block at query block i (of any head: every head's
    blocks are visited from the same start, cyclically): the KV block whose start is i // r
    reaches the block first, then i // r - 1, ... cyclically. bwd::rotated_dq_turn is its CUDA
    twin."""
    return (i // (n_q // n_kv) - kv_block) % n_kv
