"""What the perf gate times for its decode steps (GPU): ours is flash_attn_with_kvcache over the
case's cache (a paged one holds the same keys as the contiguous cache the peers read, in pages
placed at random), SDPA's peer runs the same step, and a measuring request answers with cycles
for both."""

from __future__ import annotations

import pytest
import torch

from fa_tools.gate.coverage import dec_kernel
from fa_tools.gpu.perfcases import DEC_GATE_CASES, Case, Inputs, decode_contenders, measure_case
from flash_attention.reference import attention_reference

pytestmark = pytest.mark.gpu

# Small versions of the gate's decode steps: each cache form, both dtypes, every decode d_head,
# 32 packed rows (on 16-row tiles: a small cache).
CASES = [
    Case("bf16", 128, 1, 1, heads=32, kv_heads=8, seqlen_k=1000, kind="decode"),
    Case("bf16", 128, 3, 1, heads=32, kv_heads=8, seqlen_k=700, page_size=16, kind="decode"),
    Case("fp16", 64, 2, 1, heads=32, kv_heads=8, seqlen_k=600, page_size=256, kind="decode"),
    Case("bf16", 256, 2, 1, heads=16, kv_heads=16, seqlen_k=300, kind="decode"),
    Case("bf16", 128, 2, 4, heads=32, kv_heads=8, seqlen_k=777, causal=True, kind="decode"),
    Case("bf16", 128, 2, 8, heads=32, kv_heads=8, seqlen_k=500, causal=True, kind="decode"),
]


def _needs_decode_kernel(case: Case) -> None:
    from flash_attention.kvcache import built

    if dec_kernel(case) not in {c.name for c in built()}:
        pytest.skip(f"this build has no decode kernel {dec_kernel(case)} "
                    "(FLASH_ATTENTION_KERNELS=default has them all)")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_timed_steps_compute_attention_over_the_cache(require_extension, case):
    _needs_decode_kernel(case)
    inputs = Inputs.make(case)
    if case.page_size:  # the pages hold the contiguous cache's rows where the table says
        k_cache, _, table, _ = inputs.cache
        per_seq = table.shape[1]
        rows = k_cache[table.flatten().long()].view(case.batch, per_seq * case.page_size,
                                                    *k_cache.shape[2:])
        assert torch.equal(rows[:, :case.keys], inputs.k)
    fns = decode_contenders(case, inputs, ("ours", "sdpa_fa2"))
    assert set(fns) == {"ours", "sdpa_fa2"}
    ref = attention_reference(inputs.q, inputs.k, inputs.v, causal=case.causal)[0]
    for name, fn in fns.items():
        got = fn()
        got = got.transpose(1, 2) if name != "ours" else got  # SDPA's (B, H, S, D)
        assert got.shape == ref.shape, name
        err = ((got.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"{name}: relative error {err}"


def test_a_decode_request_answers_with_cycles_for_each_contender(require_extension):
    case = CASES[1]
    _needs_decode_kernel(case)
    result = measure_case(case, Inputs.make(case), reps=3, warm_ms=5.0)
    for name in ("ours", "sdpa_fa2"):
        assert result[name] > 0 and result[f"{name}_mcycles"] > 0 and result[f"{name}_mhz"] > 0


def test_the_gate_decode_steps_run(require_extension):
    """Each of the gate's own decode steps makes its inputs and runs once, finite (the sizes
    the gate times)."""
    for case in DEC_GATE_CASES:
        _needs_decode_kernel(case)
        inputs = Inputs.make(case)
        out = decode_contenders(case, inputs, ("ours",))["ours"]()
        assert out.shape == inputs.q.shape and torch.isfinite(out).all(), case.name
        del inputs
