"""The decode kernels' tile heights (CPU): 16-row and 32-row configs (dec_sm80.Config's B_r),
which calls the table gives 32-row tiles (dec_sm80.runs_wide, select_for) and the decode
table's rows per tile height (kvcache.dispatch_rows, bucket = B_r)."""

from __future__ import annotations

import pytest

from flash_attention import kvcache
from flash_attention.kernels import Call, ConfigError, dec_sm80, parse


def test_wide_configs_and_their_limits():
    cfg = parse("dec_sm80_bf16_d128_r32_c16_w4_f")
    assert cfg.block_r == 32 and cfg.name == "dec_sm80_bf16_d128_r32_c16_w4_f"
    # Q of 32 rows, then the 16-row kernel's stages
    assert cfg.smem_bytes == 32 * 256 + 4 * 3 * 2 * 16 * 256
    assert cfg.smem_bytes - parse("dec_sm80_bf16_d128_r16_c16_w4_f").smem_bytes == 16 * 256
    assert "32 packed rows" in cfg.describe()
    with pytest.raises(ConfigError, match="d_head <= 128 and a 16-bit cache"):
        parse("dec_sm80_bf16_d256_r32_c16_w2_f")
    with pytest.raises(ConfigError, match="d_head <= 128 and a 16-bit cache"):
        parse("dec_sm80_bf16_e4m3_d128_r32_c32_w4_f")
    with pytest.raises(ConfigError, match="B_r"):
        parse("dec_sm80_bf16_d128_r64_c16_w4_f")
    tune = dec_sm80.SETS["tune"]
    assert {c.block_r for c in tune} == {16, 32}
    assert all(c.d_head <= 128 and not c.cache for c in tune if c.block_r == 32)
    wide_default = {c.name for c in dec_sm80.DEFAULT if c.block_r == 32}
    assert wide_default == {f"dec_sm80_{dt}_d{d}_r32_{tile}" for dt in ("fp16", "bf16")
                            for d, tile in ((64, "c32_w4_f"), (128, "c16_w4_f"))}


def test_which_calls_run_wide_tiles():
    mib = 2**20
    assert 128 * mib == dec_sm80.WIDE_MIN_BYTES
    # 8 speculative positions x GQA groups of 4 = 32 rows; 4 x 4 = 16 rows stay 16-row
    assert dec_sm80.packed_rows(8, 32, 8) == 32 and dec_sm80.packed_rows(4, 32, 8) == 16
    assert dec_sm80.kv_bytes(4, 8, 8192, 128) == 128 * mib
    assert dec_sm80.kv_bytes(4, 8, 8192, 128, "e4m3") == 64 * mib
    assert dec_sm80.runs_wide(32, 128 * mib) and dec_sm80.runs_wide(17, 2**40)
    assert not dec_sm80.runs_wide(16, 2**40) and not dec_sm80.runs_wide(32, 128 * mib - 1)
    built = dec_sm80.DEFAULT
    big, small = 512 * mib, 32 * mib
    assert dec_sm80.select_for(Call("bf16", 128), built, 32, big).block_r == 32
    assert dec_sm80.select_for(Call("bf16", 96), built, 32, big).name == \
        "dec_sm80_bf16_d128_r32_c16_w4_f"
    assert dec_sm80.select_for(Call("fp16", 40), built, 64, big).name == \
        "dec_sm80_fp16_d64_r32_c32_w4_f"
    assert dec_sm80.select_for(Call("bf16", 128), built, 32, small).block_r == 16
    assert dec_sm80.select_for(Call("bf16", 128), built, 16, big).block_r == 16
    # no 32-row kernel above d_head 128 or over an FP8 cache, nor in a build without one
    assert dec_sm80.select_for(Call("bf16", 256), built, 64, big).block_r == 16
    assert dec_sm80.select_for(Call("bf16", 128), built, 64, big, "e4m3").cache == "e4m3"
    assert dec_sm80.select_for(Call("bf16", 128), built, 64, big, "e4m3").block_r == 16
    narrow = [c for c in built if c.block_r == 16]
    assert dec_sm80.select_for(Call("bf16", 128), narrow, 32, big).block_r == 16
    assert dec_sm80.select(Call("bf16", 128), narrow, wide=True) is None


def test_which_calls_run_the_deep_kernel():
    """The deep kernel (8 warps, more shared memory than sm_80 gives) for calls whose 16-row
    tiles fill a third of the SMs to all of them, one CTA each, on sm_90 alone; never a d_head
    fallback."""
    deep = parse("dec_sm80_bf16_d128_r16_c16_w8_f")
    assert deep.sm90_only and "sm_90 only" in deep.describe()
    assert deep in dec_sm80.SETS["deep"] and deep in dec_sm80.DEFAULT
    assert [c for c in dec_sm80.DEFAULT if c.sm90_only] == list(dec_sm80.DEEP)
    # one split over more than half the SMs up to one tile per SM, two over a third to a half
    assert [dec_sm80.deep_splits(t, 1024, 132) for t in (45, 66, 67, 128, 132, 133)] == \
        [0, 0, 1, 1, 1, 0]
    assert [dec_sm80.deep_splits(t, 2048, 132) for t in (44, 45, 66, 67)] == [0, 2, 2, 1]
    assert dec_sm80.deep_splits(128, 1023, 132) == 0  # a split of 1024 keys at least
    assert dec_sm80.deep_splits(128, 131072, 132) == 1
    assert dec_sm80.runs_deep(80, 4096, 132) and not dec_sm80.runs_deep(160, 1024, 132)
    built, mib = dec_sm80.DEFAULT, 2**20
    pick = dec_sm80.select_for
    assert pick(Call("bf16", 128), built, 4, 64 * mib, tiles=128, keys=1024, sms=132) == deep
    assert pick(Call("bf16", 96), built, 4, 64 * mib, tiles=128, keys=1024, sms=132) == deep
    assert pick(Call("bf16", 128), built, 4, 64 * mib, tiles=128, keys=1024).warps == 4
    assert pick(Call("bf16", 64), built, 4, 64 * mib, tiles=128, keys=1024, sms=132).warps == 4
    assert pick(Call("bf16", 128), built, 4, 64 * mib, "e4m3", tiles=128, keys=1024,
                sms=132).cache == "e4m3"
    # the wide tiles first; select never takes an sm_90-only kernel
    assert pick(Call("bf16", 128), built, 32, 128 * mib, tiles=128, keys=1024,
                sms=132).block_r == 32
    assert dec_sm80.select(Call("bf16", 128), [deep]) is None
    assert dec_sm80.select_deep(Call("bf16", 128), [c for c in built if c != deep]) is None
    assert pick(Call("bf16", 128), [c for c in built if c != deep], 4, 64 * mib, tiles=128,
                keys=1024, sms=132).warps == 4  # not built: the 4-warp kernel
    assert pick(Call("bf16", 128), built, 4, 64 * mib, tiles=160, keys=1024,
                sms=132).warps == 4  # more tiles than SMs
    # a GPU that cannot give the deep kernel's shared memory (an A100's 163 KB) keeps 4 warps
    assert pick(Call("bf16", 128), built, 4, 64 * mib, tiles=100, keys=1024, sms=108,
                smem=163 * 1024).warps == 4
    assert [dec_sm80.heuristic_splits(t, k, 132) for t, k in
            ((128, 1024), (128, 4096), (211, 8192), (16, 8192), (8, 300))] == [1, 2, 1, 16, 2]


def test_which_paged_calls_run_the_small_page_kernel():
    """Pages of a multiple of 16 rows that the row kernel's B_c does not divide (16, 48 at
    d_head 64) run the row's small-page kernel (16-key blocks) where it is built; every other
    page size, contiguous caches, wide and deep calls keep their kernel."""
    assert [dec_sm80.small_pages(p, 32) for p in (0, 1, 7, 16, 32, 48, 64, 256)] == \
        [False, False, False, True, False, True, False, False]
    assert not dec_sm80.small_pages(16, 16)
    built, mib = dec_sm80.DEFAULT, 2**20
    small = {f"dec_sm80_{dt}_d64_r16_c16_w4_f" for dt in ("fp16", "bf16")}
    assert small <= {c.name for c in built}
    pick = dec_sm80.select_for
    for d in (64, 40):
        assert pick(Call("bf16", d), built, 4, mib, page_size=16).name == \
            "dec_sm80_bf16_d64_r16_c16_w4_f"
        assert pick(Call("fp16", d), built, 4, mib, page_size=48).block_c == 16
        for page in (0, 7, 32, 64, 256):
            assert pick(Call("bf16", d), built, 4, mib, page_size=page).block_c == 32
    # the d_head 128 row's blocks are 16 keys already; wide calls and FP8 caches keep theirs
    assert pick(Call("bf16", 128), built, 4, mib, page_size=16).name == \
        "dec_sm80_bf16_d128_r16_c16_w4_f"
    assert pick(Call("bf16", 64), built, 32, 512 * mib, page_size=16).block_r == 32
    assert pick(Call("bf16", 64), built, 4, mib, "e4m3", page_size=16).cache == "e4m3"
    assert pick(Call("bf16", 64), built, 4, mib, "e4m3", page_size=16).block_c == 64
    # never a d_head variant of its own: not built, the row kernel
    without = [c for c in built if c.name not in small]
    assert pick(Call("bf16", 64), without, 4, mib, page_size=16).block_c == 32
    assert dec_sm80.select(Call("bf16", 64), built).block_c == 32


def test_decode_table_rows_per_tile_height():
    rows = kvcache.dispatch_rows(dec_sm80.DEFAULT)
    keys = [(r[0], r[1], r[2]) for r in rows]
    assert len(keys) == len(set(keys))
    assert {r[2] for r in rows} == {16, 32, dec_sm80.SMALL_PAGE_BUCKET}
    pages = {(r[0], r[1]): r[6] for r in rows if r[2] == dec_sm80.SMALL_PAGE_BUCKET}
    assert pages == {(dt, d): f"dec_sm80_{dt}_d64_r16_c16_w4_f" for dt in ("fp16", "bf16")
                     for d in (32, 64)}
    rows = [r for r in rows if r[2] != dec_sm80.SMALL_PAGE_BUCKET]
    for r in rows:  # the bucket is the row kernel's B_r, its own fallback
        assert parse(r[6]).block_r == r[2] and r[6] == r[7]
    wide = {(r[0], r[1]) for r in rows if r[2] == 32}
    assert wide == {(dt, d) for dt in ("fp16", "bf16") for d in (32, 64, 96, 128)}
    deep = {(r[0], r[1]): r[9] for r in rows if r[9]}  # the one-wave column
    without = [c for c in dec_sm80.DEFAULT if c not in dec_sm80.DEEP]
    assert not any(r[9] for r in kvcache.dispatch_rows(without))
    assert deep == {(dt, d): f"dec_sm80_{dt}_d128_r16_c16_w8_f" for dt in ("fp16", "bf16")
                    for d in (96, 128)}
    assert all(r[2] == 16 and not parse(r[6]).sm90_only for r in rows if r[9])
    assert ("bf16", 128, 16) in keys and ("bf16_e4m3", 128, 16) in keys
    assert not any(r[2] == 32 for r in kvcache.dispatch_rows(dec_sm80.SETS["ci"][:2]))
