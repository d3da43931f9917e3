"""Statistics of the A/B gate: a one-sided Mann-Whitney U test (exact for small samples) and a
bootstrap confidence interval of the ratio of medians. Pure Python, deterministic (seeded)."""

from __future__ import annotations

import math
import random
import statistics
from functools import lru_cache


def _ranks(values: list[float]) -> list[float]:
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


@lru_cache(maxsize=256)
def _u_distribution(n: int, m: int) -> tuple[int, ...]:
    """Number of arrangements giving each U (0..n*m) for samples of sizes n and m, no ties."""
    # counts[i][j][u]: built up with the recurrence f(n, m, u) = f(n-1, m, u-m) + f(n, m-1, u)
    table = {(0, j): (1,) for j in range(m + 1)}
    for i in range(1, n + 1):
        table[(i, 0)] = (1,)
        for j in range(1, m + 1):
            a = table[(i - 1, j)]
            b = table[(i, j - 1)]
            size = i * j + 1
            out = [0] * size
            for u, c in enumerate(a):
                if u + j < size:
                    out[u + j] += c
            for u, c in enumerate(b):
                out[u] += c
            table[(i, j)] = tuple(out)
    return table[(n, m)]


def mann_whitney_greater(x: list[float], y: list[float]) -> float:
    """One-sided p-value that x tends to be larger than y (e.g. head times slower than base).
    Exact when both samples have at most 20 values and no ties, else the normal approximation
    with tie and continuity corrections."""
    n, m = len(x), len(y)
    if n == 0 or m == 0:
        raise ValueError("both samples need values")
    ranks = _ranks(list(x) + list(y))
    u = sum(ranks[:n]) - n * (n + 1) / 2  # U of x: pairs where x > y (ties count half)
    ties = len(set(list(x) + list(y))) < n + m
    if n <= 20 and m <= 20 and not ties:
        dist = _u_distribution(n, m)
        total = math.comb(n + m, n)
        return sum(dist[int(u):]) / total
    mean = n * m / 2
    counts: dict[float, int] = {}
    for v in list(x) + list(y):
        counts[v] = counts.get(v, 0) + 1
    tie_term = sum(t**3 - t for t in counts.values()) / ((n + m) * (n + m - 1))
    var = n * m / 12 * ((n + m + 1) - tie_term)
    if var <= 0:
        return 1.0
    z = (u - mean - 0.5) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2))


def bootstrap_ratio_ci(head: list[float], base: list[float], level: float = 0.95,
                       iterations: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of median(head) / median(base)."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(iterations):
        h = [rng.choice(head) for _ in head]
        b = [rng.choice(base) for _ in base]
        ratios.append(statistics.median(h) / statistics.median(b))
    ratios.sort()
    lo = ratios[int((1 - level) / 2 * iterations)]
    hi = ratios[min(iterations - 1, int((1 + level) / 2 * iterations))]
    return lo, hi


def cv(values: list[float]) -> float:
    """Coefficient of variation (spread relative to the mean)."""
    if len(values) < 2:
        return 0.0
    return statistics.stdev(values) / statistics.fmean(values)
