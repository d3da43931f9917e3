"""Causal / sliding-window masks (CPU): the element rule, the canonical window, and the KV block
ranges the kernel visits (masks.kv_blocks, the twin of flash::window_blocks) against brute
force over every element."""

from __future__ import annotations

import random

import pytest
import torch

from flash_attention.masks import (
    block_mask,
    bwd_block_mask,
    canonical_window,
    dq_turn,
    kv_blocks,
    query_blocks,
    rotated_dq_turn,
    rotated_start,
    visible,
    visible_pairs,
)
from flash_attention.timing import attention_flops


def test_causal_is_bottom_right():
    # Sq < Sk: the last query row sees every key; row i sees keys <= i + Sk - Sq.
    seen = visible(3, 5, *canonical_window(True, (-1, -1), 3, 5))
    assert seen.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # Sq > Sk: the first Sq - Sk rows see no key at all.
    seen = visible(4, 2, *canonical_window(True, (-1, -1), 4, 2))
    assert seen.tolist() == [[0, 0], [0, 0], [1, 0], [1, 1]]


def test_window_and_canonical_form():
    seen = visible(5, 5, 1, 1)
    assert seen.sum(1).tolist() == [2, 3, 3, 3, 2]
    assert canonical_window(False, (-1, -1), 10, 20) == (-1, -1)
    assert canonical_window(True, (3, 7), 10, 20) == (3, 0), "causal sets right to 0"
    # Sides that can exclude no key become -1 (so an unmasked kernel may serve the call) ...
    assert canonical_window(False, (20, 10), 10, 20) == (-1, -1)
    # ... and the others stay: right = 9 < seqlen_q still hides keys from the first rows.
    assert canonical_window(False, (19, 9), 10, 20) == (19, 9)
    for left, right in [(20, -1), (-1, 10), (19, 9)]:
        c = canonical_window(False, (left, right), 10, 20)
        assert torch.equal(visible(10, 20, *c), visible(10, 20, left, right))


def brute_force(q_row0, block_r, block_c, sq, sk, left, right):
    """(blocks some valid row sees, blocks every valid row sees whole) from the element rule."""
    seen = visible(sq, sk, left, right)[q_row0:min(q_row0 + block_r, sq)]
    n_blocks = -(-sk // block_c)
    touched, whole = [], []
    for j in range(n_blocks):
        tile = seen[:, j * block_c:(j + 1) * block_c]
        if tile.any():
            touched.append(j)
        if tile.shape[1] == block_c and tile.all():
            whole.append(j)
    return touched, whole


CASES = [(128, 64, 1, 1), (64, 64, 1000, 1000), (128, 64, 1023, 1024), (128, 32, 113, 203),
         (64, 128, 300, 1), (128, 64, 4096, 128), (64, 64, 77, 500), (128, 128, 1, 300)]


@pytest.mark.parametrize("block_r, block_c, sq, sk", CASES)
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (0, 0), (16, -1), (100, 3), (5, 200),
                                    (-1, 50), (300, 0), (2000, 2000)])
def test_kv_blocks_match_the_element_rule(block_r, block_c, sq, sk, window):
    for causal in (False, True):
        left, right = canonical_window(causal, window, sq, sk)
        for q_row0 in range(0, sq, block_r):
            b = kv_blocks(q_row0, block_r, block_c, sq, sk, left, right)
            touched, whole = brute_force(q_row0, block_r, block_c, sq, sk, left, right)
            visited = list(range(b.first, b.last + 1))
            assert visited == touched, (q_row0, left, right)  # contiguous, none missed or extra
            unmasked = [j for j in visited if not b.needs_mask(j)]
            assert unmasked == whole, (q_row0, left, right)  # masked exactly where needed


def test_kv_blocks_random():
    rng = random.Random(0)
    for _ in range(300):
        block_r, block_c = rng.choice([64, 128]), rng.choice([32, 64, 128])
        sq, sk = rng.randint(1, 700), rng.randint(1, 700)
        left, right = rng.choice([-1, rng.randint(0, 800)]), rng.choice([-1, rng.randint(0, 800)])
        for q_row0 in range(0, sq, block_r):
            b = kv_blocks(q_row0, block_r, block_c, sq, sk, left, right)
            touched, whole = brute_force(q_row0, block_r, block_c, sq, sk, left, right)
            assert list(range(b.first, b.last + 1)) == touched
            assert [j for j in touched if not b.needs_mask(j)] == whole


def _backward_order_holds(block_r, block_c, sq, sk, left, right):
    """The backward's block loops against the element rule: each KV block visits exactly the
    query blocks with a pair it sees, and the KV blocks that visit a query block hold the turns
    0 .. n-1 of the deterministic order, each once, the last of them first. A gap or a repeat
    would make a CTA wait for a turn that never comes (a hang)."""
    seen = visible(sq, sk, left, right)
    n_kv = -(-sk // block_c)
    visitors = {}
    for j in range(n_kv):
        blocks = query_blocks(j * block_c, block_c, block_r, sq, sk, left, right)
        touched = [i for i in range(-(-sq // block_r))
                   if seen[i * block_r:(i + 1) * block_r, j * block_c:(j + 1) * block_c].any()]
        assert list(blocks) == touched, (j, left, right)
        for i in blocks:
            visitors.setdefault(i, []).append(j)
    for i, kv in visitors.items():
        turns = sorted(dq_turn(i, j, block_r, block_c, sq, sk, left, right) for j in kv)
        assert turns == list(range(len(kv))), (i, kv, turns)
        assert dq_turn(i, max(kv), block_r, block_c, sq, sk, left, right) == 0


@pytest.mark.parametrize("block_r, block_c", [(64, 128), (128, 128), (64, 64)])
@pytest.mark.parametrize("sq, sk", [(1, 1), (300, 113), (113, 300), (1000, 1000), (700, 900)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, 0), (300, 50), (16, -1), (-1, 17)])
def test_backward_blocks_and_deterministic_turns(block_r, block_c, sq, sk, window):
    for causal in (False, True):
        _backward_order_holds(block_r, block_c, sq, sk, *canonical_window(causal, window, sq, sk))


def test_backward_blocks_and_deterministic_turns_random():
    rng = random.Random(2)
    for _ in range(150):
        sq, sk = rng.randint(1, 600), rng.randint(1, 600)
        left, right = rng.choice([-1, rng.randint(0, 700)]), rng.choice([-1, rng.randint(0, 700)])
        _backward_order_holds(rng.choice([64, 128]), rng.choice([64, 128]), sq, sk, left, right)


def test_block_mask_is_the_element_rule():
    """The kernel's element mask (c - r range per block, clamped) equals the rule, for blocks
    anywhere in the matrix, including far from the diagonal and past seqlen_k."""
    rng = random.Random(1)
    for _ in range(400):
        sq, sk = rng.randint(1, 600), rng.randint(1, 600)
        left, right = rng.choice([-1, rng.randint(0, 700)]), rng.choice([-1, rng.randint(0, 700)])
        block_r, block_c = rng.choice([64, 128]), rng.choice([32, 64, 128])
        q_row0 = rng.randrange(0, sq, block_r) if sq > block_r else 0
        kv_col0 = rng.randrange(0, sk, block_c) if sk > block_c else 0
        rows = min(block_r, sq - q_row0)
        got = block_mask(q_row0, kv_col0, rows, block_c, sq, sk, left, right)
        want = torch.zeros(rows, block_c, dtype=torch.bool)
        ncols = min(block_c, sk - kv_col0)
        want[:, :ncols] = visible(sq, sk, left, right)[q_row0:q_row0 + rows,
                                                       kv_col0:kv_col0 + ncols]
        assert torch.equal(got, want), (sq, sk, left, right, q_row0, kv_col0)


def test_bwd_block_mask_is_the_element_rule():
    """The sm80 backward's masked pass (a range of query columns per key row, bases clamped to
    +-2^24) equals the rule transposed, for blocks anywhere, past both tails, and with offsets
    far beyond the clamp (seqlen_k - seqlen_q up to 2^26, windows near and far)."""
    rng = random.Random(2)
    for n in range(500):
        far = n % 5 == 0
        sq = rng.randint(1, 600)
        sk = sq + rng.randint(1 << 25, 1 << 26) if far else rng.randint(1, 600)
        left, right = rng.choice([-1, rng.randint(0, 700)]), rng.choice([-1, rng.randint(0, 700)])
        block_c, block_r = rng.choice([64, 128]), rng.choice([64, 128])
        if far and n % 10 == 0:  # a KV block anywhere: the bases far past the clamp
            k_row0 = rng.randrange(0, sk, block_c)
        elif far:  # a KV block near the diagonal of some row (or just before/after it)
            k_row0 = min(max(0, sk - sq + rng.randrange(-300, sq + 300)), sk - 1)
            k_row0 = k_row0 // block_c * block_c
        else:
            k_row0 = rng.randrange(0, sk, block_c) if sk > block_c else 0
        q_row0 = rng.randrange(0, sq, block_r) if sq > block_r else 0
        got = bwd_block_mask(k_row0, q_row0, block_c, block_r, sq, sk, left, right)
        keys, cols = min(block_c, sk - k_row0), min(block_r, sq - q_row0)
        want = torch.zeros(block_c, block_r, dtype=torch.bool)
        i = torch.arange(q_row0, q_row0 + cols)[None, :]
        j = torch.arange(k_row0, k_row0 + keys)[:, None]
        rel = j - i - (sk - sq)
        ok = torch.ones(keys, cols, dtype=torch.bool)
        if left >= 0:
            ok &= rel >= -left
        if right >= 0:
            ok &= rel <= right
        want[:keys, :cols] = ok
        assert torch.equal(got, want), (sq, sk, left, right, k_row0, q_row0)


@pytest.mark.parametrize("sq,sk", [(5, 5), (3, 9), (9, 3), (64, 200)])
@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (0, 0), (2, 0), (3, 5), (-1, 4),
                                        (500, 0)])
def test_visible_pairs_counts_the_mask(sq, sk, left, right):
    assert visible_pairs(sq, sk, left, right) == int(visible(sq, sk, left, right).sum())


def test_flops_count_visible_pairs_under_a_window():
    full = attention_flops(2, 4, 64, 64, 128)
    assert attention_flops(2, 4, 64, 64, 128, causal=True) == full / 2, "the Sq == Sk convention"
    assert attention_flops(2, 4, 64, 64, 128, window_size=(-1, -1)) == full
    pairs = int(visible(64, 64, 8, 0).sum())
    assert attention_flops(2, 4, 64, 64, 128, window_size=(8, 0)) == 4.0 * 2 * 4 * 128 * pairs
    pairs = int(visible(16, 64, -1, 0).sum())  # causal with Sq != Sk: bottom-right, counted
    assert attention_flops(1, 1, 16, 64, 128, causal=True) == 4.0 * 128 * pairs


@pytest.mark.parametrize("n_q, n_kv", [(1, 1), (32, 32), (64, 32), (15, 5), (128, 2), (66, 66),
                                       (192, 64), (7, 7), (9, 1)])
def test_rotated_deterministic_turns(n_q, n_kv):
    """The rotated order (Hopper, deterministic, no mask, n_q a multiple of n_kv: the launcher
    uses it only then): at every query block the KV blocks
    hold the turns 0 .. n_kv-1 each once, in the order they reach the block (steps from their
    start, then index), so a KV block only waits for one that got there in fewer steps or
    with the same start and a smaller index: no cycle, no turn that never comes."""
    heads = 3  # of a GQA group: each head's blocks from the same start, cyclically
    for h in range(heads):
        for i in range(n_q):
            turns = [rotated_dq_turn(i, j, n_q, n_kv) for j in range(n_kv)]
            assert sorted(turns) == list(range(n_kv)), (h, i, turns)
            steps = [h * n_q + (i - rotated_start(j, n_q, n_kv)) % n_q for j in range(n_kv)]
            arrival = sorted(range(n_kv), key=lambda j: (steps[j], j))
            assert [turns[j] for j in arrival] == list(range(n_kv)), (h, i, turns)
