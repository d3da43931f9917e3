"""flash_attn_with_kvcache on the GPU against reference.kvcache_reference: the append (with
both rotary styles) into contiguous and paged caches of several page sizes, packed GQA, split-KV
(the heuristic, one pass, forced splits), every mask and softcap, seqlen_q > 1 (chunked
prefill); then bad metadata (refused before any launch when on the host; NaN rows, a status
bit and no write outside the cache when on the GPU), CUDA graph replay with changing lengths
and torch.compile(fullgraph=True) of a decode step."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import flash_attention as fa
from flash_attention.interface import flash_attn_with_kvcache
from flash_attention.reference import kvcache_reference

from .kvcache_cases import ABS_FLOOR, angles, cache_copies, check_step, draw_call

pytestmark = pytest.mark.gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def run_case(dtype, d, heads, kv_heads, seqlen_q, s_new, s_cache, page, causal, window,
             softcap, rotary, num_splits, seqlens, seed, return_lse=True, kernel="", leftpad=None):
    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    batch = len(seqlens)
    q = torch.randn(batch, seqlen_q, heads, d, generator=gen, dtype=dt).cuda()
    kc = torch.randn(batch, s_cache, kv_heads, d, generator=gen, dtype=dt).cuda()
    vc = torch.randn(batch, s_cache, kv_heads, d, generator=gen, dtype=dt).cuda()
    k = torch.randn(batch, s_new, kv_heads, d, generator=gen, dtype=dt).cuda() if s_new else None
    v = torch.randn(batch, s_new, kv_heads, d, generator=gen, dtype=dt).cuda() if s_new else None
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    cos = sin = None
    if rotary:
        cos, sin = angles(s_cache + seqlen_q + s_new, d // 2 if rotary == "half" else d, dt)
    interleaved = rotary == "interleaved"
    pad = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32, device="cuda")
    ref = kvcache_reference(q, kc, vc, k, v, cos, sin, lens, causal=causal,
                            window_size=window, softcap=softcap, rotary_interleaved=interleaved,
                            cache_leftpad=pad)
    low = kvcache_reference(q, kc, vc, k, v, cos, sin, lens, causal=causal,
                            window_size=window, softcap=softcap, rotary_interleaved=interleaved,
                            upcast=False, cache_leftpad=pad)
    kc_run, vc_run, table = cache_copies(kc, vc, page, gen)
    out, lse = flash_attn_with_kvcache(q, kc_run, vc_run, k, v, cos, sin, lens, None, pad, table,
                                       None, causal, window, softcap, interleaved, None,
                                       num_splits, True, kernel=kernel)
    what = (f"{kernel or 'table'} {dtype} d{d} h{heads}/{kv_heads} sq{seqlen_q} new{s_new} "
            f"cache{s_cache} page{page} causal{causal} window{window} softcap{softcap} "
            f"rotary{rotary} splits{num_splits} lens{seqlens} leftpad{leftpad}")
    check_step(out, lse, ref, low, what)
    # The caches after the append: the reference's rows (contiguous, or gathered from pages).
    if page:
        kc_run = kc_run[table.long()].flatten(1, 2)[:, :s_cache]
        vc_run = vc_run[table.long()].flatten(1, 2)[:, :s_cache]
    assert torch.equal(kc_run, ref.k_cache) and torch.equal(vc_run, ref.v_cache), (
        f"{what}: cache contents after the append")
    assert fa.kvcache_errors() == [], what


def _grid():
    rng = random.Random(44)
    cases = []
    for i in range(48):
        c = draw_call(rng, [64, 128, 128, 96, 256, 40])
        cases.append(pytest.param(rng.choice(["fp16", "bf16"]), *c.values(), i,
                                  id=f"case{i:02d}"))
    return cases


@pytest.mark.parametrize("dtype,d,heads,kv_heads,seqlen_q,s_new,s_cache,page,causal,window,"
                         "softcap,rotary,num_splits,seqlens,seed", _grid())
def test_kvcache_matches_reference(require_extension, dtype, d, heads, kv_heads, seqlen_q, s_new,
                                   s_cache, page, causal, window, softcap, rotary, num_splits,
                                   seqlens, seed):
    run_case(dtype, d, heads, kv_heads, seqlen_q, s_new, s_cache, page, causal, window, softcap,
             rotary, num_splits, seqlens, seed)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
@pytest.mark.parametrize("page", [None, 1, 16, 256])
def test_decode_long_cache_splits_and_pages(require_extension, num_splits, page):
    """One decode step (seqlen_q 1, GQA 32/8, d128) over 4k-key caches."""
    run_case("bf16", 128, 32, 8, 1, 1, 4096, page, True, (-1, -1), 0.0, None, num_splits,
             [4095, 1000, 17], 7)


@pytest.mark.parametrize("d,heads,kv_heads,num_splits", [
    (128, 32, 8, 2), (128, 32, 8, 5), (128, 32, 8, 16), (128, 32, 8, 17), (64, 8, 8, 16),
    (64, 8, 8, 40), (256, 16, 2, 3), (256, 16, 2, 16), (96, 6, 1, 9)])
def test_forced_splits_with_empty_ones(require_extension, d, heads, kv_heads, num_splits):
    """Forced split counts merged by the combine, against the reference: a sequence shorter
    than one split's share (splits with no keys) and, where no new key is appended (odd split
    counts), one with no keys at all; softcap and a window on some; MHA, GQA, MQA."""
    window = (300, 0) if num_splits in (5, 40) else (-1, -1)
    softcap = 30.0 if num_splits in (3, 9) else 0.0
    run_case("bf16", d, heads, kv_heads, 1, 1 - num_splits % 2, 3000, None, True, window,
             softcap, None, num_splits, [2999, 37, 0], 13)


@pytest.mark.parametrize("dtype,d,heads,kv_heads,seqlen_q,page,causal,window,softcap,splits", [
    ("bf16", 128, 32, 8, 8, None, True, (-1, -1), 0.0, 0),  # 32 rows: one 32-row tile
    ("bf16", 128, 32, 8, 5, 16, True, (-1, -1), 0.0, 0),  # 20 rows: part of one
    ("bf16", 128, 32, 8, 17, None, False, (100, 0), 0.0, 3),  # 68 rows: 3 tiles, a window
    ("bf16", 96, 8, 2, 9, 7, True, (-1, -1), 30.0, 2),  # 36 rows, softcap, pages across blocks
    ("fp16", 64, 8, 8, 33, 64, True, (-1, -1), 0.0, 0),  # MHA, 33 rows
    ("fp16", 64, 6, 1, 4, 1, False, (7, 2), 0.0, 5),  # MQA, 24 rows, page 1
])
def test_wide_tiles_match_reference(require_extension, dtype, d, heads, kv_heads, seqlen_q,
                                    page, causal, window, softcap, splits):
    """Calls of 17 or more packed rows on the 32-row kernels (named: the table runs them from
    dec_sm80.WIDE_MIN_BYTES of K and V) and on the 16-row ones (the table's choice here),
    against the reference."""
    from flash_attention import kvcache
    from flash_attention.kernels import Call, dec_sm80

    rows = dec_sm80.packed_rows(seqlen_q, heads, kv_heads)
    built = kvcache.built()
    wide = dec_sm80.select(Call(dtype, d), built, wide=True)
    if wide is None:
        pytest.skip(f"this build has no 32-row decode kernel for {dtype} d_head {d} "
                    "(FLASH_ATTENTION_KERNELS=default builds them)")
    assert rows >= dec_sm80.WIDE_FROM
    assert f"{wide.name} " in kvcache.explain(DTYPES[dtype], d, rows=rows,
                                              kv_bytes=dec_sm80.WIDE_MIN_BYTES)
    for name in (wide.name, ""):
        run_case(dtype, d, heads, kv_heads, seqlen_q, 1, 700, page, causal, window, softcap,
                 None, splits, [699, 0, 250], 21, kernel=name)


@pytest.mark.parametrize("batch,wide", [(4, True), (2, False)])
def test_the_table_takes_wide_tiles_from_128_mib(require_extension, batch, wide):
    """The extension's choice (choose_decode) is dec_sm80.select_for's: 8 queries of GQA groups
    of 4 over 4 sequences of 8192 keys (128 MiB of K and V) run the 32-row kernel, over 2
    sequences (64 MiB; 32 16-row tiles, below the deep kernel's band) the 16-row one: the
    table's output is bitwise the named kernel's (the decode kernels are deterministic; the two
    kernels' sums differ)."""
    from flash_attention import kvcache
    from flash_attention.kernels import Call, dec_sm80

    built = kvcache.built()
    wide_cfg = dec_sm80.select(Call("bf16", 128), built, wide=True)
    if wide_cfg is None:
        pytest.skip("this build has no 32-row bf16 d_head 128 decode kernel")
    narrow_cfg = dec_sm80.select(Call("bf16", 128), built)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(batch, 8, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    kc = torch.randn(batch, 8192, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    kv = dec_sm80.kv_bytes(batch, 8, 8192, 128)
    assert dec_sm80.runs_wide(32, kv) == wide
    picked = wide_cfg if wide else narrow_cfg
    assert f"{picked.name} " in kvcache.explain(torch.bfloat16, 128, rows=32, kv_bytes=kv)
    table = flash_attn_with_kvcache(q, kc, vc, causal=True)
    named = {c.name: flash_attn_with_kvcache(q, kc, vc, causal=True, kernel=c.name)
             for c in (wide_cfg, narrow_cfg)}
    assert torch.equal(table, named[picked.name])
    other = narrow_cfg if wide else wide_cfg
    assert not torch.equal(table, named[other.name]), "the two kernels' outputs are equal here"


def test_one_cta_per_sm_calls_take_the_deep_kernel(require_extension):
    """On a GPU that gives a CTA the deep kernel's shared memory (sm_90), calls whose 16-row
    tiles fill a third of the SMs to all of them run the row's deep kernel (8 warps, one CTA
    per SM) at deep_splits's split count, more tiles than SMs the 4-warp kernel: the table's
    output is bitwise the named kernel's at that split count. The deep kernel against the
    reference over masks, softcap, pages, several rows and forced splits."""
    from flash_attention import kvcache
    from flash_attention.kernels import Call, dec_sm80

    deep = dec_sm80.select_deep(Call("bf16", 128), kvcache.built())
    if deep is None:
        pytest.skip("this build has no deep bf16 d_head 128 decode kernel "
                    "(FLASH_ATTENTION_KERNELS=default builds it)")
    props = torch.cuda.get_device_properties(0)
    if props.shared_memory_per_block_optin < deep.smem_bytes:
        pytest.skip(f"{deep.name} needs {deep.smem_bytes} B of shared memory a CTA; this GPU "
                    f"gives {props.shared_memory_per_block_optin} (sm_90 does)")
    sms = props.multi_processor_count
    narrow = dec_sm80.select(Call("bf16", 128), kvcache.built())
    # sequences of 8 KV heads: tiles just over half the SMs (one split), a third to a half (two
    # splits), and 1.2 per SM (the 4-warp kernel)
    for batch, keys in ((sms // 16 + 1, 1024), (sms // 24 + 1, 2048), (sms * 6 // 40, 1024)):
        tiles = batch * 8
        want, splits = ((deep, dec_sm80.deep_splits(tiles, keys, sms))
                        if dec_sm80.runs_deep(tiles, keys, sms) else (narrow, 0))
        assert (want is deep) == (tiles <= sms), (batch, tiles, sms)
        q = torch.randn(batch, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        kc = torch.randn(batch, keys, 8, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        explained = kvcache.explain(torch.bfloat16, 128, rows=4, tiles=tiles, keys=keys,
                                    device=q.device)
        assert f"{want.name} " in explained, explained
        if want is deep:
            assert f"{splits} key split" in explained, explained
        table = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=keys)
        named = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=keys, kernel=want.name,
                                        num_splits=splits)
        assert torch.equal(table, named), f"batch {batch}: the table did not run {want.name}"
        if want is deep and splits > 1:  # the split count matters: one split differs
            one = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=keys, kernel=want.name,
                                          num_splits=1)
            assert not torch.equal(table, one), "one split and two gave the same bits"
    for seqlen_q, page, window, softcap, splits in ((1, None, (-1, -1), 0.0, 1),
                                                    (5, 16, (-1, -1), 30.0, 1),
                                                    (3, 7, (40, 0), 0.0, 3),
                                                    (17, None, (-1, -1), 0.0, 0)):
        run_case("bf16", 128, 32, 8, seqlen_q, 1, 1100, page, True, window, softcap, None,
                 splits, [1099, 0, 600], 5, kernel=deep.name)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_small_pages_take_the_16_key_kernel(require_extension, dtype):
    """d_head 64 over pages of 16 or 48 rows (multiples of 16 that the row kernel's 32-key
    blocks straddle) runs the small-page kernel (16-key blocks, each inside one page): the
    table's output is bitwise the named kernel's, explain says so, pages of 64 and 7 keep the
    row kernel; the small-page kernel against the reference over masks, softcap, splits and
    appends at those page sizes."""
    from flash_attention import kvcache
    from flash_attention.kernels import Call, dec_sm80

    built = kvcache.built()
    small = dec_sm80.select_small_page(Call(dtype, 64), built)
    if small is None:
        pytest.skip(f"this build has no {dtype} d_head 64 small-page decode kernel "
                    "(FLASH_ATTENTION_KERNELS=default builds it)")
    row = dec_sm80.select(Call(dtype, 64), built)
    assert small.block_c == 16 and row.block_c == 32
    gen = torch.Generator().manual_seed(3)
    dt = DTYPES[dtype]
    q = torch.randn(3, 1, 16, 64, generator=gen, dtype=dt).cuda()
    kc = torch.randn(3, 1000, 4, 64, generator=gen, dtype=dt).cuda()
    vc = torch.randn_like(kc)
    lens = torch.tensor([1000, 517, 33], dtype=torch.int32, device="cuda")
    for page, want in ((16, small), (48, small), (64, row), (7, row)):
        kp, vp, table = cache_copies(kc, vc, page, gen)
        explained = kvcache.explain(dt, 64, rows=4, tiles=12, keys=1000, page_size=page)
        assert f"{want.name} " in explained, explained
        got = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
        named = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                        kernel=want.name)
        assert torch.equal(got, named), f"page {page}: the table did not run {want.name}"
        if want is small:
            other = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                            kernel=row.name)
            assert not torch.equal(got, other), f"page {page}: both kernels gave the same bits"
    for seqlen_q, page, window, softcap, splits, s_new in ((1, 16, (-1, -1), 0.0, 0, 0),
                                                           (4, 48, (-1, -1), 30.0, 3, 2),
                                                           (3, 16, (40, 0), 0.0, 1, 1)):
        run_case(dtype, 64, 16, 4, seqlen_q, s_new, 900, page, True, window, softcap, None,
                 splits, [880, 0, 301], 7, kernel=small.name)
        run_case(dtype, 64, 16, 4, seqlen_q, s_new, 900, page, True, window, softcap, None,
                 splits, [880, 0, 301], 7)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_blocks_over_pages_of_16_row_groups(require_extension, dtype):
    """The 16-bit decode kernels of blocks wider than 16 keys (d_head 64's rows) over pages of
    16 and 48 rows: each 16-row group of a block is addressed from its own page's entry (no
    row-by-row gather); against the reference with an append, masks, softcap and splits, by
    name."""
    from flash_attention import kvcache
    from flash_attention.kernels import dec_sm80

    mine = [c for c in kvcache.built() if isinstance(c, dec_sm80.Config) and not c.cache
            and c.dtype == dtype and c.block_c > 16 and not c.sm90_only]
    if not mine:
        pytest.skip(f"this build has no {dtype} decode kernel of blocks over 16 keys")
    for cfg in mine:
        seqlen_q = 8 if cfg.block_r > 16 else 1  # 32 packed rows for a 32-row kernel
        for i, page in enumerate((16, 48)):
            window, softcap = ((-1, -1), 0.0) if i == 0 else ((100, 0), 20.0)
            run_case(dtype, cfg.d_head, 16, 4, seqlen_q, i, 700, page, True, window, softcap,
                     None, (0, 3)[i], [700 - i, 333, 17], 21 + i, kernel=cfg.name)


def test_int_and_absent_cache_seqlens(require_extension):
    torch.manual_seed(0)
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.float16)
    kc = torch.randn(2, 50, 2, 64, device="cuda", dtype=torch.float16)
    vc = torch.randn_like(kc)
    full = flash_attn_with_kvcache(q, kc, vc)  # None: the whole cache
    ref = kvcache_reference(q, kc, vc, cache_seqlens=50)
    assert (full.float() - ref.out).abs().max() < 5e-3
    part = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=20)
    ref = kvcache_reference(q, kc, vc, cache_seqlens=20)
    assert (part.float() - ref.out).abs().max() < 5e-3
    host = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([20, 20],
                                                                         dtype=torch.int32))
    assert torch.equal(host, part)


def test_views_as_people_pass_them(require_extension):
    """q a transposed (batch, heads, seq, d) view, new k/v slices of one packed buffer."""
    torch.manual_seed(1)
    q = torch.randn(2, 8, 3, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kv = torch.randn(2, 3, 2, 4, 128, device="cuda", dtype=torch.bfloat16)
    k, v = kv.unbind(2)
    kc = torch.randn(2, 64, 4, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.tensor([10, 61], dtype=torch.int32, device="cuda")
    ref = kvcache_reference(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    assert (out.float() - ref.out).abs().max() < 2e-2
    assert torch.equal(kc, ref.k_cache) and torch.equal(vc, ref.v_cache)


# ---- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,d,heads,kv_heads,seqlen_q,s_new,causal,window,softcap,rotary,"
                         "splits,seqlens,leftpad", [
    ("bf16", 128, 32, 8, 1, 0, False, (-1, -1), 0.0, None, 0, [700, 300, 1000], [0, 299, 513]),
    ("fp16", 64, 8, 2, 1, 1, True, (-1, -1), 0.0, "interleaved", 3, [500, 40, 999],
     [17, 40, 998]),
    ("bf16", 128, 16, 16, 4, 2, True, (64, 0), 0.0, "neox", 0, [900, 100], [400, 3]),
    ("fp16", 96, 12, 4, 3, 3, True, (-1, -1), 30.0, "half", 5, [0, 333, 710], [0, 200, 0]),
    ("bf16", 256, 8, 1, 1, 1, False, (-1, -1), 0.0, None, 1, [1000, 5], [250, 5]),
    ("bf16", 128, 32, 8, 8, 8, True, (-1, -1), 0.0, "neox", 0, [950, 64], [128, 1]),
])
def test_cache_leftpad_matches_reference(require_extension, dtype, d, heads, kv_heads, seqlen_q,
                                         s_new, causal, window, softcap, rotary, splits, seqlens,
                                         leftpad):
    """cache_leftpad (flash_attn's): sequence b attends to its cache rows leftpad[b] up to its
    length, masks aligned to those keys; the append lands at cache_seqlens[b] and rotary uses
    the rows' indices. Pads of 0, inside, at the length (no keys but the new ones)."""
    run_case(dtype, d, heads, kv_heads, seqlen_q, s_new, 1024, None, causal, window, softcap,
             rotary, splits, seqlens, 11, leftpad=leftpad)


def test_bad_cache_leftpad_gives_nan_rows_and_an_error(require_extension):
    """A cache_leftpad entry past its sequence's keys (or negative), on the device: NaN rows for
    that sequence, the others right, and the status names cache_leftpad; no access outside."""
    q, kc, vc = _small(batch=3)
    lens = torch.tensor([10, 20, 30], dtype=torch.int32, device="cuda")
    for bad in (21, -1):
        fa.kvcache_errors()  # clear
        pad = torch.tensor([0, bad, 5], dtype=torch.int32, device="cuda")
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=pad)
        assert out[1].isnan().all() and not out[[0, 2]].isnan().any(), bad
        ref = kvcache_reference(q, kc, vc, cache_seqlens=lens, cache_leftpad=pad.clamp(0, 0))
        assert (out[0].float() - ref.out[0]).abs().max() < 5e-3
        assert any("cache_leftpad" in e for e in fa.kvcache_errors()), bad


def _small(dtype=torch.float16, batch=2, cache=32):
    q = torch.randn(batch, 1, 4, 64, device="cuda", dtype=dtype)
    kc = torch.randn(batch, cache, 2, 64, device="cuda", dtype=dtype)
    return q, kc, torch.randn_like(kc)


def test_refused_before_any_launch(require_extension):
    q, kc, vc = _small()
    k = torch.randn(2, 1, 2, 64, device="cuda", dtype=torch.float16)
    before = kc.clone()
    with pytest.raises(ValueError, match="cache_leftpad does not go with block_table"):
        flash_attn_with_kvcache(q, kc, vc, cache_leftpad=torch.zeros(2, dtype=torch.int32,
                                                                     device="cuda"),
                                block_table=torch.zeros(2, 1, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="cache_leftpad has 3 entries"):
        flash_attn_with_kvcache(q, kc, vc, cache_leftpad=torch.zeros(3, dtype=torch.int32,
                                                                     device="cuda"))
    with pytest.raises(TypeError, match="cache_leftpad must be int32"):
        flash_attn_with_kvcache(q, kc, vc, cache_leftpad=torch.zeros(2, device="cuda"))
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flash_attn_with_kvcache(q, kc, vc, alibi_slopes=torch.zeros(4, device="cuda"))
    with pytest.raises(ValueError, match="does not fit the cache"):  # host lengths
        flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=torch.tensor([3, 32],
                                                                           dtype=torch.int32))
    with pytest.raises(ValueError, match="does not fit the cache"):
        flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=32)
    with pytest.raises(ValueError, match="new rows"):
        big = torch.randn(2, 40, 2, 64, device="cuda", dtype=torch.float16)
        flash_attn_with_kvcache(q, kc, vc, big, big, cache_seqlens=0)
    with pytest.raises(TypeError, match="k_cache has dtype"):
        flash_attn_with_kvcache(q, kc.bfloat16(), vc.bfloat16())
    with pytest.raises(ValueError, match="d_head of k_cache"):
        flash_attn_with_kvcache(q, kc[..., :32], vc[..., :32])
    with pytest.raises(ValueError, match="block_table has 1 rows"):
        flash_attn_with_kvcache(q, kc, vc, block_table=torch.zeros(1, 2, dtype=torch.int32,
                                                                  device="cuda"))
    with pytest.raises(ValueError, match="batch of the cache"):
        flash_attn_with_kvcache(q, kc[:1], vc[:1])
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, k, k)
    strided = torch.randn(2, 32, 64, 2, device="cuda", dtype=torch.float16).transpose(2, 3)
    with pytest.raises(ValueError, match="addressed in place"):
        flash_attn_with_kvcache(q, strided, strided)
    assert torch.equal(kc, before), "a refused call wrote the cache"


def _guarded(batch, rows, hk, d, dtype, guard=64):
    """A cache inside a buffer with guard rows on both sides, to see writes outside it."""
    buf = torch.randn(batch * rows + 2 * guard, hk, d, device="cuda", dtype=dtype)
    return buf, buf[guard:guard + batch * rows].view(batch, rows, hk, d)


def test_bad_device_metadata_gives_nan_and_a_status(require_extension):
    fa.kvcache_errors()  # clear
    dt = torch.bfloat16
    q = torch.randn(3, 1, 4, 64, device="cuda", dtype=dt)
    kbuf, kc = _guarded(3, 32, 2, 64, dt)
    vbuf, vc = _guarded(3, 32, 2, 64, dt)
    k = torch.randn(3, 1, 2, 64, device="cuda", dtype=dt)
    kguard, vguard = kbuf.clone(), vbuf.clone()
    lens = torch.tensor([5, 32, -3], dtype=torch.int32, device="cuda")  # 32 + 1 and -3: bad
    out = flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all() and torch.isnan(out[2]).all()
    changed = (kbuf != kguard).any(-1).any(-1).nonzero().flatten().tolist()
    assert changed == [64 + 5], f"rows written outside sequence 0's new row: {changed}"
    assert torch.equal(vbuf[:64], vguard[:64]) and torch.equal(vbuf[-64:], vguard[-64:])
    errors = fa.kvcache_errors()
    assert any("cache length" in e for e in errors), errors
    with pytest.raises(ValueError, match="bad cache metadata"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
        fa.check_kvcache()
    # a page outside the pool, and a cache_batch_idx outside the batch
    pool = torch.randn(4, 16, 2, 64, device="cuda", dtype=dt)
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32, device="cuda")
    # The table's kernel over 16-row pages has 16-key blocks (one page each); d_head 64's row
    # kernel has 32-key blocks, whose second 16-row group holds the bad page.
    from flash_attention import kvcache
    from flash_attention.kernels import Call, dec_sm80

    row = dec_sm80.select(Call("bf16", 64), kvcache.built())
    kernels = [""] + ([row.name] if row is not None and row.block_c > 16 else [])
    for kernel, splits in itertools.product(kernels, (0, 2, 20)):  # the bad page in one split
        out = flash_attn_with_kvcache(q[:2], pool, pool, cache_seqlens=torch.tensor(
            [20, 20], dtype=torch.int32, device="cuda"), block_table=table, num_splits=splits,
            kernel=kernel)
        assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all(), (kernel, splits)
        assert any("block_table" in e for e in fa.kvcache_errors()), (kernel, splits)
    idx = torch.tensor([0, 7, 1], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, cache_batch_idx=idx)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    assert any("cache_batch_idx" in e for e in fa.kvcache_errors())
    assert fa.kvcache_errors() == []


def test_rotary_position_past_the_table_gives_nan_rows_and_an_error(require_extension):
    """Lengths on the device (unchecked on the host): a sequence whose rotary position is past
    rotary_cos's rows gets NaN rows (q is rotated in the decode kernel, its new key in the
    append) and the rotary status bit; the other sequence is exact."""
    fa.kvcache_errors()  # clear
    dt = torch.bfloat16
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=dt)
    kc = torch.randn(2, 32, 2, 64, device="cuda", dtype=dt)
    vc = torch.randn_like(kc)
    cos, sin = angles(10, 64, dt)
    lens = torch.tensor([3, 20], dtype=torch.int32, device="cuda")  # row 20 is past 10 rows
    for new in (None, torch.randn(2, 1, 2, 64, device="cuda", dtype=dt)):
        kc2, vc2 = kc.clone(), vc.clone()
        out = flash_attn_with_kvcache(q, kc2, vc2, new, new, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=lens)
        one = None if new is None else new[:1]
        ref = kvcache_reference(q[:1], kc[:1], vc[:1], one, one, rotary_cos=cos, rotary_sin=sin,
                                cache_seqlens=lens[:1])
        assert torch.isnan(out[1]).all(), new is None
        assert (out[0].float() - ref.out[0]).abs().max() < 2e-2, new is None
        assert torch.equal(kc2[0], ref.k_cache[0]), new is None
        errors = fa.kvcache_errors()
        assert any("rotary" in e for e in errors), errors


# ---- CUDA graphs and torch.compile --------------------------------------------------------------

def test_cuda_graph_replays_with_changing_lengths(require_extension):
    torch.manual_seed(3)
    dt = torch.bfloat16
    batch, hk, d = 4, 2, 128
    q = torch.randn(batch, 1, 8, d, device="cuda", dtype=dt)
    k = torch.randn(batch, 1, hk, d, device="cuda", dtype=dt)
    pool = torch.randn(64, 16, hk, d, device="cuda", dtype=dt)
    vpool = torch.randn_like(pool)
    table = torch.randperm(64, device="cuda")[:batch * 16].view(batch, 16).to(torch.int32)
    lens = torch.tensor([3, 100, 0, 200], dtype=torch.int32, device="cuda")

    def step():
        return flash_attn_with_kvcache(q, pool, vpool, k, k, cache_seqlens=lens,
                                       block_table=table, causal=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up (writes rows 3, 100, 0, 200)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for new in ([7, 150, 1, 255], [0, 0, 0, 0], [250, 5, 64, 33]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        kp, vp = pool.clone(), vpool.clone()
        graph.replay()
        torch.cuda.synchronize()
        want = flash_attn_with_kvcache(q, kp, vp, k, k, cache_seqlens=lens, block_table=table,
                                       causal=True)
        assert torch.equal(out, want), new
        assert torch.equal(pool, kp) and torch.equal(vpool, vp), new


def test_compile_fullgraph_decode_step(require_extension):
    torch.manual_seed(4)
    dt = torch.float16
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=dt)
    k = torch.randn(2, 1, 2, 64, device="cuda", dtype=dt)
    kc = torch.zeros(2, 32, 2, 64, device="cuda", dtype=dt)
    vc = torch.zeros_like(kc)
    lens = torch.tensor([0, 5], dtype=torch.int32, device="cuda")

    def step(q, k, kc, vc, lens):
        out = flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens, causal=True)
        return out * 2

    compiled = torch.compile(step, fullgraph=True)
    kc2, vc2 = kc.clone(), vc.clone()
    got = compiled(q, k, kc, vc, lens)
    want = step(q, k, kc2, vc2, lens)
    assert torch.equal(got, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and kc[1, 5].abs().sum() > 0


# ---- flash_attn_varlen_func over a paged cache / seqused_k --------------------------------------

@pytest.mark.parametrize("page", [None, 1, 16, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_block_table_and_seqused_k(require_extension, page, causal):
    """A mixed batch (prefill chunks and decode rows) against the per-sequence reference."""
    from flash_attention.interface import flash_attn_varlen_func
    from flash_attention.reference import attention_reference

    torch.manual_seed(5)
    dt, hk, heads, d = torch.bfloat16, 2, 8, 64
    lens_q = [1, 7, 0, 33, 1]
    lens_k = [40, 7, 5, 100, 1]
    used = [40, 5, 0, 90, 1]  # seqused_k: the first keys of each sequence
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    q = torch.randn(sum(lens_q), heads, d, device="cuda", dtype=dt)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    if page is None:
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                             causal=causal, return_attn_probs=True,
                                             seqused_k=seqused)
    else:
        per = -(-max(lens_k) // page)
        pages = len(lens_k) * per + 2
        table = torch.randperm(pages, device="cuda")[:len(lens_k) * per].view(-1, per)
        table = table.to(torch.int32)
        kp = torch.randn(pages, page, hk, d, device="cuda", dtype=dt)
        vp = torch.randn_like(kp)
        for b, n in enumerate(lens_k):
            rows_k = kp[table[b].long()].flatten(0, 1)
            rows_v = vp[table[b].long()].flatten(0, 1)
            rows_k[:n] = k[cu_k[b]:cu_k[b] + n]
            rows_v[:n] = v[cu_k[b]:cu_k[b] + n]
            kp[table[b].long()] = rows_k.view(per, page, hk, d)
            vp[table[b].long()] = rows_v.view(per, page, hk, d)
        out, lse, _ = flash_attn_varlen_func(q, kp, vp, cu_q, cu_k, max(lens_q), max(lens_k),
                                             causal=causal, return_attn_probs=True,
                                             block_table=table, seqused_k=seqused)
    assert out.shape == q.shape and lse.shape == (heads, q.shape[0])
    for b in range(len(lens_q)):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b]) + used[b])
        if lens_q[b] == 0:
            continue
        ref, ref_lse = attention_reference(q[None, rq], k[None, rk], v[None, rk], causal=causal)
        low, _ = attention_reference(q[None, rq], k[None, rk], v[None, rk], causal=causal,
                                     upcast=False)
        err = (out[rq].float() - ref[0]).abs().max().item()
        err_pt = (low[0].float() - ref[0]).abs().max().item()
        assert err <= 2 * err_pt + ABS_FLOOR, (b, err, err_pt)
        empty = torch.isinf(ref_lse[0])
        assert torch.equal(torch.isinf(lse[:, rq]), empty), b
        torch.testing.assert_close(lse[:, rq][~empty], ref_lse[0][~empty], atol=2e-3, rtol=1e-4)
