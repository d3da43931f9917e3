"""FP8 attention's CPU side: quantisation, the e4m3 configs' rules, the dispatch rows, the
references and the interface's refusals (the kernels themselves: test_gpu_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from flash_attention import fp8, ops
from flash_attention.interface import flash_attn_func
from flash_attention.kernels import ConfigError, fwd_sm90, parse
from flash_attention.reference import attention_reference_fp8, dequantize_fp8


def test_quantize_round_trip_and_groups():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 8, 64, generator=g) * torch.tensor([0.1, 1, 10, 100] * 2)[:, None]
    for groups in (8, 2, 1):
        x8, d = fp8.quantize(x, groups)
        assert x8.dtype == torch.float8_e4m3fn and d.dtype == torch.float32
        assert d.shape == (2, groups)
        back = dequantize_fp8(x8, d)
        # e4m3 keeps 3 mantissa bits: at most 2^-4 relative, each group's amax at 448
        amax = x.unflatten(2, (groups, -1)).abs().amax(dim=(1, 3, 4))
        bound = amax.repeat_interleave(8 // groups, dim=1)[:, None, :, None] * 2 ** -4
        assert ((back - x).abs() <= torch.maximum(x.abs() * 2 ** -4, bound * 2 ** -6)).all()
        assert torch.allclose(x8.float().abs().amax(dim=(1, 3)).max(), torch.tensor(448.0))
    x8, d = fp8.quantize(x, per_tensor=True)
    assert d.shape == (2, 8) and d.stride() == (0, 0)
    with pytest.raises(ValueError, match="must divide"):
        fp8.quantize(x, 3)


def test_e4m3_config_rules():
    cfg = parse("fwd_sm90_e4m3_d128_r128_c128_s3_fwpia")
    assert cfg.fp8 and cfg.elem_bytes == 1 and cfg.consumer_regs == 224
    # Q 16 KB, 3 stages of K, V and V raw (48 KB each), O bf16 32 KB, 2 KB
    assert cfg.smem_bytes == 16384 + 3 * 49152 + 32768 + 2048
    for bad, why in (("fwd_sm90_e4m3_d64_r192_c96_s3_fwaln", "d_head 128 or 256"),
                     ("fwd_sm90_e4m3_d128_r128_c128_s2_fwialgz", "lazy_rescale"),
                     ("fwd_sm90_e4m3_d128_r128_c192_s2_fwpiaj", "over the 216 a consumer has"),
                     ("fwd_sm90_e4m3_d128_r128_c128_s1_fwpia", "2\\+ stages")):
        with pytest.raises(ConfigError, match=why):
            parse(bad)
    with pytest.raises(ConfigError):
        parse("fwd_sm80_e4m3_d128_r128_c64_w4_f")  # FP8 is the Hopper forward's alone
    varlen = parse("fwd_sm90_e4m3_d128_r128_c128_s3_fwpiaj")  # its producer keeps 72
    assert varlen.varlen and varlen.consumer_regs == 216


def test_e4m3_dispatch_rows():
    rows = ops.dispatch_rows(tuple(fwd_sm90.DEFAULT))
    fp8_rows = [r for r in rows if r[0] == "e4m3"]
    # d_head variants served by the d_head 128 and 256 kernels (none at 32 and 64)
    assert {r[1] for r in fp8_rows} == {96, 128, 160, 192, 224, 256}
    for _, _, _, mask, _, softcap, kernel, fallback, varlen, *tiers in fp8_rows:
        assert tiers == ["", ""]  # the one-wave and fewer-padded-keys kernels are 16-bit ones
        cfg = parse(kernel)
        assert cfg.fp8 and cfg.mask == mask and cfg.softcap == softcap
        assert fallback == ""  # no sm80 fallback
        packed = parse(varlen)  # the kind's varlen kernel (flag j), B_c 128 at most
        assert packed.fp8 and packed.varlen and packed.mask == mask and packed.softcap == softcap
        assert packed.d_head == cfg.d_head and packed.block_c <= 128


def test_reference_fp8_round_p_is_close():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 40, 2, 32, generator=g) for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v)
    ref, lse = attention_reference_fp8(q8, k8, v8, qd, kd, vd, causal=True)
    p8, _ = attention_reference_fp8(q8, k8, v8, qd, kd, vd, causal=True, round_p=True)
    err = (p8 - ref).abs().max().item()
    assert 0 < err < 0.1 * ref.abs().max().item()
    assert lse.shape == (1, 2, 40) and torch.isfinite(lse).all()


def test_descales_need_fp8_inputs():
    b = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="for float8_e4m3fn"):
        flash_attn_func(b, b, b, q_descale=torch.ones(1, 2))


def test_fp8_operator_traces_and_checks_without_a_gpu():
    """Under FakeTensorMode (CUDA tensors, no GPU) the operator's fake runs the checks and gives
    bf16 out and the LSE's shape, so torch.compile and export trace an FP8 call."""
    pytest.importorskip("flash_attention._C")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 100, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
        kv = torch.empty(2, 70, 2, 128, dtype=torch.float8_e4m3fn, device="cuda")
        d = torch.empty(2, 2, device="cuda")
        out, lse = fp8.attention_fp8(q, kv, kv, d, d, d, causal=True, return_lse=True)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
        with pytest.raises(ValueError, match="v_descale must be an fp32"):
            fp8.attention_fp8(q, kv, kv, d, d, torch.empty(2, 8, device="cuda"))
        with pytest.raises(ValueError, match="multiple of 16"):
            x = torch.empty(1, 8, 2, 72, dtype=torch.float8_e4m3fn, device="cuda")
            fp8.attention_fp8(x, x, x)
        # varlen: packed (total, heads, d_head), descales per sequence, lse (heads, total_q)
        qp = torch.empty(300, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
        kvp = torch.empty(250, 2, 128, dtype=torch.float8_e4m3fn, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        d3 = torch.empty(3, 2, device="cuda")
        out, lse = fp8.attention_fp8(qp, kvp, kvp, d3, d3, d3, return_lse=True, cu_seqlens_q=cu,
                                     cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200)
        assert out.shape == qp.shape and out.dtype == torch.bfloat16 and lse.shape == (8, 300)
        with pytest.raises(ValueError, match=r"\(3, 2\)"):  # (sequences, kv_heads)
            fp8.attention_fp8(qp, kvp, kvp, d, d, d, cu_seqlens_q=cu, cu_seqlens_k=cu,
                              max_seqlen_q=200, max_seqlen_k=200)
        with pytest.raises(ValueError, match="go together"):
            fp8.attention_fp8(qp, kvp, kvp, cu_seqlens_q=cu, max_seqlen_q=200)
