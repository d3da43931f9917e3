"""What the perf gate times for its backward and training-step cases (GPU): each contender's
callable computes the gradients autograd gives for the case's problem, SDPA is a peer exactly
where the case says it can be, and a whole measuring request answers with cycles."""

from __future__ import annotations

import pytest
import torch

import flash_attention as fa
from fa_tools.gate.coverage import bwd_kernel
from fa_tools.gate.worker import backward_configs
from fa_tools.gpu.perfcases import Case, Inputs, measure_case, training_contenders

pytestmark = pytest.mark.gpu

# Small versions of the gate's backward cases: each feature, both dtypes, both kinds.
CASES = [
    Case("bf16", 128, 2, 512, causal=True, kind="bwd"),
    Case("fp16", 64, 2, 512, kv_heads=4, kind="bwd"),
    Case("bf16", 128, 2, 512, window=(128, 0), softcap=30.0, kind="bwd"),
    Case("bf16", 128, 2, 512, causal=True, deterministic=True, kind="bwd"),
    Case("bf16", 128, 2, 512, causal=True, kv_heads=4, kind="fwdbwd"),
]


def _needs_backward_kernel(case: Case) -> None:
    sm90 = torch.cuda.get_device_capability() == (9, 0)  # the Hopper backward's GPU
    if bwd_kernel(case, backward_configs(), sm90) is None:
        pytest.skip(f"this build has no backward kernel for {case.name} "
                    "(FLASH_ATTENTION_BWD_KERNELS=default has them all)")


def _relative_error(got, ref) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_timed_calls_compute_the_autograd_gradients(require_extension, case):
    _needs_backward_kernel(case)
    inputs = Inputs.make(case)
    fns = training_contenders(case, inputs, ("ours", "sdpa_fa2"))
    assert set(fns) == ({"ours"} if case.peer_note() else {"ours", "sdpa_fa2"})
    leaves = [t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    ref = torch.autograd.grad(fa.attention(*leaves, **case.options()), leaves, inputs.dout)
    for name, fn in fns.items():
        got = fn()
        if name != "ours":  # the SDPA peers differentiate the (B, H, S, D) views
            got = tuple(g.transpose(1, 2) for g in got)
        for what, g, r in zip(("dq", "dk", "dv"), got, ref):
            assert g.shape == r.shape, f"{name} {what}"
            # ours: the same kernels (dQ's atomic order aside); SDPA: another rounding
            limit = 1e-3 if name == "ours" else 2e-2
            assert _relative_error(g, r) < limit, f"{name} {what}"
    if case.deterministic:
        first, again = fns["ours"](), fns["ours"]()
        assert all(torch.equal(a, b) for a, b in zip(first, again)), "bitwise reproducible"


def test_a_request_answers_with_cycles_for_each_contender(require_extension):
    case = CASES[0]
    _needs_backward_kernel(case)
    result = measure_case(case, Inputs.make(case), reps=3, warm_ms=5.0)
    for name in ("ours", "sdpa_fa2"):
        assert result[name] > 0 and result[f"{name}_mcycles"] > 0 and result[f"{name}_mhz"] > 0
