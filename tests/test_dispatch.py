"""Dispatch: tuning file first, then the default table, then any built kernel of the type."""

from __future__ import annotations

import json

import pytest

from flash_attention import dispatch
from flash_attention.kernels import Call, ConfigError, fwd_sm80, fwd_sm90, parse, resolve
from flash_attention.kernels.legacy import current_name

DEFAULT = resolve("fwd:default")  # the default set of both forward kinds
TUNE = fwd_sm80.SETS["tune"]


@pytest.fixture(autouse=True)
def fresh_tuning_cache():
    dispatch.reload_tuning()
    yield
    dispatch._tuning = None


@pytest.fixture
def no_tuning(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_ATTENTION_TUNING_FILE", str(tmp_path / "none.json"))
    dispatch.reload_tuning()
    return tmp_path


def test_buckets():
    assert dispatch.seq_bucket(1) == 64
    assert dispatch.seq_bucket(64) == 64
    assert dispatch.seq_bucket(65) == 128
    assert dispatch.seq_bucket(4096) == 4096
    assert dispatch.seq_bucket(10**6) == 16384
    assert dispatch.tuning_key("bf16", 128, 3000) == "bf16/d128/q4096"


def test_default_table(no_tuning):
    built = list(DEFAULT)
    short = dispatch.select("bf16", 128, 32, built)
    long = dispatch.select("bf16", 128, 4096, built)
    assert short.name == "fwd_sm80_bf16_d128_r64_c64_w4_fseqkvbor"
    assert long.name == "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"
    assert dispatch.select("fp16", 64, 4096, built).name == (
        "fwd_sm80_fp16_d64_r128_c64_w4_fsekvbor")


def test_fallback_to_any_built(no_tuning):
    only = [parse("fwd_sm80_fp16_d64_r64_c32_w4_fqkv")]
    assert dispatch.select("fp16", 64, 4096, only) == only[0]


def test_tuning_file_wins_when_built(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    tuned = parse("fwd_sm80_bf16_d128_r64_c128_w4_fseqkvbor")
    assert tuned in TUNE and tuned not in DEFAULT
    unbuilt = "fwd_sm80_bf16_d128_r64_c32_w4_fseqkvbor"
    path.write_text(json.dumps({"version": 1, "device": "x",
                                "entries": {"bf16/d128/q4096": tuned.name,
                                            "bf16/d128/q2048": unbuilt}}))
    monkeypatch.setenv("FLASH_ATTENTION_TUNING_FILE", str(path))
    dispatch.reload_tuning()
    built = [*DEFAULT, tuned]
    assert dispatch.select("bf16", 128, 4000, built) == tuned
    # A tuned config that is not built falls back to the table.
    assert dispatch.select("bf16", 128, 2048, built).name == (
        "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor")


def test_broken_tuning_file_is_ignored(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    path.write_text("{not json")
    monkeypatch.setenv("FLASH_ATTENTION_TUNING_FILE", str(path))
    dispatch.reload_tuning()
    assert dispatch.select("bf16", 128, 4096, list(DEFAULT)) in DEFAULT


def test_features_pick_kernels_that_can_serve_them(no_tuning):
    built = list(DEFAULT)
    assert dispatch.select("bf16", 128, 4096, built, mask=True).name == \
        "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvborm"
    assert dispatch.select("bf16", 128, 32, built, mask=True).name == \
        "fwd_sm80_bf16_d128_r64_c64_w4_fseqkvborm"
    assert dispatch.select("fp16", 64, 32, built, softcap=True).name == \
        "fwd_sm80_fp16_d64_r128_c64_w4_fsekvbort"
    assert dispatch.select("fp16", 64, 4096, built, True, True).name == \
        "fwd_sm80_fp16_d64_r128_c64_w4_fsekvbormt"
    assert dispatch.tuning_key("bf16", 128, 3000, True, True) == "bf16/d128/q4096/mt"


def test_fallback_respects_features(no_tuning):
    masked = parse("fwd_sm80_bf16_d64_r64_c64_w4_fseqkvborm")
    capped = parse("fwd_sm80_bf16_d64_r64_c64_w4_fseqkvbort")
    # A kernel with masks serves an unmasked call; a softcap kernel serves softcap calls only.
    assert dispatch.select("bf16", 64, 100, [capped, masked]) == masked
    assert dispatch.select("bf16", 64, 100, [capped, masked], softcap=True) == capped
    with pytest.raises(ConfigError, match="no kernel for bf16 with d_head=64 with masks "
                                          r"\(causal / window\) and a softcap"):
        dispatch.select("bf16", 64, 100, [capped, masked], mask=True, softcap=True)


def test_hopper_kernels_by_mask_kind(no_tuning):
    """Plain calls run the persistent CTA-pair kernel, causal the dynamic masked one, windows
    bounded on the left the persistent masked one (at d_head 128 the static one, unlike causal; a
    window runs on the masked row's kernel when its own is not built); d_head 96 runs on the
    d128 tile, 32 has no Hopper kernel."""
    built = list(DEFAULT)
    pick = lambda d, mask, local=False, b=built: dispatch.select_sm90(  # noqa: E731
        "bf16", d, 4096, b, mask, False, local)
    assert pick(128, False).name == "fwd_sm90_bf16_d128_r128_c128_s2_fwialgz"
    assert pick(128, True).name == "fwd_sm90_bf16_d128_r128_c128_s2_fwaldgzm"
    assert pick(128, True, local=True).name == "fwd_sm90_bf16_d128_r128_c128_s2_fwialgzm"
    assert pick(128, False, local=True).name == (  # no mask
        "fwd_sm90_bf16_d128_r128_c128_s2_fwialgz")
    assert pick(96, True, local=True).name == "fwd_sm90_bf16_d128_r128_c128_s2_fwialgzm"
    assert pick(64, True, local=True).name == "fwd_sm90_bf16_d64_r192_c96_s3_fwalm"
    assert pick(256, True, local=True).name == "fwd_sm90_bf16_d256_r128_c64_s2_fwpiam"
    assert pick(32, True, local=True) is None
    no_local = [c for c in built if c.name != "fwd_sm90_bf16_d64_r192_c96_s3_fwalm"]
    assert pick(64, True, True, no_local).name == "fwd_sm90_bf16_d64_r192_c96_s3_fwaldm"
    softcap = lambda d, mask, b=built: dispatch.select_sm90(  # noqa: E731
        "bf16", d, 4096, b, mask, True).name
    assert softcap(128, False) == "fwd_sm90_bf16_d128_r128_c128_s2_fwpiazt"
    assert softcap(96, True) == "fwd_sm90_bf16_d128_r128_c128_s2_fwpiazmt"
    assert softcap(64, True) == "fwd_sm90_bf16_d64_r192_c96_s3_fwaldmt"
    assert softcap(256, False) == "fwd_sm90_bf16_d256_r128_c64_s2_fwpiazt"


def test_hopper_varlen_kernels_come_from_the_varlen_table(no_tuning):
    """Varlen calls run their kind's row of fwd_sm90.VARLEN_ROWS (flag j, then the call's
    features), whatever the bucket; none where the build lacks it or the kind has no row; the
    persistent dynamic d_head 128 tiles that gave wrong rows on the GPU are in neither the table
    nor the default set."""
    built = list(DEFAULT)
    pick = lambda d, mask=False, local=False, softcap=False, b=built: (  # noqa: E731
        dispatch.select_sm90_varlen("bf16", d, b, mask, softcap, local))
    assert pick(128).name == "fwd_sm90_bf16_d128_r128_c128_s2_fwpiazj"
    assert pick(96, True).name == pick(128, True, True).name == (
        "fwd_sm90_bf16_d128_r128_c128_s2_fwpiazjm")
    assert pick(128, softcap=True).name == "fwd_sm90_bf16_d128_r128_c128_s2_fwpiazjt"
    assert pick(64).name == "fwd_sm90_bf16_d64_r192_c96_s3_fwaldngzj"
    assert pick(64, True, True).name == "fwd_sm90_bf16_d64_r192_c96_s3_fwaldjm"
    assert pick(256, softcap=True).name == "fwd_sm90_bf16_d256_r128_c64_s2_fwpiazjt"
    assert pick(256, True, softcap=True).name == "fwd_sm90_bf16_d256_r128_c64_s2_fwpiazjmt"
    assert pick(32) is None
    assert pick(128, b=[c for c in built if not getattr(c, "varlen", False)]) is None
    assert not {"fwd_sm90_bf16_d128_r128_c128_s2_fwialdgzjm",
                "fwd_sm90_bf16_d128_r128_c128_s2_fwialdgzj"} & {c.name for c in built}
    for cfg in (c for c in built if getattr(c, "varlen", False)):
        assert not cfg.cluster
        assert not cfg.serves(Call(cfg.dtype, cfg.d_head, 4096, cfg.mask, False, cfg.softcap))
    with pytest.raises(ConfigError, match="varlen cannot take CTA pairs"):
        fwd_sm90.parse("fwd_sm90_bf16_d128_r128_c128_s2_fwalxgzj")


def test_hopper_rows_by_length(no_tuning):
    """d_head 128: CTA pairs with Q in registers and the lazy rescale at 1024-2048 (single
    CTAs at 512 and below), single CTAs with q, r and overlap from 4096; causal: the plain
    dynamic kernel to 2048, with q and r at 4096, with overlap too from 8192; a row's kernel
    missing from the
    build, another of its kind runs."""
    built = list(DEFAULT)
    pick = lambda seq, mask, b=built: dispatch.select_sm90(  # noqa: E731
        "fp16", 128, seq, b, mask, False).name.split("_")[-1]
    assert [pick(seq, False) for seq in (64, 512, 1024, 2048, 4096, 8192)] == [
        "fwal", "fwal", "fwalxgz", "fwalxgz", "fwialgz", "fwialgz"]
    assert [pick(seq, True) for seq in (512, 2048, 4096, 8192, 16384)] == [
        "fwaldm", "fwaldm", "fwaldgzm", "fwialdgzm", "fwialdgzm"]
    no_pairs = [c for c in built if not (c.family == "sm90" and c.cluster)]
    assert pick(2048, False, no_pairs) == "fwialgz"
    no_short = [c for c in built if c.name != "fwd_sm90_fp16_d128_r128_c128_s2_fwal"]
    assert pick(512, False, no_short) == "fwalxgz"


def test_tuning_file_of_old_names_reads_current_names(tmp_path, monkeypatch):
    """A tuning file written before the one name scheme names its kernels the old way; dispatch
    reads them as their current names (kernels.legacy.current_name), of either forward kind."""
    old_sm80, old_sm90 = "bf16_d128_r64_c128_w4_fseqkvbor", "sm90_bf16_d128_c128_g2_s2_fwpoe"
    tuned, tuned_sm90 = parse(current_name(old_sm80)), parse(current_name(old_sm90))
    assert tuned.name == "fwd_sm80_bf16_d128_r64_c128_w4_fseqkvbor"
    assert tuned_sm90.name == "fwd_sm90_bf16_d128_r128_c128_s2_fwpia"
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"version": 1, "device": "x",
                                "entries": {"bf16/d128/q4096": old_sm80,
                                            "bf16/d128/q8192": old_sm90}}))
    monkeypatch.setenv("FLASH_ATTENTION_TUNING_FILE", str(path))
    assert dispatch.reload_tuning() == {"bf16/d128/q4096": tuned.name,
                                        "bf16/d128/q8192": tuned_sm90.name}
    built = [*DEFAULT, tuned, tuned_sm90]
    assert dispatch.select("bf16", 128, 4000, built) == tuned
    assert dispatch.select_sm90("bf16", 128, 8000, built) == tuned_sm90
    # an sm80 kernel tuned for the row: no Hopper kernel runs it
    assert dispatch.select_sm90("bf16", 128, 4000, built) is None


def test_rows_name_kernels_without_the_features(no_tuning):
    """A row's kernel is the name past <kind>_<dtype>_d<variant>_ without the feature letters
    (m, t): the table appends the call's. sm80 rows serve windows bounded on the left
    ("local") too; table_rows and select of each kind agree with dispatch."""
    from flash_attention.kernels import Call, fwd_sm90

    for module in (fwd_sm80, fwd_sm90):
        for row in module.ROWS:
            flags = row.kernel.rsplit("_f", 1)[1]
            assert not set(flags) & {"m", "t"}, row.key
            assert row.kernel.startswith("r"), row.key
    assert all("local" in row.calls for row in fwd_sm80.ROWS)
    call = Call("bf16", 104, 4096, mask=True, local=True)
    assert fwd_sm80.table_rows(call) == [(64, "fwd_sm80_bf16_d128_r64_c64_w4_fseqkvborm"),
                                         (None, "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvborm")]
    assert fwd_sm90.table_rows(call) == [(None, "fwd_sm90_bf16_d128_r128_c128_s2_fwialgzm")]
    assert fwd_sm80.table_rows(Call("bf16", 40, softcap=True, mask=True)) == [
        (None, "fwd_sm80_bf16_d64_r128_c64_w4_fsekvbormt")]
    assert fwd_sm80.table_rows(Call("bf16", 12)) == fwd_sm90.table_rows(Call("bf16", 12)) == []
    for dtype, d, seq, mask, local, softcap in [("bf16", 128, 4096, True, True, False),
                                                 ("fp16", 64, 32, False, False, True),
                                                 ("bf16", 200, 100, True, False, False)]:
        call = Call(dtype, d, seq, mask, local, softcap)
        assert fwd_sm90.select(call, DEFAULT) == dispatch.select_sm90(dtype, d, seq, DEFAULT,
                                                                      mask, softcap, local)
        assert fwd_sm80.select(call, DEFAULT) == dispatch.select(dtype, d, seq, DEFAULT, mask,
                                                                 softcap)


def test_one_wave_column_of_the_dispatch_rows():
    """Plain 16-bit rows at d_head 64 and 96/128 carry the one-wave tiers (B_r 64, then the
    B_r 128 ping-pong tile), in every bucket; masked, softcap and d_head 256 rows none; a build
    without the tiers none."""
    from flash_attention import ops
    from flash_attention.kernels import fwd_sm90

    rows = ops.dispatch_rows(tuple(fwd_sm90.DEFAULT))
    for dtype, d, bucket, mask, _, softcap, _, _, _, one_wave, key_pad in rows:
        # B_c 96 for plain d_head 96/128 calls up to 512 queries (the extension compares the
        # keys' padding per call)
        assert key_pad == (f"fwd_sm90_{dtype}_d128_r128_c96_s2_fwal" if (
            dtype != "e4m3" and d in (96, 128) and not mask and not softcap and bucket <= 512)
            else ""), (dtype, d, bucket, mask, softcap)
        if dtype == "e4m3" or mask or softcap or d > 128 or d < 64:
            assert one_wave == "", (dtype, d, bucket, mask, softcap)
        else:
            dk = 64 if d == 64 else 128
            assert one_wave == (f"fwd_sm90_{dtype}_d{dk}_r64_c128_s2_fwia,"
                                f"fwd_sm90_{dtype}_d{dk}_r128_c128_s2_fwpia"), (dtype, d, bucket)
    without = tuple(c for c in fwd_sm90.DEFAULT if c.block_r != 64)
    assert {r[9] for r in ops.dispatch_rows(without) if r[0] != "e4m3"} <= {
        "", *(f"fwd_sm90_{dt}_d{dk}_r128_c128_s2_fwpia" for dt in ("fp16", "bf16")
              for dk in (64, 128))}
