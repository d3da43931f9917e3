"""exp2_fma (src/csrc/common/numeric.cuh) evaluated step for step in fp32 on the CPU, with the
polynomial coefficients read from the header: the relative error each degree's comment states,
exact powers of two at integers, 0 at and below -127 (and for -inf), NaN kept."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

HEADER = Path(__file__).resolve().parents[1] / "src" / "csrc" / "common" / "numeric.cuh"
MAGIC = np.float32(12582912.0)  # 1.5 * 2^23


def coefficients() -> dict[int, list[float]]:
    """Degree -> q's coefficients, highest first (the literals of its `q = ...` line)."""
    body = HEADER.read_text().split("float exp2_fma(float x)")[1].split("\n}\n")[0]
    lines = re.findall(r"q = (.*);", body)
    assert len(lines) == 2, body
    return {deg: [float(c) for c in re.findall(r"(-?\d+\.\d+(?:e-?\d+)?)f", line)]
            for deg, line in zip((2, 3), lines)}


def fma32(a, b, c):
    """fmaf: the product of two fp32 values is exact in fp64, one rounding to fp32 after."""
    return (a.astype(np.float64) * b.astype(np.float64) + np.float64(c)).astype(np.float32)


def exp2_fma(x: np.ndarray, degree: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    x = np.where(np.isnan(x), x, np.maximum(x, np.float32(-127.0)))  # max.NaN
    t = (x + MAGIC).astype(np.float32)
    f = (x - (t - MAGIC).astype(np.float32)).astype(np.float32)
    coef = coefficients()[degree]
    q = np.full_like(f, np.float32(coef[0]))
    for c in coef[1:]:
        q = fma32(q, f, np.float32(c))
    bits = t.view(np.uint32).astype(np.uint64)
    scale = (((bits << np.uint64(23)) + np.uint64(0x3F800000)) & np.uint64(0xFFFFFFFF))
    scale = scale.astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return (fma32(q, f, np.float32(1.0)) * scale).astype(np.float32)


@pytest.mark.parametrize("degree,bound", [(2, 2.0e-3), (3, 1.02e-4)])
def test_exp2_fma_relative_error_within_its_stated_bound(degree, bound):
    # every exponent a softmax produces (scores minus the row max, FP8's 2^8 shift on top)
    x = np.concatenate([np.linspace(-125.0, 8.0, 2_000_003, dtype=np.float32),
                        np.random.default_rng(0).uniform(-30, 8, 1_000_000).astype(np.float32)])
    rel = np.abs(exp2_fma(x, degree).astype(np.float64) / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() <= bound, (degree, rel.max(), x[rel.argmax()])


@pytest.mark.parametrize("degree", [2, 3])
def test_exp2_fma_edges(degree):
    ints = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(exp2_fma(ints, degree), np.exp2(ints))  # q(0) adds nothing: exact
    low = np.array([-127.0, -127.5, -200.0, -np.inf], dtype=np.float32)
    assert np.array_equal(exp2_fma(low, degree), np.zeros(4, np.float32))  # as ex2.ftz: 0
    assert np.isnan(exp2_fma(np.array([np.nan], np.float32), degree)).all()
    tiny = exp2_fma(np.array([-126.9, -126.5, -126.2], np.float32), degree)
    assert ((tiny >= 0) & (tiny < 2.0**-125)).all()  # never negative or large near the floor
