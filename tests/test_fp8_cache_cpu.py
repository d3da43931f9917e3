"""FP8 KV caches without a GPU (issue 46, item 2): the decode configs over e4m3 / e5m2 caches
(names, rules, sets, the dispatch rows the extension receives), the reference's quantising
append and dequantised attention, the operators' fakes with descales, the gate's decode cases
over FP8 caches and the mangled names of the kernels."""

from __future__ import annotations

import pytest
import torch

from fa_tools.analysis.kernel_names import short_of
from fa_tools.gate import coverage
from fa_tools.gpu.perfcases import DEC_GATE_CASES, Case
from flash_attention import kvcache
from flash_attention.kernels import Call, ConfigError, dec_sm80, parse
from flash_attention.reference import (
    attention_reference,
    dequantize_fp8,
    kvcache_reference,
    quantize_cache,
)


def test_fp8_cache_names_and_rules():
    cfg = parse("dec_sm80_bf16_e4m3_d128_r16_c32_w4_f")
    assert (cfg.dtype, cfg.cache, cfg.d_head, cfg.block_c, cfg.warps) == ("bf16", "e4m3", 128,
                                                                          32, 4)
    assert parse(cfg.name) == cfg and cfg.name == "dec_sm80_bf16_e4m3_d128_r16_c32_w4_f"
    assert parse("dec_sm80_bf16_d128_r16_c16_w4_f").cache == ""
    # FP8 tiles take B_c 32 or 64 (x4 loads of 32 keys), the same bytes per stage as 16-bit
    assert cfg.smem_bytes == parse("dec_sm80_bf16_d128_r16_c16_w4_f").smem_bytes
    with pytest.raises(ConfigError, match="B_c must be one of"):
        parse("dec_sm80_bf16_e4m3_d128_r16_c16_w4_f")
    with pytest.raises(ConfigError, match="B_c must be one of"):
        parse("dec_sm80_bf16_d128_r16_c64_w4_f")
    with pytest.raises(ConfigError, match="cannot parse"):
        parse("dec_sm80_bf16_e3m4_d128_r16_c32_w4_f")
    with pytest.raises(ConfigError, match="cannot parse"):
        parse("fwd_sm80_bf16_e4m3_d128_r128_c64_w4_f")  # only the decode kind has caches
    assert "over an e4m3 cache" in cfg.describe()


def test_fp8_cache_sets_and_selection():
    fp8 = [c for c in dec_sm80.DEFAULT if c.cache]
    assert {(c.dtype, c.cache, c.d_head) for c in fp8} == {
        (dt, fmt, d) for dt in ("fp16", "bf16") for fmt in ("e4m3", "e5m2")
        for d in (64, 128, 256)}
    built = dec_sm80.DEFAULT
    assert dec_sm80.select(Call("bf16", 96), built, "e5m2").name == \
        "dec_sm80_bf16_e5m2_d128_r16_c32_w4_f"
    assert dec_sm80.select(Call("bf16", 72), built, "e4m3") is None  # not a multiple of 16
    assert dec_sm80.select(Call("bf16", 128), built).cache == ""
    assert dec_sm80.select(Call("bf16", 128), [c for c in built if not c.cache], "e4m3") is None
    rows = kvcache.dispatch_rows(built)
    keys = {(r[0], r[1]) for r in rows}
    assert ("bf16_e4m3", 128) in keys and ("fp16_e5m2", 256) in keys and ("bf16", 96) in keys
    assert all(r[6] == r[7] for r in rows)  # a decode kernel is its own fallback
    assert all(("_e4m3_" in r[6]) == r[0].endswith("e4m3") for r in rows)


def test_quantize_cache_rounds_and_saturates():
    x = torch.tensor([[[[1.0, -3.0, 500.0, -1e6, 0.0, float("nan"), 0.0625, 17.0]]]])
    d = torch.tensor([[0.5]])
    q = quantize_cache(x, d, torch.float8_e4m3fn)
    want = (x / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert q.float()[0, 0, 0, 2] == 448 and q.float()[0, 0, 0, 3] == -448
    assert torch.isnan(q.float()[0, 0, 0, 5])
    q5 = quantize_cache(x, None, torch.float8_e5m2)
    assert q5.float()[0, 0, 0, 3] == -57344 and q5.float()[0, 0, 0, 2] == 512


@pytest.mark.parametrize("page", [None, 4])
def test_fp8_reference_appends_quantised_and_attends_dequantised(page):
    """The reference over an FP8 cache is the 16-bit reference over the dequantised cache, the
    new rows quantised with the descales (through pages as well)."""
    torch.manual_seed(0)
    b, s, hk, d = 2, 12, 2, 32
    q = torch.randn(b, 1, 4, d, dtype=torch.bfloat16)
    kd, vd = torch.rand(b, hk) / 50 + 0.01, torch.rand(b, hk) / 50 + 0.01
    kc = quantize_cache(torch.randn(b, s, hk, d), kd, torch.float8_e4m3fn)
    vc = quantize_cache(torch.randn(b, s, hk, d), vd, torch.float8_e4m3fn)
    knew, vnew = torch.randn(b, 1, hk, d, dtype=torch.bfloat16), torch.randn(
        b, 1, hk, d, dtype=torch.bfloat16)
    lens = torch.tensor([5, 11], dtype=torch.int32)
    table = None
    kc_in, vc_in = kc, vc
    if page:
        table = torch.arange(b * s // page, dtype=torch.int32).view(b, -1)
        kc_in = kc.view(torch.uint8).reshape(-1, page, hk, d).view(torch.float8_e4m3fn)
        vc_in = vc.view(torch.uint8).reshape(-1, page, hk, d).view(torch.float8_e4m3fn)
    got = kvcache_reference(q, kc_in, vc_in, knew, vnew, cache_seqlens=lens, block_table=table,
                            causal=True, k_descale=kd, v_descale=vd)
    k_after = got.k_cache.view(torch.uint8).reshape(b, s, hk, d)
    for i in range(b):
        n = int(lens[i])
        want_row = quantize_cache(knew[i:i + 1].float(), kd[i:i + 1], torch.float8_e4m3fn)
        assert torch.equal(k_after[i, n], want_row.view(torch.uint8)[0, 0])
        assert torch.equal(k_after[i, :n], kc.view(torch.uint8)[i, :n])  # rows before: kept
        keys = dequantize_fp8(k_after[i:i + 1, :n + 1].view(torch.float8_e4m3fn), kd[i:i + 1])
        values = dequantize_fp8(
            got.v_cache.view(torch.uint8).reshape(b, s, hk, d)[i:i + 1, :n + 1].view(
                torch.float8_e4m3fn), vd[i:i + 1])
        out, _ = attention_reference(q[i:i + 1], keys, values, causal=True)
        torch.testing.assert_close(got.out[i:i + 1].float(), out.float())


def test_fp8_cache_operators_trace_with_descales(require_extension):
    """flash_attn_with_kvcache and the varlen call over FP8 caches with descales trace with
    fake tensors (no GPU): out like q (q's dtype), and the schemas take the descales."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attention.interface import flash_attn_varlen_func, flash_attn_with_kvcache

    with FakeTensorMode() as mode:
        q = torch.empty(3, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
        cache = torch.empty(3, 64, 2, 128, dtype=torch.float8_e4m3fn, device="cuda")
        d = torch.empty(3, 2, device="cuda")
        new = torch.empty(3, 1, 2, 128, dtype=torch.bfloat16, device="cuda")
        lens = torch.empty(3, dtype=torch.int32, device="cuda")
        out = flash_attn_with_kvcache(q, cache, cache, new, new, cache_seqlens=lens,
                                      k_descale=d, v_descale=d)
        assert out.shape == q.shape and out.dtype == torch.bfloat16
        qv = torch.empty(10, 8, 128, dtype=torch.bfloat16, device="cuda")
        pages = torch.empty(20, 16, 2, 128, dtype=torch.float8_e5m2, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        table = torch.empty(3, 5, dtype=torch.int32, device="cuda")
        out = flash_attn_varlen_func(qv, pages, pages, cu, cu, 4, 80, block_table=table,
                                     k_descale=d, v_descale=d)
        assert out.shape == qv.shape
    del mode
    for op in (torch.ops.flash_attention.kvcache, torch.ops.flash_attention.varlen_paged):
        schema = str(op.default._schema)
        assert "Tensor? k_descale=None" in schema and "Tensor? v_descale=None" in schema


def test_q_descale_with_a_16bit_q_is_refused():
    from flash_attention.interface import flash_attn_with_kvcache

    q = torch.zeros(1, 1, 2, 64, dtype=torch.bfloat16)
    c = torch.zeros(1, 8, 2, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_descale is for an FP8 q"):
        flash_attn_with_kvcache(q, c, c, q_descale=torch.ones(1, 2))


def test_gate_decode_cases_over_fp8_caches():
    fp8 = [c for c in DEC_GATE_CASES if c.cache]
    assert {c.cache for c in fp8} == {"e4m3", "e5m2"} and {c.d_head for c in fp8} == {64, 128,
                                                                                       256}
    assert any(c.page_size for c in fp8)
    for c in fp8:
        assert f"_{c.cache}_decode" in c.name
        assert coverage.dec_kernel(c) == dec_sm80.select(Call(c.dtype, c.d_head),
                                                         dec_sm80.DEFAULT, c.cache).name
    assert coverage.kind("dec_sm80_bf16_e5m2_d64_r16_c64_w4_f") == \
        coverage.kind("dec_sm80_fp16_e4m3_d64_r16_c64_w4_f") == "dec_sm80_fp8_d64_r16_c64_w4_f"
    with pytest.raises(ValueError, match="cache is an option of a decode case"):
        Case("bf16", 128, 1, 128, cache="e4m3")
    with pytest.raises(ValueError, match="e4m3 or e5m2"):
        Case("bf16", 128, 1, 1, seqlen_k=64, kind="decode", cache="fp8")


def test_mangled_names_of_decode_kernels():
    """The kernel symbol of each decode config (q's dtype repeated as the cache's is a
    substitution), and builds from before the B_r argument and before the cache argument."""
    pre = "_ZN5flash4sm8010dec_kernelINS0_9DecConfigI"
    post = "EEEEvNS_9DecParamsE"
    assert short_of(f"{pre}13__nv_bfloat16Li128ELi32ELi16ELi4ES3_{post}") == \
        "dec_sm80_bf16_d128_r32_c16_w4_f"
    assert short_of(f"{pre}6__halfLi64ELi16ELi64ELi4E13__nv_fp8_e5m2{post}") == \
        "dec_sm80_fp16_e5m2_d64_r16_c64_w4_f"
    # before B_r: 16 packed rows
    assert short_of(f"{pre}13__nv_bfloat16Li128ELi16ELi4ES3_{post}") == \
        "dec_sm80_bf16_d128_r16_c16_w4_f"
    assert short_of(f"{pre}6__halfLi64ELi64ELi4E13__nv_fp8_e5m2{post}") == \
        "dec_sm80_fp16_e5m2_d64_r16_c64_w4_f"
    # before the cache argument
    assert short_of(f"{pre}13__nv_bfloat16Li128ELi16ELi4E{post}") == \
        "dec_sm80_bf16_d128_r16_c16_w4_f"
