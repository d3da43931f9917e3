"""What the perf gate times for its FP8 forward cases (GPU, sm_90): ours is fp8.attention_fp8 on
the case's quantised q, k, v with their descales, the SDPA peers the bf16 values they came from,
both computing the same attention, and a measuring request answers with cycles for each."""

from __future__ import annotations

import pytest
import torch

from fa_tools.gpu.perfcases import FP8_GATE_CASES, Case, Inputs, fp8_contenders, measure_case
from flash_attention.reference import attention_reference

pytestmark = pytest.mark.gpu

# Small versions of the gate's FP8 cases: no mask with an SDPA peer (GQA), causal, softcap
# under a window (ours alone), d_head 192 on the d_head 256 kernel.
CASES = [
    Case("e4m3", 128, 2, 300, kv_heads=2, heads=4),
    Case("e4m3", 128, 2, 257, causal=True, heads=4),
    Case("e4m3", 128, 1, 333, window=(64, 0), softcap=30.0, heads=2),
    Case("e4m3", 192, 1, 200, causal=True, heads=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_timed_calls_compute_attention(require_sm90, case):
    inputs = Inputs.make(case)
    q8, qd = inputs.fp8[0], inputs.fp8[3]
    assert q8.dtype == torch.float8_e4m3fn and qd.shape == (case.batch, case.kv)
    fns = fp8_contenders(case, inputs, ("ours", "sdpa_fa2"))
    peers = not (case.softcap or case.window)
    assert set(fns) == ({"ours", "sdpa_fa2"} if peers else {"ours"})
    ref = attention_reference(inputs.q, inputs.k, inputs.v, causal=case.causal,
                              window_size=case.window or (-1, -1), softcap=case.softcap)[0]
    for name, fn in fns.items():
        got = fn()
        got = got.transpose(1, 2) if name != "ours" else got  # SDPA's (B, H, S, D)
        assert got.shape == ref.shape, name
        err = ((got.float() - ref).norm() / ref.norm()).item()
        # the bf16 values against FP8 ones: a few percent (e4m3 keeps 3 mantissa bits)
        assert err < (8e-2 if name == "ours" else 2e-2), f"{name}: relative error {err}"


def test_an_fp8_request_answers_with_cycles_for_each_contender(require_sm90):
    case = CASES[0]
    result = measure_case(case, Inputs.make(case), reps=3, warm_ms=5.0)
    for name in ("ours", "sdpa_fa2"):
        assert result[name] > 0 and result[f"{name}_mcycles"] > 0 and result[f"{name}_mhz"] > 0


def test_the_gate_cases_build_their_inputs(require_sm90):
    """The gate's own FP8 cases make their inputs (the largest fixed-length one, 8 x 8192 x 16
    heads, and the largest pack: (total, heads, d_head), descales per sequence)."""
    for varlen in (False, True):
        case = max((c for c in FP8_GATE_CASES if c.varlen == varlen),
                   key=lambda c: c.batch * c.seqlen * c.heads * c.d_head)
        inputs = Inputs.make(case)
        q8, qd = inputs.fp8[0], inputs.fp8[3]
        rows = ((inputs.varlen[0][-1].item(),) if varlen else (case.batch, case.seqlen))
        assert q8.shape == (*rows, case.heads, case.d_head)
        assert qd.shape == (case.batch, case.kv)


def test_a_varlen_fp8_case_runs_the_pack(require_sm90):
    """A varlen FP8 case: ours runs the packed call (each sequence attends to itself alone), the
    SDPA peer the padded batch."""
    case = Case("e4m3", 128, 3, 300, varlen=True, heads=4)
    inputs = Inputs.make(case)
    cu = inputs.varlen[0].tolist()
    fns = fp8_contenders(case, inputs, ("ours", "sdpa_fa2"))
    assert set(fns) == {"ours", "sdpa_fa2"}
    out = fns["ours"]()
    assert out.shape == inputs.q.shape
    for b in range(case.batch):
        s = slice(cu[b], cu[b + 1])
        ref = attention_reference(inputs.q[None, s], inputs.k[None, s], inputs.v[None, s])[0]
        err = ((out[None, s].float() - ref).norm() / ref.norm()).item()
        assert err < 8e-2, f"sequence {b}: relative error {err}"
