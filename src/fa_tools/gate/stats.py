"""Statistics of the A/B gate, pure Python and deterministic (seeded).

The gate measures base and head in alternating rounds, so each round gives one paired
difference d = ln(head / base) of the two sides' medians, measured seconds apart on the same
GPU: slow drift of the machine (clocks, temperature) cancels within a pair. The tests here are on
those differences: a one-sided Wilcoxon signed-rank test (exact for up to 50 pairs without ties)
and the matching Hodges-Lehmann estimate with its distribution-free interval."""

from __future__ import annotations

import math
import statistics
from functools import lru_cache


def _ranks(values: list[float]) -> list[float]:
    """Ranks 1..n, ties getting the average of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


@lru_cache(maxsize=64)
def _signed_rank_counts(n: int) -> tuple[int, ...]:
    """counts[w]: how many of the 2^n sign patterns of ranks 1..n give W+ = w."""
    counts = [1]
    for rank in range(1, n + 1):
        nxt = counts + [0] * rank
        for w, c in enumerate(counts):
            nxt[w + rank] += c
        counts = nxt
    return tuple(counts)


def signed_rank_greater(diffs: list[float]) -> float:
    """One-sided p-value that the differences tend to be positive (head slower than base).
    Zero differences are dropped (Wilcoxon's rule); exact for up to 50 non-zero differences
    without ties in their magnitudes, else the normal approximation with tie and continuity
    corrections. With n pairs the smallest p reachable is 2^-n."""
    d = [x for x in diffs if x != 0]
    n = len(d)
    if n == 0:
        return 1.0
    magnitudes = [abs(x) for x in d]
    ranks = _ranks(magnitudes)
    w_plus = sum(r for r, x in zip(ranks, d) if x > 0)
    if n <= 50 and len(set(magnitudes)) == n:
        counts = _signed_rank_counts(n)
        return sum(counts[int(w_plus):]) / 2**n
    mean = n * (n + 1) / 4
    ties: dict[float, int] = {}
    for m in magnitudes:
        ties[m] = ties.get(m, 0) + 1
    var = n * (n + 1) * (2 * n + 1) / 24 - sum(t**3 - t for t in ties.values()) / 48
    if var <= 0:
        return 1.0
    z = (w_plus - mean - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2))


def hodges_lehmann(diffs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(estimate, low, high): the Hodges-Lehmann estimate of the differences' centre (the median
    of all pairwise means, Walsh averages) and its distribution-free interval from the
    signed-rank distribution (exact up to 50 differences, normal approximation above)."""
    n = len(diffs)
    walsh = sorted((diffs[i] + diffs[j]) / 2 for i in range(n) for j in range(i, n))
    estimate = statistics.median(walsh)
    tail = (1 - level) / 2
    if n <= 50:
        counts, total = _signed_rank_counts(n), 2**n
        k, cum = 0, 0
        while k < len(counts) and (cum + counts[k]) / total <= tail:
            cum += counts[k]
            k += 1
    else:
        z = statistics.NormalDist().inv_cdf(1 - tail)
        k = int(n * (n + 1) / 4 - z * math.sqrt(n * (n + 1) * (2 * n + 1) / 24))
    k = min(max(k, 0), (len(walsh) - 1) // 2)  # k smallest W+ values are in the tail
    return estimate, walsh[k], walsh[len(walsh) - 1 - k]


def log_ratios(head: list[float], base: list[float]) -> list[float]:
    """Paired differences ln(head_i / base_i), one per round."""
    return [math.log(h / b) for h, b in zip(head, base)]


def cv(values: list[float]) -> float:
    """Coefficient of variation (spread relative to the mean)."""
    if len(values) < 2:
        return 0.0
    return statistics.stdev(values) / statistics.fmean(values)
