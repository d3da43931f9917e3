"""The Hopper varlen kernels (fwd_sm90 and bwd_sm90 flag j) on an sm_90 GPU: every built one by
name over packs with empty, length-1 and long sequences, tails of every size and many tiles per
CTA; dispatch runs them for varlen calls; values past a sequence's end in the packed tensors
(even inf and NaN) never reach another sequence; views as people pass them."""

from __future__ import annotations

import zlib

import pytest
import torch

import flash_attention as fa
from flash_attention import api
from flash_attention.kernels import Call, bwd_sm80, bwd_sm90, fwd_sm90

from .gpu_support import check_against_reference
from .test_gpu_backward import GRAD_FLOOR, check_grads, reference_grads
from .test_gpu_varlen import check_per_sequence, cu_seqlens, packed

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def varlen_configs():
    if not fa.is_built():
        return []
    return [c for c in fa.available_configs()  # the FP8 ones: tests/test_gpu_fp8.py
            if isinstance(c, fwd_sm90.Config) and c.varlen and c.dtype in DTYPES]


VARLEN_CONFIGS = varlen_configs()


def run_kernel(cfg, q, k, v, cu_q, cu_k, lq, lk, causal=False, window=(-1, -1), softcap=0.0):
    """The operator with a kernel named: out and lse."""
    return torch.ops.flash_attention.attention.default(
        q, k, v, cu_q, cu_k, max(lq), max(lk), None, causal, window[0], window[1], softcap,
        True, cfg.name)


# (lengths_q, lengths_k): every tail (B_r, B_c in 64..192), empty and one-token sequences, Sq !=
# Sk per sequence; and a pack of 40 sequences (many tiles per CTA, uneven lengths).
PACKS = {
    "tails": ([1, 0, 63, 65, 127, 129, 191, 193, 300], [1, 5, 63, 65, 127, 129, 191, 0, 301]),
    "unequal": ([1, 300, 77, 0, 128, 513], [200, 300, 13, 9, 0, 1000]),
    "many": ([(37 * i) % 700 + 1 for i in range(40)], [(53 * i) % 900 + 1 for i in range(40)]),
}
# (causal, window) of the masked kernels
MASKS = [(True, (-1, -1)), (False, (64, 17)), (True, (100, -1))]


def seed_of(*parts) -> int:
    """A seed from a case's parameters, the same in every process (hash() of a str is not)."""
    return zlib.crc32(repr(parts).encode())


def options(cfg):
    opts = [(causal, window) for causal, window in MASKS] if cfg.mask else [(False, (-1, -1))]
    return [(c, w, 1.5 if cfg.softcap else 0.0) for c, w in opts]


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("cfg", VARLEN_CONFIGS, ids=str)
def test_hopper_varlen_kernel_matches_reference(require_sm90, cfg, pack):
    lq, lk = PACKS[pack]
    d_head = cfg.d_head if cfg.d_head != 128 else 96  # d_head 96 runs the d128 kernels
    for causal, window, softcap in options(cfg):
        torch.manual_seed(seed_of(cfg, pack, causal, window))
        q, k, v, cu_q, cu_k = packed(lq, lk, 6, 2, d_head, DTYPES[cfg.dtype])
        out, lse = run_kernel(cfg, q, k, v, cu_q, cu_k, lq, lk, causal, window, softcap)
        features = {"causal": causal, "window_size": window, "softcap": softcap}
        check_per_sequence(out, lse, q, k, v, lq, lk, f"{cfg} {pack} {features}", **features)
        again, _ = run_kernel(cfg, q, k, v, cu_q, cu_k, lq, lk, causal, window, softcap)
        assert torch.equal(again, out), f"{cfg} {pack}: a second run differs (race?)"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d_head", [64, 128, 256])
@pytest.mark.parametrize("features", [{}, {"causal": True}, {"softcap": 2.0},
                                      {"causal": True, "softcap": 2.0}],
                         ids=lambda f: "-".join(f) or "plain")
def test_dispatch_runs_the_hopper_varlen_kernel(require_sm90, dtype, d_head, features):
    lq = [700, 1, 0, 260, 129]
    q, k, v, cu_q, cu_k = packed(lq, lq, 4, 2, d_head, DTYPES[dtype])
    ran = api.explain_varlen(q, k, v, max(lq), max(lq), **features)
    assert ran.startswith("fwd_sm90_") and fwd_sm90.parse(ran.split()[0]).varlen, ran
    out, lse = fa.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lq), return_lse=True,
                                   **features)
    check_per_sequence(out, lse, q, k, v, lq, lq, f"dispatched {ran}", **features)


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_values_past_a_sequence_never_reach_it(require_sm90, poison):
    """A sequence's last KV block reads the next sequence's rows in the packed tensors: they
    must be masked (K) and zeroed (V) even when they hold inf or NaN."""
    lq, lk = [100, 70, 50], [100, 70, 50]
    q, k, v, cu_q, cu_k = packed(lq, lk, 4, 4, 128, torch.bfloat16)
    k[100:], v[100:] = poison, poison  # sequences 1 and 2 poisoned
    for causal in (False, True):
        out, lse = fa.attention_varlen(q, k, v, cu_q, cu_k, 100, 100, causal=causal,
                                       return_lse=True)
        check_against_reference(out[None, :100], q[None, :100], k[None, :100], v[None, :100],
                                lse=lse[None, :, :100], what=f"sequence 0 (causal={causal})",
                                causal=causal)


def test_views_as_people_pass_them(require_sm90):
    """A d_head slice of a wider buffer (copied to an aligned tensor, then the Hopper kernel
    runs it) and K/V heads expanded from one (stride 0: the sm80 family reads them in place,
    with the reason in explain_varlen): both right."""
    lq = [130, 7, 64]
    total = sum(lq)
    cu = cu_seqlens(lq)
    wide = torch.randn(total, 4, 136, device="cuda", dtype=torch.bfloat16)
    q = wide[..., 4:132]
    k = torch.randn(total, 4, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ran = api.explain_varlen(q, k, v, max(lq), max(lq))
    assert ran.startswith("fwd_sm90_"), ran
    out, lse = fa.attention_varlen(q, k, v, cu, cu, max(lq), max(lq), return_lse=True)
    check_per_sequence(out, lse, q, k, v, lq, lq, "sliced q")

    k1 = torch.randn(total, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = k1.expand(total, 4, 128), torch.randn_like(k1).expand(total, 4, 128)
    ran = api.explain_varlen(q, k, v, max(lq), max(lq))
    assert ran.startswith("fwd_sm80_") and "expanded" in ran, ran
    out, lse = fa.attention_varlen(q, k, v, cu, cu, max(lq), max(lq), return_lse=True)
    check_per_sequence(out, lse, q, k, v, lq, lq, "expanded k, v")


# ---- the backward (bwd_sm90 flag j) --------------------------------------------------------------


def bwd_varlen_configs():
    if not fa.is_built():
        return []
    from flash_attention.backward import built
    return [c for c in built() if isinstance(c, bwd_sm90.Config) and c.varlen]


BWD_VARLEN_CONFIGS = bwd_varlen_configs()


def forward_for(q, k, v, cu_q, cu_k, lq, lk, causal=False, window=(-1, -1), softcap=0.0):
    """out and lse of the dispatched forward (the backward's inputs)."""
    return torch.ops.flash_attention.attention.default(
        q, k, v, cu_q, cu_k, max(lq), max(lk), None, causal, window[0], window[1], softcap, True,
        "")


def run_bwd_kernel(cfg, dout, q, k, v, out, lse, cu_q, cu_k, lq, lk, causal=False,
                   window=(-1, -1), softcap=0.0, deterministic=False):
    """The backward operator with a kernel named: dq, dk, dv."""
    return torch.ops.flash_attention.bwd.default(
        dout, q, k, v, out, lse, None, cu_q, cu_k, max(lq), max(lk), None, causal, window[0],
        window[1], softcap, deterministic, cfg.name if cfg is not None else "")


def check_grads_per_sequence(grads, q, k, v, dout, lq, lk, what, **features):
    """Each sequence's gradients against the reference of its own slices (FlashAttention's
    rule, test_gpu_backward.check_grads); a sequence without keys or queries gets 0."""
    q0 = k0 = 0
    for b, (nq, nk) in enumerate(zip(lq, lk, strict=True)):
        sq, sk = slice(q0, q0 + nq), slice(k0, k0 + nk)
        seq = [grads[0][sq], grads[1][sk], grads[2][sk]]
        if nq == 0 or nk == 0:
            assert all(torch.count_nonzero(g) == 0 for g in seq), f"{what}: sequence {b}"
        else:
            check_grads([g[None] for g in seq], q[None, sq], k[None, sk], v[None, sk],
                        dout[None, sq], what=f"{what}: sequence {b} ({nq} x {nk})", **features)
        q0, k0 = q0 + nq, k0 + nk


def sequence_errors(grads, q, k, v, dout, lq, lk, **features):
    """{(sequence, name): (max error, FlashAttention's bound)} of each sequence with keys and
    queries (test_gpu_backward.check_grads's rule: 2 x the low-precision reference's error +
    GRAD_FLOOR), and the sequences without either, whose gradients must be 0."""
    out, empty, q0, k0 = {}, [], 0, 0
    for b, (nq, nk) in enumerate(zip(lq, lk, strict=True)):
        sq, sk = slice(q0, q0 + nq), slice(k0, k0 + nk)
        q0, k0 = q0 + nq, k0 + nk
        if nq == 0 or nk == 0:
            empty.append((b, [grads[0][sq], grads[1][sk], grads[2][sk]]))
            continue
        args = (q[None, sq], k[None, sk], v[None, sk], dout[None, sq])
        ref = reference_grads(*args, True, **features)
        low = reference_grads(*args, False, **features)
        for i, name in enumerate(("dq", "dk", "dv")):
            g = grads[i][sk if i else sq][None]
            assert torch.isfinite(g).all(), f"sequence {b}: {name} has NaN/inf"
            out[b, name] = ((g.float() - ref[i]).abs().max().item(),
                            2 * (low[i].float() - ref[i]).abs().max().item() + GRAD_FLOOR)
    return out, empty


def bwd_options(cfg):
    if cfg.softcap:
        return [(False, (-1, -1), 1.5), (True, (-1, -1), 1.5)]
    return [(False, (-1, -1), 0.0), *[(c, w, 0.0) for c, w in MASKS]]


@pytest.mark.parametrize("pack", list(PACKS))
@pytest.mark.parametrize("cfg", BWD_VARLEN_CONFIGS, ids=str)
def test_hopper_varlen_backward_kernel_matches_reference(require_sm90, cfg, pack):
    """Every built Hopper varlen backward kernel by name, GQA 6/2, d_head below its variant at
    d_head 128 (96: columns past d_head), every mask: each sequence meets FlashAttention's rule,
    or where it does not, its error is the sm80 family's on the same call (within 5%): with far
    more queries than keys (630 x 2 under a causal mask) a row's dS is of the order of D's
    rounding (D = rowsum(dO O) from the rounded O, the preprocess both families share), which
    can put both families' dQ past 2 x the low-precision reference's error
    (studies/varlen_bwd_degenerate.py). dK and dV (no atomics) bitwise equal on a second run."""
    from flash_attention.backward import built
    lq, lk = PACKS[pack]
    d_head = cfg.d_head if cfg.d_head != 128 else 96
    sm80 = bwd_sm80.select(Call(cfg.dtype, d_head, softcap=cfg.softcap), built())
    for causal, window, softcap in bwd_options(cfg):
        torch.manual_seed(seed_of(cfg, pack, causal, window))
        q, k, v, cu_q, cu_k = packed(lq, lk, 6, 2, d_head, DTYPES[cfg.dtype])
        dout = torch.randn_like(q)
        out, lse = forward_for(q, k, v, cu_q, cu_k, lq, lk, causal, window, softcap)
        args = (dout, q, k, v, out, lse, cu_q, cu_k, lq, lk, causal, window, softcap)
        grads = run_bwd_kernel(cfg, *args)
        features = {"causal": causal, "window_size": window, "softcap": softcap}
        what = f"{cfg} {pack} {features}"
        errors, empty = sequence_errors(grads, q, k, v, dout, lq, lk, **features)
        for b, seq in empty:
            assert all(torch.count_nonzero(g) == 0 for g in seq), f"{what}: sequence {b}"
        over = {key: e for key, (e, bound) in errors.items() if e > bound}
        if over:
            assert sm80 is not None, f"{what}: over the rule at {over}, no sm80 kernel to compare"
            peer, _ = sequence_errors(run_bwd_kernel(sm80, *args), q, k, v, dout, lq, lk,
                                      **features)
            for key, e in over.items():
                assert e <= 1.05 * peer[key][0] + GRAD_FLOOR / 10, (
                    f"{what}: sequence {key[0]} {key[1]} error {e:.3e} > bound "
                    f"{errors[key][1]:.3e} and > the sm80 family's {peer[key][0]:.3e}")
        again = run_bwd_kernel(cfg, *args)
        for name, a, b in zip(("dk", "dv"), grads[1:], again[1:]):
            assert torch.equal(a, b), f"{cfg} {pack}: {name} differs on a second run (race?)"


@pytest.mark.parametrize("d_head", [64, 128, 256])
def test_hopper_varlen_backward_deterministic(require_sm90, d_head):
    """deterministic=True on the varlen kernel: bitwise-equal gradients over three runs, each
    sequence right; causal, many KV blocks per sequence."""
    (cfg,) = [c for c in BWD_VARLEN_CONFIGS if c.dtype == "bf16" and c.d_head == d_head
              and not c.softcap] or [None]
    if cfg is None:
        pytest.skip(f"no bf16 d_head {d_head} Hopper varlen backward kernel in this build")
    lq = lk = [700, 0, 1, 300, 129, 1000]
    torch.manual_seed(3)
    q, k, v, cu_q, cu_k = packed(lq, lk, 4, 2, d_head, torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = forward_for(q, k, v, cu_q, cu_k, lq, lk, True)
    runs = [run_bwd_kernel(cfg, dout, q, k, v, out, lse, cu_q, cu_k, lq, lk, True,
                           deterministic=True) for _ in range(3)]
    for again in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], again):
            assert torch.equal(a, b), f"{cfg}: {name} differs between deterministic runs"
    check_grads_per_sequence(runs[0], q, k, v, dout, lq, lk, f"{cfg} deterministic",
                             causal=True)


@pytest.mark.parametrize("features", [{}, {"causal": True}, {"softcap": 2.0}],
                         ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("d_head", [64, 128, 256])
def test_dispatch_runs_the_hopper_varlen_backward(require_sm90, d_head, features):
    """Autograd of attention_varlen runs the Hopper varlen backward (bwd_explain says so) and
    its gradients are right."""
    from flash_attention.backward import built
    want = bwd_sm90.select_varlen(Call("bf16", d_head, softcap=bool(features.get("softcap"))),
                                  built())
    if want is None:
        pytest.skip(f"no Hopper varlen backward kernel for d_head {d_head} in this build")
    lq = [700, 1, 0, 260, 129]
    torch.manual_seed(4)
    q, k, v, cu_q, cu_k = packed(lq, lq, 4, 2, d_head, torch.bfloat16)
    dout = torch.randn_like(q)
    ran = torch.ops.flash_attention.bwd_explain(dout, q, k, v, True, bool(features.get("softcap")))
    assert ran == want.name, ran
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fa.attention_varlen(*leaves, cu_q, cu_k, max(lq), max(lq), **features).backward(dout)
    check_grads_per_sequence([t.grad for t in leaves], q, k, v, dout, lq, lq,
                             f"dispatched {ran}", **features)


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_backward_values_past_a_sequence_never_reach_it(require_sm90, poison):
    """Sequence 0's tail blocks read the next sequences' rows of q, k, v and dout in the packed
    tensors: they are zeroed (as TMA zero-fills past a tensor's end), so even inf and NaN there
    leave sequence 0's gradients right."""
    lq = lk = [100, 70, 50]
    torch.manual_seed(5)
    q, k, v, cu_q, cu_k = packed(lq, lk, 4, 4, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    for causal in (False, True):
        out, lse = forward_for(q, k, v, cu_q, cu_k, lq, lk, causal)
        qp, kp, vp, dp, op = (t.clone() for t in (q, k, v, dout, out))
        for t in (qp, kp, vp, dp, op):
            t[100:] = poison  # sequences 1 and 2
        dq, dk, dv = run_bwd_kernel(None, dp, qp, kp, vp, op, lse, cu_q, cu_k, lq, lk, causal)
        check_grads([dq[None, :100], dk[None, :100], dv[None, :100]], q[None, :100],
                    k[None, :100], v[None, :100], dout[None, :100],
                    what=f"sequence 0 beside {poison} (causal={causal})", causal=causal)
