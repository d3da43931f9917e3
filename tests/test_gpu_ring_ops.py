"""The two operators ring attention adds on one GPU: flash_attention::bwd_accumulate (a call's
dq, dk, dv added into fp32 sums instead of written in the inputs' dtype) and
flash_attention::merge_partials_ (a partial result merged into a running one by LSE, in place).

bwd_accumulate against flash_attention::bwd on the same call: the sums grow by the gradients
bwd returns up to bwd's own 16-bit rounding, and lie no further from the fp32 reference's
gradients than bwd's do (plus a floor); over the Hopper kernels (fixed length and varlen), the
sm80 family by name, GQA, causal, odd lengths, deterministic mode and sums that are views into
larger buffers. merge_partials_ against the torch merge (merge.merge_partials), rows that saw
no key included. Bad sums are refused with the reason."""

from __future__ import annotations

import math

import pytest
import torch

from flash_attention.distributed.merge import merge_partials
from flash_attention.reference import attention_reference

pytestmark = pytest.mark.gpu

FLOOR = 1e-4


def _bwd(dout, q, k, v, out, lse, causal, kernel="", varlen=None, deterministic=False):
    cu = (None, None, 0, 0) if varlen is None else varlen
    return torch.ops.flash_attention.bwd.default(dout, q, k, v, out, lse, None, *cu, None, causal,
                                                 -1, -1, 0.0, deterministic, kernel)


def _accumulate(dout, q, k, v, out, lse, causal, sums, kernel="", varlen=None,
                deterministic=False):
    cu = (None, None, 0, 0) if varlen is None else varlen
    torch.ops.flash_attention.bwd_accumulate.default(dout, q, k, v, out, lse, *cu, None, causal,
                                                     -1, -1, 0.0, deterministic, *sums, kernel)


def _reference_grads(q, k, v, dout, causal):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*leaves, causal=causal)
    return torch.autograd.grad((ref * dout.float()).sum(), leaves)


def _sums_like(tensors, offset_rows: int):
    """fp32 sums shaped like `tensors`, random start values, each a view into a larger buffer
    (offset_rows extra rows before it along dim 1) when offset_rows > 0."""
    out = []
    for t in tensors:
        shape = list(t.shape)
        shape[1] += offset_rows
        buf = torch.randn(shape, device="cuda")
        out.append(buf[:, offset_rows:] if offset_rows else buf[:, :])
    return out


def _check(sums, start, plain, ref):
    for name, s, s0, p, r in zip("qkv", sums, start, plain, ref):
        if s._base is not None:  # a view: the rows of its buffer outside it are untouched
            rows = s._base.shape[1] - s.shape[1]
            assert torch.equal(s._base[:, :rows], s0._base[:, :rows]), f"d{name}: wrote outside"
        added = s - s0
        # bwd rounds each value once to the 16-bit dtype: within that rounding of it
        torch.testing.assert_close(added, p.float(), rtol=2 ** -7, atol=1e-5,
                                   msg=lambda m, name=name: f"d{name}: {m}")
        err, err_plain = (added - r).abs().max().item(), (p.float() - r).abs().max().item()
        assert err <= err_plain + FLOOR, f"d{name}: {err:.3e} vs bwd's {err_plain:.3e}"


@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "heads", "kv_heads", "d_head", "causal"), [
    (1000, 1000, 4, 4, 128, True),
    (384, 1023, 8, 2, 128, False),
    (257, 511, 6, 1, 64, True),
    (640, 640, 4, 2, 256, False),
])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_accumulate_adds_the_gradients_of_bwd_in_fp32(require_extension, seqlen_q, seqlen_k,
                                                          heads, kv_heads, d_head, causal,
                                                          deterministic):
    import flash_attention as fa

    torch.manual_seed(seqlen_q + d_head)
    q = torch.randn(2, seqlen_q, heads, d_head, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, kv_heads, d_head, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = fa.attention(q, k, v, causal=causal, return_lse=True)
    plain = _bwd(dout, q, k, v, out, lse, causal, deterministic=deterministic)
    sums = _sums_like((q, k, v), offset_rows=3 if deterministic else 0)
    start = [s._base.clone()[:, s._base.shape[1] - s.shape[1]:] for s in sums]
    _accumulate(dout, q, k, v, out, lse, causal, sums, deterministic=deterministic)
    _check(sums, start, plain, _reference_grads(q, k, v, dout, causal))


def test_bwd_accumulate_sm80_family_by_name(require_extension):
    import flash_attention as fa

    name = "bwd_sm80_bf16_d128_r64_c128_w8_fh"
    if name not in torch.ops.flash_attention.bwd_kernels().split(","):
        pytest.skip(f"{name} is not in this build")
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 700, 4, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    dout = torch.randn_like(q)
    out, lse = fa.attention(q, k, v, causal=True, return_lse=True)
    plain = _bwd(dout, q, k, v, out, lse, True, kernel=name)
    sums = _sums_like((q, k, v), offset_rows=5)
    start = [s._base.clone()[:, 5:] for s in sums]
    _accumulate(dout, q, k, v, out, lse, True, sums, kernel=name)
    _check(sums, start, plain, _reference_grads(q, k, v, dout, True))


@pytest.mark.parametrize("causal", [False, True])
def test_bwd_accumulate_varlen(require_extension, causal):
    from flash_attention.interface import flash_attn_varlen_func

    torch.manual_seed(2)
    lengths = [300, 1, 517, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    total, longest = sum(lengths), max(lengths)
    q = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal,
                                         return_attn_probs=True)
    varlen = (cu, cu, longest, longest)
    plain = _bwd(dout, q, k, v, out, lse, causal, varlen=varlen)
    sums = [torch.randn(t.shape, device="cuda") for t in (q, k, v)]
    start = [s.clone() for s in sums]
    _accumulate(dout, q, k, v, out, lse, causal, sums, varlen=varlen)
    per_sequence = [_reference_grads(q[None, a:b], k[None, a:b], v[None, a:b],
                                     dout[None, a:b], causal)
                    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    ref = [torch.cat([g[0] for g in grads]) for grads in zip(*per_sequence)]
    _check(sums, start, plain, ref)


def test_bwd_accumulate_refuses_bad_sums(require_extension):
    import flash_attention as fa

    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = fa.attention(q, k, v, return_lse=True)
    good = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]
    cases = [
        ([good[0].bfloat16(), good[1], good[2]], TypeError, "dq_sum must be float32"),
        ([good[0], good[1][:, :64], good[2]], ValueError, "dk_sum must have the shape of k"),
        ([good[0], good[1], torch.zeros(1, 128, 2, 65, device="cuda")[..., 1:]], ValueError,
         "dv_sum must have a contiguous last dimension"),
    ]
    for sums, error, message in cases:
        with pytest.raises(error, match=message):
            _accumulate(torch.randn_like(q), q, k, v, out, lse, False, sums)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d_head", [64, 128, 256])
def test_merge_partials_kernel_matches_the_torch_merge(require_extension, dtype, d_head):
    torch.manual_seed(d_head)
    b, s, h = 2, 333, 5
    out = torch.randn(b, 2 * s, h, d_head, device="cuda")[:, s:]  # a view of rows
    lse = torch.randn(b, h, s, device="cuda") * 3
    part = torch.randn(b, s, h, d_head, device="cuda").to(dtype)
    part_lse = torch.randn(b, h, s, device="cuda") * 3
    lse[:, :, :40] = -math.inf  # rows the running result has not seen a key for
    part_lse[:, :, 20:60] = -math.inf  # rows the part saw no key for (20-39: neither)
    out[:, :40] = 0.0
    want, want_lse = merge_partials(out.clone(), lse.clone(), part, part_lse)
    torch.ops.flash_attention.merge_partials_.default(out, lse, part, part_lse, False)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert bool((out[:, 20:40] == 0).all()) and bool(torch.isneginf(lse[:, :, 20:40]).all())
    fresh = torch.full_like(out, math.nan)  # assign: whatever the buffer held
    fresh_lse = torch.full_like(lse, math.nan)
    torch.ops.flash_attention.merge_partials_.default(fresh, fresh_lse, part, part_lse, True)
    assert torch.equal(fresh, part.float()) and torch.equal(fresh_lse, part_lse)
