"""What the perf gate times for its backward and training-step cases (GPU): each contender's
callable computes the gradients autograd gives for the case's problem (a varlen case's peers:
its tokens padded to the longest sequence), SDPA is a peer exactly where the case says it can
be, and a whole measuring request answers with cycles."""

from __future__ import annotations

import pytest
import torch

import flash_attention as fa
from fa_tools.gate.coverage import bwd_kernel
from fa_tools.gate.worker import backward_configs
from fa_tools.gpu.perfcases import Case, Inputs, measure_case, training_contenders

pytestmark = pytest.mark.gpu

# Small versions of the gate's backward cases: each feature, both dtypes, both kinds, varlen
# batches (3 sequences of 128-512 tokens) with and without a peer.
CASES = [
    Case("bf16", 128, 2, 512, causal=True, kind="bwd"),
    Case("fp16", 64, 2, 512, kv_heads=4, kind="bwd"),
    Case("bf16", 128, 2, 512, window=(128, 0), softcap=30.0, kind="bwd"),
    Case("bf16", 128, 2, 512, causal=True, deterministic=True, kind="bwd"),
    Case("bf16", 128, 3, 512, causal=True, varlen=True, kind="bwd"),
    Case("fp16", 64, 3, 512, window=(128, 0), softcap=50.0, varlen=True, kind="bwd"),
    Case("bf16", 128, 2, 512, causal=True, kv_heads=4, kind="fwdbwd"),
]


def _needs_backward_kernel(case: Case) -> None:
    sm90 = torch.cuda.get_device_capability() == (9, 0)  # the Hopper backward's GPU
    if bwd_kernel(case, backward_configs(), sm90) is None:
        pytest.skip(f"this build has no backward kernel for {case.name} "
                    "(FLASH_ATTENTION_KERNELS=default has them all)")


def _relative_error(got, ref) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


def _autograd_gradients(case: Case, inputs: Inputs, peer: bool = False) -> tuple:
    """The gradients autograd gives for the problem ours times, or (peer) the one the SDPA
    peers time: for a varlen case attention_varlen on the packed batch, and for its peers
    attention() on the same tokens padded to the longest sequence, with the padded dout."""
    tensors, dout, fn = (inputs.q, inputs.k, inputs.v), inputs.dout, fa.attention
    if case.varlen and peer:
        tensors, dout = inputs.varlen[2], inputs.dout_padded
    elif case.varlen:
        cu, max_len, _ = inputs.varlen

        def fn(q, k, v, **opts):
            return fa.attention_varlen(q, k, v, cu, cu, max_len, max_len, **opts)
    leaves = [t.detach().requires_grad_() for t in tensors]
    return torch.autograd.grad(fn(*leaves, **case.options()), leaves, dout)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_timed_calls_compute_the_autograd_gradients(require_extension, case):
    _needs_backward_kernel(case)
    inputs = Inputs.make(case)
    fns = training_contenders(case, inputs, ("ours", "sdpa_fa2"))
    assert set(fns) == ({"ours"} if case.peer_note() else {"ours", "sdpa_fa2"})
    for name, fn in fns.items():
        got, ref = fn(), _autograd_gradients(case, inputs, peer=name != "ours")
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


@pytest.mark.parametrize("case", [c for c in CASES if not c.peer_note() and c.kind == "bwd"],
                         ids=lambda c: c.name)
def test_a_request_answers_with_cycles_for_each_contender(require_extension, case):
    _needs_backward_kernel(case)
    result = measure_case(case, Inputs.make(case), reps=3, warm_ms=5.0)
    for name in ("ours", "sdpa_fa2"):
        assert result[name] > 0 and result[f"{name}_mcycles"] > 0 and result[f"{name}_mhz"] > 0
