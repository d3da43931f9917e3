"""The backward pass on a GPU, by FlashAttention's rule: for each of dq, dk, dv, the max error
against the gradient of the fp32 reference is at most 2x that of the same reference computed
in the inputs' dtype (plus a tiny floor). Over odd (seqlen_q, seqlen_k) pairs, every d_head
variant and ones between, MHA/GQA/MQA, causal, sliding windows, softcap, rows that see no key,
strided layouts and packed inputs; determinism; autograd through flash_attn_func,
torch.compile and opcheck.

FlashAttention's own backward grid (flash_attn's test_flash_attn_output: its (seqlen_q,
seqlen_k) pairs, d_head 32-256 (the multiples of 8 of its list: 59 and 111 are not valid here),
9 query heads over 9/3/1 KV heads, causal, random local windows, softcap 50, fp16/bf16, packed
q/kv, varlen with sequences of length 0 and 1): by default (and in the gate) a covering sample:
every (seqlen_q, seqlen_k) with every d_head, the other options rotating so that each of their
combinations appears; FA_TEST_GRID=full runs the whole cross product (about 5,300 cases)."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_attention as fa
from flash_attention import ops
from flash_attention.interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)
from flash_attention.kernels import Call, bwd_sm80, bwd_sm90
from flash_attention.kernels.bwd_sm80 import Sm80BwdConfig
from flash_attention.reference import attention_reference

from .gpu_support import rand_inputs


def select(dtype: str, d_head: int, softcap: bool, built, hopper: bool = False):
    """The backward kernel the operator picks (in C++) for a fixed-length call: the Hopper
    kind's where it can run one (``hopper``) and one is built, else the sm80 kind's."""
    call = Call(dtype, d_head, softcap=softcap)
    return (bwd_sm90.select(call, built) if hopper else None) or bwd_sm80.select(call, built)

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]

GRAD_FLOOR = 1e-4
SHAPES = [(113, 203), (128, 217), (1023, 1024), (1, 300), (256, 256), (512, 512), (300, 113)]


def reference_grads(q, k, v, dout, upcast, softmax_scale=None, **features):
    """(dq, dk, dv) of the reference: fp32 leaves and math (upcast), or the inputs' dtype."""
    dtype = torch.float32 if upcast else q.dtype
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, _ = attention_reference(*leaves, softmax_scale, upcast=upcast, **features)
    out.backward(dout.to(dtype))
    return [t.grad for t in leaves]


def check_grads(grads, q, k, v, dout, what="", softmax_scale=None, **features):
    ref = reference_grads(q, k, v, dout, True, softmax_scale, **features)
    low = reference_grads(q, k, v, dout, False, softmax_scale, **features)
    for name, g, r, lo in zip(("dq", "dk", "dv"), grads, ref, low):
        assert g.shape == r.shape and g.dtype == q.dtype, f"{what}: {name} shape/dtype"
        assert torch.isfinite(g).all(), f"{what}: {name} has NaN/inf"
        err = (g.float() - r).abs().max().item()
        err_pt = (lo.float() - r).abs().max().item()
        assert err <= 2 * err_pt + GRAD_FLOOR, (
            f"{what}: {name} max error {err:.3e} > 2 x low-precision error {err_pt:.3e}")


def run_backward(q, k, v, dout, deterministic=False, **features):
    """Gradients through autograd of fa.attention."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fa.attention(*leaves, deterministic=deterministic, **features)
    out.backward(dout)
    return [t.grad for t in leaves]


def case(batch, sq, sk, heads, kv_heads, d, dtype, seed=0, layout="bshd", **features):
    torch.manual_seed(seed)
    q, k, v = rand_inputs(batch, sq, sk, heads, kv_heads, d, dtype, layout)
    dout = torch.randn(batch, sq, heads, d, device="cuda", dtype=dtype)
    grads = run_backward(q, k, v, dout, **features)
    check_grads(grads, q, k, v, dout, what=f"{dtype} {(batch, sq, sk, heads, kv_heads, d)} "
                f"{layout} {features}", **features)
    return grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d_head", [64, 128, 256])
@pytest.mark.parametrize("sq, sk", SHAPES)
def test_shapes(require_extension, sq, sk, d_head, causal):
    case(2, sq, sk, 4, 2, d_head, torch.bfloat16, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d_head", [32, 40, 64, 72, 96, 128, 136, 160, 192, 256])
def test_d_heads(require_extension, d_head, dtype):
    case(2, 113, 203, 4, 4, d_head, dtype, causal=d_head % 16 == 0)


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_mqa(require_extension, heads, kv_heads, causal):
    case(2, 257, 200, heads, kv_heads, 128, torch.float16, causal=causal)


@pytest.mark.parametrize("window", [(32, 0), (50, -1), (-1, 17), (0, 0), (64, 64)])
@pytest.mark.parametrize("sq, sk", [(113, 203), (256, 256), (300, 113)])
def test_windows(require_extension, window, sq, sk):
    case(1, sq, sk, 4, 2, 64, torch.bfloat16, window_size=window)


@pytest.mark.parametrize("d_head", [64, 128, 256])
@pytest.mark.parametrize("causal, softcap", [(False, 30.0), (True, 5.0)])
def test_softcap(require_extension, d_head, causal, softcap):
    case(2, 200, 177, 4, 2, d_head, torch.bfloat16, causal=causal, softcap=softcap)


@pytest.mark.parametrize("d_head", [64, 256])
def test_scale_and_layouts(require_extension, d_head):
    """A transposed (batch, heads, seq, d) view and a packed qkv tensor; at d_head 256 on an
    sm_90 GPU the split-d Hopper kernel reads them through its TMA maps in place."""
    case(2, 150, 150, 4, 4, d_head, torch.float16, layout="bhsd", softmax_scale=0.3, causal=True)
    torch.manual_seed(5)
    qkv = torch.randn(2, 190, 3, 4, d_head, device="cuda", dtype=torch.bfloat16,
                      requires_grad=True)
    dout = torch.randn(2, 190, 4, d_head, device="cuda", dtype=torch.bfloat16)
    flash_attn_qkvpacked_func(qkv, causal=True).backward(dout)
    q, k, v = qkv.detach().unbind(2)
    check_grads(qkv.grad.unbind(2), q, k, v, dout, what="qkvpacked", causal=True)


def test_rows_without_keys_get_zero_gradients(require_extension):
    # causal with seqlen_q > seqlen_k: the first 200 rows see no key (out 0, LSE -inf)
    grads = case(1, 300, 100, 2, 2, 64, torch.bfloat16, causal=True)
    assert torch.count_nonzero(grads[0][:, :200]) == 0


# On an sm_90 GPU these run the Hopper kernel (its writer warp adds dQ in turn order; at d_head
# 64 each warpgroup's partial in a fixed order too), elsewhere the sm80 family. The 2048-token
# case has 16 KV blocks adding to every query block at once.
@pytest.mark.parametrize("shape, d_head, features", [
    ((2, 700, 900, 8, 2), 128, {}),
    ((2, 700, 900, 8, 2), 128, {"causal": True}),
    ((2, 700, 900, 8, 2), 64, {}),
    ((2, 700, 900, 8, 2), 64, {"window_size": (300, 50)}),
    ((1, 500, 400, 4, 4), 64, {"causal": True, "softcap": 5.0}),
    ((2, 2048, 2048, 8, 2), 64, {}),
    # The Hopper family's rotated order (no mask, query blocks a multiple of the KV blocks):
    # r = 1, 2 and 8 query blocks per KV block, GQA and MQA; and past half an H100's SMs of KV
    # blocks per head, where the launcher keeps the last-KV-block-first order.
    ((2, 1024, 1024, 8, 2), 128, {}),
    ((2, 2048, 1024, 6, 1), 64, {}),
    ((1, 4096, 1024, 4, 4), 128, {}),
    ((2, 1000, 1000, 8, 2), 128, {}),  # partial last query and KV blocks, rotated
    ((2, 1000, 1000, 4, 4), 64, {}),
    # d_head 256: the Hopper family's split-d kernel (B_c 64) on sm_90, r = 1 and 2 (the sm80
    # family's by name: test_sm80_family_rotated_deterministic_order)
    ((2, 1024, 1024, 4, 2), 256, {}),
    ((1, 2048, 1024, 4, 4), 256, {}),
    ((2, 1000, 1000, 4, 1), 256, {"causal": True}),
    ((1, 16384, 16384, 2, 2), 64, {}),
])
def test_deterministic_is_bitwise_reproducible(require_extension, shape, d_head, features):
    torch.manual_seed(11)
    q, k, v = rand_inputs(*shape, d_head, torch.bfloat16)
    dout = torch.randn_like(q)
    first = run_backward(q, k, v, dout, deterministic=True, **features)
    for _ in range(3):
        again = run_backward(q, k, v, dout, deterministic=True, **features)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    check_grads(first, q, k, v, dout, what=f"deterministic {shape} {d_head} {features}",
                **features)


def _bwd_op(q, k, v, dout, out, lse, kernel="", deterministic=False, causal=False,
            window=(-1, -1), softcap=0.0):
    return torch.ops.flash_attention.bwd.default(dout, q, k, v, out, lse, None, None, None, 0, 0,
                                                 None, causal, *window, softcap, deterministic,
                                                 kernel)


def _main_kernels(*args, **kwargs) -> set[str]:
    """The backward main kernels _bwd_op(*args, **kwargs) launches: 'sm90'
    (flash::sm90::bwd_kernel) and/or 'sm80' (flash::sm80::bwd_kernel), from the CUDA kernel
    names torch.profiler records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _bwd_op(*args, **kwargs)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {family for family in ("sm80", "sm90")
            if any(f"{family}::bwd_kernel" in n for n in names)}


@pytest.mark.parametrize("d_head", [64, 128, 256])
def test_sm80_family_rotated_deterministic_order(require_extension, d_head):
    """The sm80 family's kernel named explicitly (on an H100 it serves varlen; elsewhere
    everything), deterministic with no mask, in the rotated order (r = 1 at d_head 64 and 256, 2
    at 128, GQA): bitwise over repeats and within the rule."""
    from flash_attention.backward import built

    sm80 = select("bf16", d_head, False, built())
    torch.manual_seed(9)
    q, k, v = rand_inputs(2, 1024, 1024, 8, 2, d_head, torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = torch.ops.flash_attention.attention.default(q, k, v, None, None, 0, 0, None,
                                                           False, -1, -1, 0.0, True, "")
    first = _bwd_op(q, k, v, dout, out, lse, sm80.name, deterministic=True)
    for _ in range(2):
        for a, b in zip(first, _bwd_op(q, k, v, dout, out, lse, sm80.name, deterministic=True)):
            assert torch.equal(a, b)
    check_grads(first, q, k, v, dout, what=f"sm80 rotated d_head {d_head}")


# (seqlen_q, seqlen_k, heads, kv_heads, causal, window, deterministic, d_head below the variant)
_SM80_NAMED_CASES = [(113, 203, 4, 2, True, (-1, -1), False, 0),
                     (300, 113, 2, 1, False, (-1, -1), True, 24),
                     (128, 217, 3, 3, False, (40, 7), False, 0),
                     (1, 300, 2, 2, True, (-1, -1), True, 24),
                     (70, 17000, 2, 1, False, (64, 0), False, 0)]  # blocks far off the diagonal


def _sm80_named_call(kernel: str, case: int):
    """_SM80_NAMED_CASES[case] for the sm80-family kernel `kernel` (skipped where the build
    lacks it): the _bwd_op arguments, and a check of a call's gradients (the fp32 reference's
    rule; bitwise the same on a second call when deterministic)."""
    from flash_attention.backward import built

    if kernel not in {c.name for c in built()}:
        pytest.skip(f"{kernel} is not in this build (FLASH_ATTENTION_KERNELS=default)")
    cfg = Sm80BwdConfig.parse(kernel)
    sq, sk, h, hk, causal, window, det, below = _SM80_NAMED_CASES[case]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]
    softcap = 30.0 if cfg.softcap else 0.0
    torch.manual_seed(case)
    q, k, v = rand_inputs(2, sq, sk, h, hk, cfg.d_head - below, dtype)
    dout = torch.randn_like(q)
    out, lse = torch.ops.flash_attention.attention.default(q, k, v, None, None, 0, 0, None,
                                                           causal, *window, softcap, True, "")
    args = (q, k, v, dout, out, lse, kernel, det, causal, window, softcap)

    def check(grads, what: str) -> None:
        if det:
            assert all(torch.equal(a, b) for a, b in zip(grads, _bwd_op(*args)))
        check_grads(grads, q, k, v, dout, what=what, causal=causal, window_size=window,
                    softcap=softcap)
    return args, check


@pytest.mark.parametrize("case", range(len(_SM80_NAMED_CASES)))
@pytest.mark.parametrize("kernel", [c.name for c in bwd_sm80.DEFAULT])
def test_sm80_family_fixed_length_by_name(require_extension, kernel, case):
    """Each sm80-family kernel of the default set named explicitly on fixed-length calls
    (tails, GQA/MQA, causal, a window, deterministic, a zero-padded d_head, its softcap). On an
    sm_90 GPU the Hopper family takes these calls, so a named call is the only way to them
    there, and the kernel reduces dQ in the tile order (DqLayout::kWgmmaTiles) instead of rows."""
    args, check = _sm80_named_call(kernel, case)
    check(_bwd_op(*args), f"{kernel} case {case}")


@pytest.mark.parametrize("order", ["lane", "rows"])
@pytest.mark.parametrize("case", [0, 1, 2])
@pytest.mark.parametrize("kernel", [c.name for c in bwd_sm80.DEFAULT if c.d_head in (64, 128)])
def test_sm80_family_dq_orders(require_extension, monkeypatch, kernel, case, order):
    """The sm80 family's other dQ orders on fixed-length calls, forced on any GPU
    (FLASH_ATTENTION_SM80_DQ_ORDER): "lane", the lane-major tile order sm_80-89 run
    (DqLayout::kLaneTiles, four scalar reductions per tile and thread), and "rows", the order of
    varlen calls. They must pass the reference's rule, give the tile order's dK and dV bitwise
    and its dQ up to the order of the fp32 additions, and be bitwise the same run to run when
    deterministic; a value outside the three is refused."""
    args, check = _sm80_named_call(kernel, case)
    monkeypatch.setenv("FLASH_ATTENTION_SM80_DQ_ORDER", order)
    grads = _bwd_op(*args)
    check(grads, f"{kernel} case {case}, dQ order {order}")
    monkeypatch.setenv("FLASH_ATTENTION_SM80_DQ_ORDER", "tiles")
    ref = _bwd_op(*args)
    assert torch.equal(grads[1], ref[1]) and torch.equal(grads[2], ref[2])  # dK, dV: same code
    torch.testing.assert_close(grads[0], ref[0], atol=2e-2, rtol=2e-2)
    monkeypatch.setenv("FLASH_ATTENTION_SM80_DQ_ORDER", "diagonal")
    with pytest.raises(ValueError, match="FLASH_ATTENTION_SM80_DQ_ORDER must be rows, tiles"):
        _bwd_op(*args)


@pytest.mark.parametrize("d_head", [64, 128, 256])
def test_the_operator_routes_the_backward_by_family(require_extension, d_head):
    """On an sm_90 GPU with the Hopper backward built, a fixed-length call runs the Hopper
    kernel, deterministic or not, and gives what the kernel named explicitly gives (bitwise:
    dK and dV always, dQ too when deterministic); K and V expanded over their heads (stride 0,
    not TMA-addressable) run on the sm80 family. The kernels run are read from the profiler."""
    from flash_attention.backward import built

    configs = built()
    hopper = select("bf16", d_head, False, configs, hopper=True)
    sm80 = select("bf16", d_head, False, configs)
    if torch.cuda.get_device_capability() != (9, 0) or hopper is None or hopper == sm80:
        pytest.skip("needs an sm_90 GPU and a build with the Hopper backward (default set)")
    torch.manual_seed(3)
    q, k, v = rand_inputs(2, 300, 500, 4, 2, d_head, torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = torch.ops.flash_attention.attention.default(q, k, v, None, None, 0, 0, None,
                                                           True, -1, -1, 0.0, True, "")
    args = (q, k, v, dout, out, lse)
    for det in (False, True):
        assert _main_kernels(*args, deterministic=det, causal=True) == {"sm90"}
        assert _main_kernels(*args, sm80.name, deterministic=det, causal=True) == {"sm80"}
        picked = _bwd_op(*args, deterministic=det, causal=True)
        named = _bwd_op(*args, hopper.name, deterministic=det, causal=True)
        for a, b in zip(picked[0 if det else 1:], named[0 if det else 1:]):
            assert torch.equal(a, b)
    kx, vx = (t[:, :, :1].expand(-1, -1, 2, -1) for t in (k, v))
    out_x, lse_x = torch.ops.flash_attention.attention.default(q, kx, vx, None, None, 0, 0, None,
                                                               True, -1, -1, 0.0, True, "")
    assert _main_kernels(q, kx, vx, dout, out_x, lse_x, causal=True) == {"sm80"}


def test_backward_debug_log_names_the_kernel_and_why(require_extension, caplog):
    """At debug level an eager backward logs the kernel it runs (flash_attention::bwd_explain,
    as the forward logs its choice), and the reason when the Hopper family cannot run the call:
    on an sm_90 GPU with the Hopper backward built a fixed-length call names the Hopper kernel
    and a varlen one the Hopper varlen kernel (flag j), or the sm80 family's where the build has
    none."""
    import logging

    from flash_attention.backward import built

    hopper = select("bf16", 128, False, built(), hopper=True)
    sm80 = select("bf16", 128, False, built())
    on_sm90 = (torch.cuda.get_device_capability() == (9, 0) and hopper is not None
               and hopper != sm80)
    torch.manual_seed(1)
    q, k, v = rand_inputs(1, 200, 200, 2, 2, 128, torch.bfloat16)

    def logged(fn) -> str:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="flash_attention.backward"):
            fn()
            torch.cuda.synchronize()
        (msg,) = [r.getMessage() for r in caplog.records if r.name == "flash_attention.backward"]
        return msg

    fixed = logged(lambda: run_backward(q, k, v, torch.randn_like(q)))
    if on_sm90:
        assert fixed.endswith(f": {hopper.name}"), fixed
    else:
        assert f"{sm80.name} (not the Hopper family: " in fixed, fixed
    cu = torch.tensor([0, 70, 200], dtype=torch.int32, device="cuda")
    qv, kv, vv = (t[0].detach().requires_grad_() for t in (q, k, v))
    varlen = logged(lambda: fa.attention_varlen(qv, kv, vv, cu, cu, 130, 130).sum().backward())
    hopper_varlen = bwd_sm90.select_varlen(Call("bf16", 128), built())
    if on_sm90 and hopper_varlen is not None:
        assert varlen.endswith(f": {hopper_varlen.name}"), varlen
    else:
        assert f"{sm80.name} (not the Hopper family: " in varlen, varlen
        if on_sm90:
            assert "varlen batches run on the sm80-family kernels" in varlen, varlen


@pytest.mark.parametrize("d_head", [64, 128, 256])
@pytest.mark.parametrize("shape, features", [
    ((3, 1000, 1111, 30, 30), {}),
    ((3, 1000, 1111, 30, 6), {"softcap": 30.0}),
    ((3, 1000, 1111, 30, 10), {"causal": True}),
    ((4, 128, 4000, 32, 8), {"window_size": (64, 0)}),
    ((2, 700, 3000, 24, 24), {"window_size": (200, 100), "deterministic": True}),
])
def test_hopper_backward_many_tiles(require_extension, d_head, shape, features):
    """Several times more tiles (KV block, KV head, batch) than an H100 has SMs, some with no
    query block (a window far from the queries), with GQA, softcap, causal and the
    deterministic order (bitwise over repeats; its turns cross many waves of CTAs). Checked by
    the rule; the Hopper kernel must be the one that ran. (The shapes once tested a persistent
    grid's tile walk: docs/results/2026-11-27-h200-hopper-backward-persistent-grid.md.)"""
    from flash_attention.backward import built

    if (torch.cuda.get_device_capability() != (9, 0)
            or select("bf16", d_head, False, built(), hopper=True) is None):
        pytest.skip("needs an sm_90 GPU and a build with the Hopper backward (default set)")
    torch.manual_seed(5)
    q, k, v = rand_inputs(*shape, d_head, torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = torch.ops.flash_attention.attention.default(q, k, v, None, None, 0, 0, None,
                                                           True, -1, -1, 0.0, True, "")
    assert _main_kernels(q, k, v, dout, out, lse) == {"sm90"}
    grads = run_backward(q, k, v, dout, **features)
    check_grads(grads, q, k, v, dout, what=f"many tiles {shape} {d_head} {features}",
                **{key: val for key, val in features.items() if key != "deterministic"})
    if features.get("deterministic"):
        for _ in range(2):
            for a, b in zip(grads, run_backward(q, k, v, dout, **features)):
                assert torch.equal(a, b)


def test_flash_attn_func_training_step(require_extension):
    torch.manual_seed(2)
    q, k, v = rand_inputs(2, 333, 333, 8, 4, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, causal=True, window_size=(100, 0))
    out.backward(dout)
    check_grads([t.grad for t in leaves], q, k, v, dout, what="flash_attn_func", causal=True,
                window_size=(100, 0))


def test_refusals(require_extension):
    q, k, v = (t.requires_grad_() for t in rand_inputs(1, 64, 64, 2, 2, 64, torch.bfloat16))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(2, device="cuda"))
    with pytest.raises(RuntimeError, match="no backward for a call with out="):
        fa.attention(q, k, v, out=torch.empty_like(q))


def test_compile_fullgraph_training_step_matches_eager(require_extension):
    torch._dynamo.reset()

    def step(q, k, v):
        out = flash_attn_func(q, k, v, causal=True)
        return (out.float() ** 2).sum()

    torch.manual_seed(4)
    q, k, v = rand_inputs(2, 300, 300, 8, 2, 128, torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    step(*leaves).backward()
    eager = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    torch.compile(step, fullgraph=True)(*leaves).backward()
    for a, b in zip(eager, (t.grad for t in leaves)):
        # the compiled loss may round differently: the same bound as the accuracy rule
        torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("features", [(-1, -1, 0.0), (-1, 0, 0.0), (64, 0, 20.0)])
def test_opcheck(require_extension, features):
    left, right, softcap = features
    torch.manual_seed(6)
    q, k, v = (t.requires_grad_() for t in rand_inputs(1, 130, 200, 4, 2, 128, torch.bfloat16))
    torch.library.opcheck(torch.ops.flash_attention.attention.default,
                          (q, k, v, None, None, 0, 0, 0.088, False, left, right, softcap, True,
                           ""))
    dout = torch.randn_like(q)
    out, lse = torch.ops.flash_attention.attention.default(
        q.detach(), k.detach(), v.detach(), None, None, 0, 0, 0.088, False, left, right, softcap,
        True, "")
    torch.library.opcheck(torch.ops.flash_attention.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, None, None, None,
                           0, 0, 0.088, False, left, right, softcap, False, ""))


def test_lse_gradient(require_extension):
    """A loss that uses the LSE too (return_lse=True): dS gains P * dLSE."""
    torch.manual_seed(8)
    q, k, v = rand_inputs(2, 150, 170, 4, 2, 64, torch.bfloat16)
    dout = torch.randn_like(q)
    dlse = torch.randn(2, 4, 150, device="cuda")

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
        return [t.grad for t in leaves]

    ours = grads(lambda *t: fa.attention(*t, return_lse=True), torch.bfloat16)
    ref = grads(lambda *t: attention_reference(*t), torch.float32)
    low = grads(lambda *t: attention_reference(*t, upcast=False), torch.bfloat16)
    for name, g, r, lo in zip(("dq", "dk", "dv"), ours, ref, low):
        err, err_pt = (g.float() - r).abs().max().item(), (lo.float() - r).abs().max().item()
        assert err <= 2 * err_pt + GRAD_FLOOR, f"{name}: {err:.3e} > 2 x {err_pt:.3e}"


def test_backward_memory_is_linear_in_seqlen(require_extension):
    """Forward + backward of 8192 x 8192 keeps nothing of size seqlen^2 (one head's fp32 scores
    alone would be 256 MB)."""
    q, k, v = (t.requires_grad_() for t in rand_inputs(1, 8192, 8192, 2, 2, 64,
                                                        torch.bfloat16))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fa.attention(q, k, v, causal=True).backward(dout)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    inputs = 4 * q.numel() * q.element_size()  # out, dq, dk, dv are each the size of q
    assert extra < 3 * inputs + (16 << 20), f"peak {extra >> 20} MB over the inputs"


def test_cuda_graph_captures_a_training_step(require_extension):
    torch.manual_seed(9)
    q, k, v = rand_inputs(2, 300, 300, 4, 2, 64, torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn_like(q)

    def step():
        fa.attention(*leaves, causal=True).backward(dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        for _ in range(2):
            step()
            for t in leaves:
                t.grad = None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    grads = [t.grad for t in leaves]
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            for t in (*leaves, dout):
                t.normal_()
        graph.replay()
        torch.cuda.synchronize()
        fresh = run_backward(*(t.detach() for t in leaves), dout, causal=True)
        for a, b in zip(grads, fresh):
            assert torch.equal(a, b) or (a.float() - b.float()).abs().max() < 1e-2
        check_grads(grads, *(t.detach() for t in leaves), dout, what="graph replay",
                    causal=True)


def varlen_case(lens_q, lens_k, heads, kv_heads, d, dtype, seed=12, **features):
    """Packed sequences: each sequence's gradients against the reference of that sequence
    alone; sequences without keys give dq 0, without queries dk and dv 0."""
    torch.manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    q = torch.randn(sum(lens_q), heads, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k), kv_heads, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k), kv_heads, d, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn_like(q)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **features)
    out.backward(dout)
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        sq, sk = slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(),
                                                                   cu_k[b + 1].item())
        grads = [q.grad[sq], k.grad[sk], v.grad[sk]]
        if lq == 0 or lk == 0:
            assert all(torch.count_nonzero(g) == 0 for g in grads), f"sequence {b}"
            continue
        check_grads([g[None] for g in grads], q.detach()[sq][None], k.detach()[sk][None],
                    v.detach()[sk][None], dout[sq][None],
                    what=f"varlen sequence {b} ({lq}, {lk}) {features}", **features)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (40, 7))])
def test_varlen(require_extension, causal, window):
    """Packed sequences of lengths 0 and 1 among others."""
    varlen_case([0, 1, 130, 64, 257, 3], [5, 1, 200, 0, 257, 1], 4, 2, 64, torch.bfloat16,
                causal=causal, window_size=window)


def test_varlen_backward_checks_cu_seqlens_values(require_extension):
    """A direct call of the backward op with a max_seqlen below a sequence's length is refused
    before any launch (it would leave that sequence's tail without gradients), and the process
    stays healthy."""
    torch.manual_seed(13)
    cu = torch.tensor([0, 100, 130], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(130, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = torch.ops.flash_attention.attention.default(
        q, k, v, cu, cu, 100, 100, None, False, -1, -1, 0.0, True, "")
    dout = torch.randn_like(q)
    with pytest.raises(ValueError, match="longer than max_seqlen_q"):
        torch.ops.flash_attention.bwd.default(dout, q, k, v, out, lse, None, cu, cu, 64, 100,
                                              None, False, -1, -1, 0.0, False, "")
    torch.cuda.synchronize()  # the context is still usable
    dq, _, _ = torch.ops.flash_attention.bwd.default(dout, q, k, v, out, lse, None, cu, cu, 100,
                                                     100, None, False, -1, -1, 0.0, False, "")
    assert torch.isfinite(dq).all()


# ---- deterministic varlen ----------------------------------------------------------------------


def varlen_grads(lens_q, lens_k, heads, kv_heads, d, deterministic, runs=1, max_slack=0,
                 **features):
    """Inputs of a packed batch of these sequence lengths (seeded), and the list of (dq, dk, dv)
    of `runs` forward + backward passes of flash_attn_varlen_func on them (fresh leaves each
    time); max_seqlen_q/k are the longest lengths plus max_slack."""
    torch.manual_seed(14)
    dtype = torch.bfloat16
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                               device="cuda") for lens in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), heads, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), kv_heads, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), kv_heads, d, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    all_grads = []
    for _ in range(runs):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q) + max_slack,
                                     max(lens_k) + max_slack, deterministic=deterministic,
                                     **features)
        out.backward(dout)
        all_grads.append([t.grad for t in leaves])
    return (q, k, v, dout, cu_q, cu_k), all_grads


def check_varlen_sequences(grads, inputs, what, **features):
    """Each sequence's gradients against the reference of that sequence alone (the rule of
    check_grads); sequences without keys or queries get 0."""
    q, k, v, dout, cu_q, cu_k = inputs
    for b in range(cu_q.numel() - 1):
        sq = slice(cu_q[b].item(), cu_q[b + 1].item())
        sk = slice(cu_k[b].item(), cu_k[b + 1].item())
        seq_grads = [grads[0][sq], grads[1][sk], grads[2][sk]]
        if sq.stop == sq.start or sk.stop == sk.start:
            assert all(torch.count_nonzero(g) == 0 for g in seq_grads), f"{what}: sequence {b}"
            continue
        check_grads([g[None] for g in seq_grads], q[sq][None], k[sk][None], v[sk][None],
                    dout[sq][None], what=f"{what}: sequence {b}", **features)


@pytest.mark.parametrize("d, max_slack, features", [
    (128, 0, {}),
    (128, 0, {"causal": True}),
    (64, 70, {"window_size": (40, 7)}),  # B_r 128; max_seqlen_q/k above the longest sequence
    (128, 0, {"causal": True, "softcap": 20.0}),
])
def test_varlen_deterministic_is_bitwise_reproducible(require_extension, d, max_slack, features):
    """flash_attn_varlen_func(deterministic=True): the dQ order counter is per (sequence, head,
    query block of max_seqlen_q), so sequences of every length, several query and KV blocks
    each, give bitwise-equal gradients over 4 runs; they, and the atomic-order gradients of the
    same call, meet the accuracy rule for every sequence."""
    lens_q, lens_k = [0, 1, 130, 64, 700, 3, 333], [5, 1, 200, 0, 900, 1, 333]
    inputs, runs = varlen_grads(lens_q, lens_k, 8, 2, d, deterministic=True, runs=4,
                                max_slack=max_slack, **features)
    first = runs[0]
    for again in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"
    check_varlen_sequences(first, inputs, "deterministic", **features)
    _, (atomic,) = varlen_grads(lens_q, lens_k, 8, 2, d, deterministic=False,
                                max_slack=max_slack, **features)
    check_varlen_sequences(atomic, inputs, "atomic order", **features)


# A sequence longer than max_seqlen_q/k: cu_seqlens valid when checked (and when a CUDA graph
# captured the backward), then rewritten in place. Lengths (q, k) per sequence:
LONG_LENS = ([130, 200, 70], [150, 90, 260])  # valid: max_seqlen_q 200, max_seqlen_k 260
LONG_CU = ([0, 330, 350, 400], [0, 100, 500, 500])  # the rewrite: 330 > 200 queries, 400 > 260 keys
# What the backward kernel makes of the rewrite (each sequence cut to max_seqlen_q/k): the rows
# of q and of k/v that stay, and cu_seqlens of those rows alone.
LONG_KEPT = ([*range(0, 200), *range(330, 400)], [*range(0, 100), *range(100, 360)])
LONG_KEPT_CU = ([0, 200, 220, 270], [0, 100, 360, 360])
GRAPH_TIMEOUT_S = 300


def long_sequence_case(causal):
    """A varlen batch of LONG_LENS (bf16, d_head 128, GQA 4/2): its cu_seqlens, the inputs of
    its backward (dout, q, k, v, out and lse of its forward) and bwd(cu_q, cu_k), the
    deterministic backward operator on them with max_seqlen_q/k of LONG_LENS."""
    torch.manual_seed(15)
    ops.require()
    lens_q, lens_k = LONG_LENS
    max_q, max_k = max(lens_q), max(lens_k)
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32,
                               device="cuda") for lens in LONG_LENS)
    q = torch.randn(sum(lens_q), 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = torch.ops.flash_attention.attention.default(
        q, k, v, cu_q, cu_k, max_q, max_k, None, causal, -1, -1, 0.0, True, "")

    def bwd(cu_q, cu_k, dout=dout, q=q, k=k, v=v, out=out, lse=lse):
        return torch.ops.flash_attention.bwd.default(dout, q, k, v, out, lse, None, cu_q, cu_k,
                                                     max_q, max_k, None, causal, -1, -1, 0.0,
                                                     True, "")

    return cu_q, cu_k, (dout, q, k, v, out, lse), bwd


def graph_replay_past_max_seqlen(causal):
    """Run in a child process by the test below, so that a hang dies with the process: capture
    the deterministic varlen backward in a CUDA graph, replay it with valid cu_seqlens (equal
    to an eager call), rewrite cu_seqlens in place so that a sequence is longer than
    max_seqlen_q and another than max_seqlen_k, replay again. The replay must return with
    finite gradients, those of the rows the kernel keeps (each sequence cut to max_seqlen_q/k)
    bitwise those of an eager call on these rows alone, and dq of the rows cut off 0."""
    cu_q, cu_k, (dout, q, k, v, out, lse), bwd = long_sequence_case(causal)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (cu_seqlens checked there)
        for _ in range(2):
            bwd(cu_q, cu_k)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # cu_seqlens cannot be read here: not checked
        grads = bwd(cu_q, cu_k)
    graph.replay()
    for name, a, b in zip(("dq", "dk", "dv"), grads, bwd(cu_q, cu_k)):
        assert torch.equal(a, b), f"valid replay: {name} differs from an eager call"

    for cu, values in zip((cu_q, cu_k), LONG_CU):
        cu.copy_(torch.tensor(values, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()  # a hang stops here (the parent kills the process)
    # dk and dv of the keys cut off are not written: they keep the valid replay's values.
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert torch.isfinite(g).all(), f"{name} has NaN/inf after the rewritten replay"
    kept_q, kept_k = (torch.tensor(rows, device="cuda") for rows in LONG_KEPT)
    cut_cu_q, cut_cu_k = (torch.tensor(values, dtype=torch.int32, device="cuda")
                          for values in LONG_KEPT_CU)
    cut = bwd(cut_cu_q, cut_cu_k, dout=dout[kept_q], q=q[kept_q], k=k[kept_k], v=v[kept_k],
              out=out[kept_q], lse=lse[:, kept_q].contiguous())
    for name, g, kept, c in zip(("dq", "dk", "dv"), grads, (kept_q, kept_k, kept_k), cut):
        assert torch.equal(g[kept], c), f"{name} of the kept rows differs from the cut call"
    dropped_q = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    dropped_q[kept_q] = False
    assert torch.count_nonzero(grads[0][dropped_q]) == 0, "dq of the rows cut off is not 0"


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_deterministic_graph_replay_past_max_seqlen_returns(require_extension, causal):
    """Deterministic varlen backward under CUDA graph capture, whose cu_seqlens the host cannot
    check: a replay after cu_seqlens were rewritten so that sequences exceed max_seqlen_q/k
    returns (the kernel cuts each sequence to them, so that no turn waits for a KV block the
    grid lacks and no turn counter is indexed past its head) with finite gradients, those of
    the kept rows as an eager call on them alone gives. Run in a child process with a timeout:
    a hung kernel would otherwise hold the GPU for the rest of the session."""
    src = str(Path(ops.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [src, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    code = (f"from tests.test_gpu_backward import graph_replay_past_max_seqlen; "
            f"graph_replay_past_max_seqlen(causal={causal})")
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=GRAPH_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired as exc:  # its output is bytes whatever text= says
        output = b"".join(o for o in (exc.stdout, exc.stderr) if isinstance(o, bytes))
        pytest.fail(f"the replay did not return within {GRAPH_TIMEOUT_S} s (a hang?): "
                    f"{output.decode(errors='replace')}")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_varlen_backward_refuses_cu_seqlens_rewritten_past_max_seqlen(require_extension):
    """Outside capture the same rewrite is refused before any launch with a clear error: the
    operator checked cu_seqlens on an earlier call and cached that, but an in-place write bumps
    the tensor's version, so it reads the values again (binding/validation.h,
    check_cu_seqlens_values). The process stays healthy."""
    cu_q, cu_k, _, bwd = long_sequence_case(causal=False)
    bwd(cu_q, cu_k)  # valid: checked and cached
    valid_q, valid_k = cu_q.clone(), cu_k.clone()
    cu_q.copy_(torch.tensor(LONG_CU[0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"a sequence of 330 tokens is longer than "
                                         r"max_seqlen_q = 200"):
        bwd(cu_q, cu_k)
    cu_q.copy_(valid_q)
    cu_k.copy_(torch.tensor(LONG_CU[1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"a sequence of 400 tokens is longer than "
                                         r"max_seqlen_k = 260"):
        bwd(cu_q, cu_k)
    cu_k.copy_(valid_k)
    dq, dk, dv = bwd(cu_q, cu_k)
    torch.cuda.synchronize()  # the context is still usable
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


# ---- FlashAttention's backward grid -----------------------------------------------------------

FULL_GRID = os.environ.get("FA_TEST_GRID") == "full"
FA_SHAPES = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
             (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048), (1, 239)]
FA_D_HEADS = [32, 40, 64, 80, 96, 128, 160, 192, 224, 256]
FA_HEADS = [(9, 9), (9, 3), (9, 1)]  # MHA, GQA, MQA
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (query heads, kv heads), causal, local window, softcap, dtype
FA_OPTIONS = list(itertools.product(FA_HEADS, (False, True), (False, True), (0.0, 50.0),
                                    sorted(DTYPES)))


def rotate(cases, options):
    """Every case with every option (FA_TEST_GRID=full), or each case with one option, the
    option advancing by 7 (coprime with the option count) from one case to the next, so that
    consecutive cases differ in every option and every option comes round."""
    if FULL_GRID:
        return [(*case, *option) for case in cases for option in options]
    return [(*case, *options[(7 * i) % len(options)]) for i, case in enumerate(cases)]


def features_of(causal, local, softcap, seqlen_k, seed):
    """FlashAttention's local windows: (left, right) random in [0, seqlen_k)."""
    features = {"causal": causal, "softcap": softcap}
    if local:
        rng = random.Random(seed)
        features["window_size"] = (rng.randrange(seqlen_k), rng.randrange(seqlen_k))
    return features


def fa_case_id(case):
    (sq, sk), d, (h, hk), causal, local, softcap, dtype = case
    return (f"{sq}x{sk}-d{d}-h{h}k{hk}{'-causal' if causal else ''}{'-local' if local else ''}"
            f"{'-softcap' if softcap else ''}-{dtype}")


FA_GRID = rotate([(shape, d) for d in FA_D_HEADS for shape in FA_SHAPES], FA_OPTIONS)


@pytest.mark.parametrize("grid_case", FA_GRID, ids=fa_case_id)
def test_fa_grid(require_extension, grid_case):
    (sq, sk), d, (heads, kv_heads), causal, local, softcap, dtype = grid_case
    batch = 1 if sq * sk >= 1024 * 1024 else 2
    case_features = features_of(causal, local, softcap, sk, seed=sq * 7919 + sk * 31 + d)
    case(batch, sq, sk, heads, kv_heads, d, DTYPES[dtype], **case_features)


FA_PACKED = rotate([(kind, d) for kind in ("qkv", "kv") for d in FA_D_HEADS],
                   list(itertools.product((False, True), (0.0, 50.0), sorted(DTYPES))))


@pytest.mark.parametrize("kind, d, causal, softcap, dtype", FA_PACKED)
def test_fa_grid_packed(require_extension, kind, d, causal, softcap, dtype):
    """flash_attn_qkvpacked_func (MHA, seqlen_q = seqlen_k) and flash_attn_kvpacked_func
    (GQA, seqlen_q != seqlen_k): gradients of the packed tensors are those of q, k, v."""
    torch.manual_seed(d)
    dt = DTYPES[dtype]
    if kind == "qkv":
        packed = torch.randn(2, 239, 3, 6, d, device="cuda", dtype=dt, requires_grad=True)
        dout = torch.randn(2, 239, 6, d, device="cuda", dtype=dt)
        flash_attn_qkvpacked_func(packed, causal=causal, softcap=softcap).backward(dout)
        q, k, v = packed.detach().unbind(2)
        grads = packed.grad.unbind(2)
    else:
        q = torch.randn(2, 113, 6, d, device="cuda", dtype=dt, requires_grad=True)
        packed = torch.randn(2, 203, 2, 2, d, device="cuda", dtype=dt, requires_grad=True)
        dout = torch.randn_like(q)
        flash_attn_kvpacked_func(q, packed, causal=causal, softcap=softcap).backward(dout)
        k, v = packed.detach().unbind(2)
        grads = (q.grad, *packed.grad.unbind(2))
        q = q.detach()
    check_grads(grads, q, k, v, dout, what=f"{kind}packed d{d}", causal=causal,
                softcap=softcap)


def fa_varlen_lengths(seed, max_len, batch=7):
    """Random sequence lengths in [0, max_len] with one sequence of length 0 and one of 1 on
    each side (query and key lengths drawn apart, as FlashAttention's varlen tests do)."""
    rng = random.Random(seed)
    lens_q = [rng.randint(0, max_len) for _ in range(batch)]
    lens_k = [rng.randint(0, max_len) for _ in range(batch)]
    for lens in (lens_q, lens_k):
        zero, one = rng.sample(range(batch), 2)
        lens[zero], lens[one] = 0, 1
    return lens_q, lens_k


FA_VARLEN = rotate([(d, max_len) for d in FA_D_HEADS for max_len in (128, 517)], FA_OPTIONS)


def varlen_case_id(case):
    d, max_len, (h, hk), causal, local, softcap, dtype = case
    return (f"d{d}-max{max_len}-h{h}k{hk}{'-causal' if causal else ''}"
            f"{'-local' if local else ''}{'-softcap' if softcap else ''}-{dtype}")


@pytest.mark.parametrize("grid_case", FA_VARLEN, ids=varlen_case_id)
def test_fa_grid_varlen(require_extension, grid_case):
    d, max_len, (heads, kv_heads), causal, local, softcap, dtype = grid_case
    lens_q, lens_k = fa_varlen_lengths(d * 1009 + max_len, max_len)
    case_features = features_of(causal, local, softcap, max(lens_k), seed=d + max_len)
    varlen_case(lens_q, lens_k, heads, kv_heads, d, DTYPES[dtype], **case_features)
