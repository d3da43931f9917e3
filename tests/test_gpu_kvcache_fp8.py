"""FP8 KV caches on the GPU (issue 46, item 2): flash_attn_with_kvcache with an fp16/bf16 q over
a float8_e4m3fn or float8_e5m2 cache (contiguous or paged) with descales per (batch, KV head),
against reference.kvcache_reference on the dequantised cache: the append quantises the new rows
(bitwise as quantize_cache does), attention meets FlashAttention's rule (error <= 2x that of the
same reference in q's dtype), over packed GQA, split-KV, every mask, softcap and rotary; the
varlen call over FP8 pages or packed FP8 keys; bad input refused before any launch."""

from __future__ import annotations

import random

import pytest
import torch

import flash_attention as fa
from flash_attention import kvcache
from flash_attention.interface import flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attention.kernels import dec_sm80
from flash_attention.reference import attention_reference, dequantize_fp8, kvcache_reference

from .kvcache_cases import ABS_FLOOR, angles, cache_copies, check_step, draw_call

pytestmark = pytest.mark.gpu

QTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CACHES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_cache(x: torch.Tensor, descale: torch.Tensor, dtype) -> torch.Tensor:
    """x (B, S, Hk, D) stored over descale (B, Hk) as dtype."""
    top = torch.finfo(dtype).max
    return (x.float() / descale[:, None, :, None]).clamp(-top, top).to(dtype)


def descales(batch: int, kv_heads: int, form: str, gen) -> torch.Tensor | None:
    """Random per-(batch, KV head) descales around the scale that maps |x| <= 4 to the e4m3
    range, an expanded per-tensor one, or None (1)."""
    if form == "none":
        return None
    if form == "tensor":
        return torch.full((1, 1), 4.0 / 448, device="cuda").expand(batch, kv_heads)
    return (torch.rand(batch, kv_heads, generator=gen) * 1.5 + 0.5).cuda() * (4.0 / 448)


def run_case(qtype, cache, d, heads, kv_heads, seqlen_q, s_new, s_cache, page, causal, window,
             softcap, rotary, num_splits, seqlens, scale_form, seed, kernel=""):
    gen = torch.Generator().manual_seed(seed)
    dt, ct = QTYPES[qtype], CACHES[cache]
    batch = len(seqlens)
    q = torch.randn(batch, seqlen_q, heads, d, generator=gen, dtype=dt).cuda()
    kd = descales(batch, kv_heads, scale_form, gen)
    vd = descales(batch, kv_heads, scale_form, gen)
    ones = torch.ones(batch, kv_heads, device="cuda")
    kc = fp8_cache(torch.randn(batch, s_cache, kv_heads, d, generator=gen).cuda(),
                   ones if kd is None else kd, ct)
    vc = fp8_cache(torch.randn(batch, s_cache, kv_heads, d, generator=gen).cuda(),
                   ones if vd is None else vd, ct)
    k = torch.randn(batch, s_new, kv_heads, d, generator=gen, dtype=dt).cuda() if s_new else None
    v = torch.randn(batch, s_new, kv_heads, d, generator=gen, dtype=dt).cuda() if s_new else None
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    cos = sin = None
    if rotary:
        cos, sin = angles(s_cache + seqlen_q + s_new, d // 2 if rotary == "half" else d, dt)
    interleaved = rotary == "interleaved"
    common = dict(causal=causal, window_size=window, softcap=softcap,
                  rotary_interleaved=interleaved, k_descale=kd, v_descale=vd)
    ref = kvcache_reference(q, kc, vc, k, v, cos, sin, lens, **common)
    low = kvcache_reference(q, kc, vc, k, v, cos, sin, lens, upcast=False, **common)
    kc_run, vc_run, table = cache_copies(kc, vc, page, gen)
    out, lse = flash_attn_with_kvcache(q, kc_run, vc_run, k, v, cos, sin, lens, None, None, table,
                                       None, causal, window, softcap, interleaved, None,
                                       num_splits, True, k_descale=kd, v_descale=vd,
                                       kernel=kernel)
    what = (f"{kernel or 'table'} {qtype} over {cache} d{d} h{heads}/{kv_heads} sq{seqlen_q} "
            f"new{s_new} cache{s_cache} page{page} causal{causal} window{window} softcap{softcap} "
            f"rotary{rotary} splits{num_splits} lens{seqlens} scales {scale_form}")
    assert out.dtype == dt, what
    check_step(out, lse, ref, low, what)
    kc_run, vc_run = kc_run.view(torch.uint8), vc_run.view(torch.uint8)
    if page:
        kc_run = kc_run[table.long()].flatten(1, 2)[:, :s_cache]
        vc_run = vc_run[table.long()].flatten(1, 2)[:, :s_cache]
    same = torch.equal(kc_run, ref.k_cache.view(torch.uint8)) and torch.equal(
        vc_run, ref.v_cache.view(torch.uint8))
    assert same, f"{what}: cache bytes after the append"
    assert fa.kvcache_errors() == [], what


def _grid():
    rng = random.Random(46)
    cases = []
    for i in range(40):
        c = draw_call(rng, [64, 128, 128, 96, 256, 48])
        cases.append(pytest.param(
            rng.choice(["fp16", "bf16"]), rng.choice(["e4m3", "e4m3", "e5m2"]), *c.values(),
            rng.choice(["heads", "heads", "tensor", "none"]), i, id=f"case{i:02d}"))
    return cases


@pytest.mark.parametrize("qtype,cache,d,heads,kv_heads,seqlen_q,s_new,s_cache,page,causal,"
                         "window,softcap,rotary,num_splits,seqlens,scale_form,seed", _grid())
def test_fp8_cache_matches_reference(require_extension, qtype, cache, d, heads, kv_heads,
                                     seqlen_q, s_new, s_cache, page, causal, window, softcap,
                                     rotary, num_splits, seqlens, scale_form, seed):
    run_case(qtype, cache, d, heads, kv_heads, seqlen_q, s_new, s_cache, page, causal, window,
             softcap, rotary, num_splits, seqlens, scale_form, seed)


@pytest.mark.parametrize("cache", ["e4m3", "e5m2"])
@pytest.mark.parametrize("num_splits,page", [(1, None), (7, None), (0, 16), (64, 1), (0, 256)])
def test_fp8_decode_long_cache(require_extension, cache, num_splits, page):
    """One decode step (seqlen_q 1, GQA 32/8, d128) over 4k-key FP8 caches."""
    run_case("bf16", cache, 128, 32, 8, 1, 1, 4096, page, True, (-1, -1), 0.0, None, num_splits,
             [4095, 1000, 17], "heads", 7)


@pytest.mark.parametrize("cfg", [c for c in dec_sm80.DEFAULT if c.cache], ids=str)
def test_fp8_blocks_over_pages_of_16_row_groups(require_extension, cfg):
    """Every FP8-cache decode kernel of the default set (blocks of 32 or 64 keys) over pages of
    16 rows and other multiples of 16 its B_c does not divide: each 16-row group of a block is
    addressed from its own page's entry; against the reference with an append, masks, softcap
    and splits, by name."""
    if cfg not in kvcache.built():
        pytest.skip(f"{cfg.name} is not in this build")
    pages = [p for p in (16, 32, 48, 80) if p % cfg.block_c]
    for i, page in enumerate(pages):
        window, softcap = ((-1, -1), 0.0) if i % 2 == 0 else ((100, 0), 20.0)
        run_case(cfg.dtype, cfg.cache, cfg.d_head, 16, 4, 1 + i % 2, i % 2, 700, page, True,
                 window, softcap, None, (0, 3)[i % 2], [700 - i, 333, 17], "heads", 11 + i,
                 kernel=cfg.name)


@pytest.mark.parametrize("cfg", [c for c in dec_sm80.DEFAULT if c.cache], ids=str)
def test_every_fp8_decode_kernel_by_name(require_extension, cfg):
    """Every FP8-cache decode kernel of the default set, named, on a step of its dtypes and
    d_head."""
    if cfg not in kvcache.built():
        pytest.skip(f"{cfg.name} is not in this build")
    kernel = cfg.name
    gen = torch.Generator().manual_seed(3)
    dt, ct = QTYPES[cfg.dtype], CACHES[cfg.cache]
    q = torch.randn(2, 3, 8, cfg.d_head, generator=gen, dtype=dt).cuda()
    kd = (torch.rand(2, 2, generator=gen) + 0.5).cuda() / 100
    vd = (torch.rand(2, 2, generator=gen) + 0.5).cuda() / 100
    kc = fp8_cache(torch.randn(2, 333, 2, cfg.d_head, generator=gen).cuda(), kd, ct)
    vc = fp8_cache(torch.randn(2, 333, 2, cfg.d_head, generator=gen).cuda(), vd, ct)
    lens = torch.tensor([333, 200], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, k_descale=kd,
                                  v_descale=vd, kernel=kernel)
    ref = kvcache_reference(q, kc, vc, cache_seqlens=lens, causal=True, k_descale=kd,
                            v_descale=vd)
    low = kvcache_reference(q, kc, vc, cache_seqlens=lens, causal=True, k_descale=kd,
                            v_descale=vd, upcast=False)
    err = (out.float() - ref.out).abs().max().item()
    err_pt = (low.out.float() - ref.out).abs().max().item()
    assert err <= 2 * err_pt + ABS_FLOOR, f"{kernel}: {err:.3e} > 2 x {err_pt:.3e}"


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_over_fp8_keys(require_extension, paged):
    """flash_attn_varlen_func with a bf16 q over FP8 pages (block_table) or packed FP8 keys:
    each sequence against the reference on its dequantised keys."""
    gen = torch.Generator().manual_seed(5)
    lens_q, lens_k = [1, 7, 1, 30], [100, 257, 1, 64]
    heads, kv_heads, d = 8, 2, 128
    batch = len(lens_q)
    kd = (torch.rand(batch, kv_heads, generator=gen) + 0.5).cuda() / 100
    vd = (torch.rand(batch, kv_heads, generator=gen) + 0.5).cuda() / 100
    q = torch.randn(sum(lens_q), heads, d, generator=gen, dtype=torch.bfloat16).cuda()
    seqs = [torch.randn(1, n, kv_heads, d, generator=gen).cuda() for n in lens_k]
    k8 = [fp8_cache(s, kd[b:b + 1], torch.float8_e4m3fn) for b, s in enumerate(seqs)]
    v8 = [fp8_cache(s.flip(1), vd[b:b + 1], torch.float8_e4m3fn) for b, s in enumerate(seqs)]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    if paged:
        page = 16
        per_seq = -(-max(lens_k) // page)
        table = torch.arange(batch * per_seq, dtype=torch.int32, device="cuda").view(batch, -1)
        pool_k = torch.zeros(batch * per_seq, page, kv_heads, d, device="cuda",
                             dtype=torch.uint8)
        pool_v = pool_k.clone()
        for b, n in enumerate(lens_k):
            pool_k.view(batch, per_seq * page, kv_heads, d)[b, :n] = k8[b][0].view(torch.uint8)
            pool_v.view(batch, per_seq * page, kv_heads, d)[b, :n] = v8[b][0].view(torch.uint8)
        pool_k, pool_v = pool_k.view(torch.float8_e4m3fn), pool_v.view(torch.float8_e4m3fn)
        out = flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k),
                                     causal=True, block_table=table, k_descale=kd, v_descale=vd)
    else:
        packed_k = torch.cat([t.view(torch.uint8) for t in k8], 1)[0].view(torch.float8_e4m3fn)
        packed_v = torch.cat([t.view(torch.uint8) for t in v8], 1)[0].view(torch.float8_e4m3fn)
        out = flash_attn_varlen_func(q, packed_k, packed_v, cu_q, cu_k,
                                     max(lens_q), max(lens_k), causal=True, k_descale=kd,
                                     v_descale=vd)
    for b in range(batch):
        qb = q[cu_q[b]:cu_q[b + 1]][None]
        kf = dequantize_fp8(k8[b], kd[b:b + 1])
        vf = dequantize_fp8(v8[b], vd[b:b + 1])
        ref, _ = attention_reference(qb, kf, vf, causal=True)
        low, _ = attention_reference(qb, kf.to(qb.dtype), vf.to(qb.dtype), upcast=False,
                                     causal=True)
        got = out[cu_q[b]:cu_q[b + 1]][None].float()
        err = (got - ref.float()).abs().max().item()
        err_pt = (low.float() - ref.float()).abs().max().item()
        assert err <= 2 * err_pt + ABS_FLOOR, f"sequence {b}: {err:.3e} > 2 x {err_pt:.3e}"


def test_fp8_cache_decode_graph_replay(require_extension):
    """A decode step over an FP8 cache captured in a CUDA graph, replayed with new lengths and
    new rows: the cache and outputs match eager calls."""
    gen = torch.Generator().manual_seed(9)
    kd = torch.full((2, 8), 0.01, device="cuda")
    q = torch.randn(2, 1, 32, 128, generator=gen, dtype=torch.bfloat16).cuda()
    kc = fp8_cache(torch.randn(2, 2048, 8, 128, generator=gen).cuda(), kd, torch.float8_e4m3fn)
    vc = kc.clone()
    knew = torch.randn(2, 1, 8, 128, generator=gen, dtype=torch.bfloat16).cuda()
    lens = torch.tensor([100, 1500], dtype=torch.int32, device="cuda")
    kc_eager, vc_eager = kc.clone(), vc.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        flash_attn_with_kvcache(q, kc, vc, knew, knew, cache_seqlens=lens, k_descale=kd,
                                v_descale=kd)  # warm up
        with torch.cuda.graph(graph, stream=stream):
            out = flash_attn_with_kvcache(q, kc, vc, knew, knew, cache_seqlens=lens,
                                          k_descale=kd, v_descale=kd)
    torch.cuda.synchronize()
    kc_eager.copy_(kc)
    vc_eager.copy_(vc)
    for step in range(3):
        lens.add_(1)
        knew.normal_(generator=None)
        graph.replay()
        torch.cuda.synchronize()
        want = flash_attn_with_kvcache(q, kc_eager, vc_eager, knew, knew, cache_seqlens=lens,
                                       k_descale=kd, v_descale=kd)
        assert torch.equal(out, want), step
        assert torch.equal(kc.view(torch.uint8), kc_eager.view(torch.uint8)), step


def test_fp8_cache_bad_input(require_extension):
    """Refused before any launch, naming what is wrong."""
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.zeros(2, 64, 2, 128, device="cuda").to(torch.float8_e4m3fn)
    kd = torch.ones(2, 2, device="cuda")
    c16 = torch.zeros(2, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_descale / v_descale go with an FP8 cache"):
        flash_attn_with_kvcache(q, c16, c16, k_descale=kd)
    with pytest.raises(ValueError, match="k_descale must be an fp32 \\(batch, kv_heads\\)"):
        flash_attn_with_kvcache(q, kc, kc, k_descale=torch.ones(2, 3, device="cuda"))
    with pytest.raises(ValueError, match="k_descale must be an fp32"):
        flash_attn_with_kvcache(q, kc, kc, k_descale=kd.double())
    with pytest.raises(ValueError, match="q_descale is for an FP8 q"):
        flash_attn_with_kvcache(q, kc, kc, q_descale=kd)
    with pytest.raises(TypeError, match="must have one dtype"):
        flash_attn_with_kvcache(q, kc, kc.view(torch.float8_e5m2))
    knew8 = torch.zeros(2, 1, 2, 128, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="k and v must have q's dtype"):
        flash_attn_with_kvcache(q, kc, kc, knew8, knew8, cache_seqlens=3)
    q48 = torch.randn(2, 1, 8, 40, device="cuda", dtype=torch.bfloat16)
    kc48 = torch.zeros(2, 64, 2, 40, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiples of 16"):
        flash_attn_with_kvcache(q48, kc48, kc48)
    q8 = q.to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="q has dtype"):
        flash_attn_with_kvcache(q8, kc, kc)
    with pytest.raises(ValueError, match="does not serve"):
        flash_attn_with_kvcache(q, kc, kc, kernel="dec_sm80_bf16_d128_r16_c16_w4_f")
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="k_descale / v_descale go with an FP8 cache"):
        flash_attn_varlen_func(q[:, 0], c16[0], c16[0], cu_q, cu_k, 1, 32, k_descale=kd)
    assert fa.kvcache_errors() == []
