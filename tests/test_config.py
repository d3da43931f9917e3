"""Kernel configs: short-form round trips, validity rules, derived sizes, named sets."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from flash_attention.config import FLAGS, ConfigError, KernelConfig, parse_config
from flash_attention.config_sets import (
    CI,
    DEFAULT,
    PROG,
    PROG_STEPS,
    SETS,
    SM90_PROG_STEPS,
    TUNE,
    resolve,
)
from flash_attention.config_sm90 import Sm90Config
from flash_attention.dispatch import DEFAULT_TABLE, SM90_TABLE

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cfg", SETS["all"], ids=str)
def test_short_form_round_trip(cfg):
    assert parse_config(cfg.short) == cfg
    assert parse_config(cfg.short).short == cfg.short
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.short), "short form must be a C identifier"


def test_short_form_example():
    cfg = KernelConfig("bf16", 128, 128, 64, 4)
    assert cfg.short == "bf16_d128_r128_c64_w4_fseqkvbor"
    small = KernelConfig("fp16", 64, 64, 32, 4)
    plain = small.replace(**{name: name == "slice_q" for name in FLAGS})
    assert plain.short == "fp16_d64_r64_c32_w4_fq"


@pytest.mark.parametrize(
    "text, message",
    [
        ("bf16_d128_r128_c64_w4", "cannot parse"),
        ("fp32_d128_r128_c64_w4_f", "cannot parse"),
        ("bf16_d128_r128_c64_w4_fx", "cannot parse"),
        ("bf16_d128_r128_c64_w4_frs", "in that order"),
        ("bf16_d80_r128_c64_w4_fqkv", "d_head must be one of"),
        ("bf16_d256_r128_c64_w4_fqkv", "8 warps above d_head 128"),
        ("bf16_d256_r128_c128_w8_fqkv", "shared memory"),
        ("bf16_d128_r32_c64_w4_fqkv", "B_r must be one of"),
        ("bf16_d128_r128_c48_w4_fqkv", "B_c must be one of"),
        ("bf16_d128_r128_c64_w2_fqkv", "warps must be one of"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        KernelConfig.parse(text)


def test_d_head_variants_and_padding():
    from flash_attention.config import D_HEADS, smem_d_head, variant_for

    assert tuple(range(32, 257, 32)) == D_HEADS
    assert [variant_for(d) for d in (8, 32, 40, 64, 72, 96, 136, 200, 256)] == [
        32, 32, 64, 64, 96, 96, 160, 224, 256]
    assert [variant_for(d) for d in (0, -8, 12, 100, 264)] == [None] * 5
    # smem rows are whole 8-chunk swizzle groups: 96 pads to 128, 160..224 to 256.
    assert [smem_d_head(d) for d in D_HEADS] == [64, 64, 128, 128, 256, 256, 256, 256]
    assert KernelConfig.parse("bf16_d96_r128_c64_w4_fqkv").smem_bytes == (128 + 128) * 128 * 2


def test_rows_per_warp_rule():
    with pytest.raises(ConfigError, match="multiple of 16"):
        KernelConfig("fp16", 64, 64, 64, 8)


def test_double_buffer_needs_a_sliced_operand():
    with pytest.raises(ConfigError, match="double_buffer needs"):
        KernelConfig("fp16", 64, 64, 32, 4, slice_q=False, slice_k=False, slice_v=False)
    # The same without double buffering is fine.
    KernelConfig("fp16", 64, 64, 32, 4, slice_q=False, slice_k=False, slice_v=False,
                 double_buffer=False)


def test_register_budget_rule():
    # B_r=128 over 4 warps with B_c=128 and d=128: 256 accumulator registers per thread.
    with pytest.raises(ConfigError, match="over the budget"):
        KernelConfig("bf16", 128, 128, 128, 4)
    # Whole-block K at B_c=64, d=128 needs 128 more registers than the sliced form: it fits
    # beside one m-tile of accumulators (96 + 128 = 224) but not beside two (192 + 128).
    KernelConfig("bf16", 128, 64, 64, 4, slice_k=False)
    with pytest.raises(ConfigError, match="over the budget"):
        KernelConfig("bf16", 128, 128, 64, 4, slice_k=False)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        KernelConfig("fp8", 80, 64, 64, 4)
    assert "dtype" in str(info.value) and "d_head" in str(info.value)


def test_derived_sizes():
    cfg = KernelConfig.parse("bf16_d128_r128_c64_w4_fseqkvbor")
    assert cfg.threads == 128 and cfg.rows_per_warp == 32 and cfg.m_tiles == 2
    assert cfg.smem_bytes == (128 + 2 * 64) * 128 * 2
    assert cfg.accum_regs == 2 * (16 + 8) * 4
    # Occupancy: limited by registers (255 -> 256 per thread x 128 threads = 2 CTAs).
    assert cfg.ctas_per_sm(90, regs_per_thread=255) == 2
    # 96 registers: 5 CTAs by registers, but smem (65 KB each) allows 3 on sm_90, 2 on sm_80.
    assert cfg.ctas_per_sm(90, regs_per_thread=96) == 3
    assert cfg.ctas_per_sm(80, regs_per_thread=96) == 2
    with pytest.raises(ConfigError, match="unknown architecture"):
        cfg.ctas_per_sm(75)


def test_sets_sizes_and_content():
    sm80 = [c for c in CI if c.family == "sm80"]
    sm90 = [c for c in CI if c.family == "sm90"]
    assert 1 <= len(sm80) <= 6 and len(sm90) == 4  # CI builds four Hopper kernels for sm_90a
    for name in FLAGS:  # every flag is switched off by at least one CI config
        assert any(not getattr(c, name) for c in sm80), name
        assert any(getattr(c, name) for c in sm80), name
    assert {c.dtype for c in sm80} == {"fp16", "bf16"}
    assert {c.d_head for c in sm80} == {64, 128, 160}  # 160: a non-power-of-two, padded variant
    assert {c.block_c for c in sm80} == {32, 64, 128}
    assert {c.warps for c in sm80} == {4, 8}
    assert sm90[0].mask and sm90[0].warp_spec and sm90[0].pingpong  # every technique, masks
    # ... and the dispatched causal d_head 128 kernel: persistent, dynamic tile schedule
    assert sm90[1].mask and sm90[1].persistent and sm90[1].dynamic
    # ... and the dispatched non-causal d_head 128 kernel: persistent, CTA pairs
    assert not sm90[2].mask and sm90[2].persistent and sm90[2].cluster
    # ... and the dispatched non-causal d_head 64 kernel: three warpgroups, tile hand-over
    assert sm90[3].consumer_wgs == 3 and sm90[3].tile_overlap
    from flash_attention.config_sm90 import FLAGS as SM90_FLAGS

    for name in SM90_FLAGS:  # every Hopper flag but softcap is on in one of them
        assert name == "softcap" or any(getattr(c, name) for c in sm90), name
    table = {short for rows in DEFAULT_TABLE.values() for _, short in rows}
    assert {c.short for c in DEFAULT} == table | {short for rows in SM90_TABLE.values()
                                                  for _, short in rows}
    assert len(TUNE) == len(set(TUNE)) and len(TUNE) > len(DEFAULT)
    # The tune space holds every default tile; the features (masks, softcap) ride on a tile.
    assert {c.replace(mask=False, softcap=False) for c in DEFAULT if c.family == "sm80"} <= set(
        TUNE)


def test_sm90_configs_round_trip_and_rules():
    cfg = Sm90Config("bf16", 128, 128, 2, 2)
    assert cfg.short == "sm90_bf16_d128_c128_g2_s2_fwpoe" and cfg.block_r == 128
    assert parse_config(cfg.short) == cfg and cfg.threads == 384
    assert cfg.replace(warp_spec=False, pingpong=False).threads == 256
    for text, message in [
        ("sm90_bf16_d96_c128_g2_s2_f", "d_head must be one of"),
        ("sm90_bf16_d128_c80_g2_s2_f", "B_c must be one of"),
        ("sm90_bf16_d128_c128_g1_s2_fwp", "pingpong needs two consumer warpgroups"),
        ("sm90_bf16_d256_c192_g2_s2_fw", "registers"),
        ("sm90_bf16_d256_c64_g2_s2_fwpoeq", "registers"),  # Q's 64 fragment registers too
        ("sm90_bf16_d256_c128_g2_s3_fw", "shared memory"),
        ("sm90_bf16_d128_c128_g2_s2_fpw", "in that order"),
        ("sm90_bf16_d128_r128_c128", "cannot parse"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config(text)
    # The C++ template holds the same rules.
    text = (ROOT / "src/csrc/sm90/config.cuh").read_text()
    assert "static_assert(!kPingPong || (kConsumerWGs == 2 && kWarpSpec)" in text


def test_sm90_progression_adds_one_technique_per_step():
    assert [s.step for s in SM90_PROG_STEPS] == list(range(1, 7))
    for before, after in itertools.pairwise(SM90_PROG_STEPS):
        changed = {f for f in ("stages", "warp_spec", "pingpong", "overlap", "tma_store")
                   if getattr(before.config, f) != getattr(after.config, f)}
        assert len(changed) == 1, (before.step, after.step, changed)


def test_prog_steps():
    assert [s.step for s in PROG_STEPS] == list(range(1, 17))
    assert set(PROG) == {s.config for s in PROG_STEPS}
    for before, after in itertools.pairwise(PROG_STEPS):
        if after.config == before.config:
            assert after.note, f"step {after.step} repeats a config without saying why"


def test_resolve():
    assert resolve("ci") == CI
    mixed = resolve("ci, bf16_d64_r64_c64_w4_fseqkvbor ,ci")
    assert mixed[: len(CI)] == CI and mixed[-1].short == "bf16_d64_r64_c64_w4_fseqkvbor"
    assert len(mixed) == len(set(mixed))
    with pytest.raises(ConfigError, match="or name a set"):
        resolve("nonsense")
    with pytest.raises(ConfigError, match="empty"):
        resolve(" , ")


def test_flag_order_matches_cpp_template():
    """The generated template arguments follow FLAGS; config.cuh must list its bool parameters
    in the same order."""
    text = (ROOT / "src/csrc/sm80/config.cuh").read_text()
    params = re.search(r"template <(typename Elem_.*?)>\s*struct FwdConfig", text, re.S)[1]
    bools = re.findall(r"bool k(\w+)_", params)
    expected = ["".join(p.title() for p in name.split("_")) for name in FLAGS]
    assert [b.lower() for b in bools] == [e.lower() for e in expected]


def test_config_modules_import_one_way():
    """No import cycle between the two families' config modules: config_common imports nothing
    of the package, config_sm90 only config_common (config imports both)."""
    import ast

    def package_imports(module: str) -> set[str]:
        tree = ast.parse((ROOT / "src/flash_attention" / f"{module}.py").read_text())
        return {node.module for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.level == 1}

    assert package_imports("config_common") == set()
    assert package_imports("config_sm90") == {"config_common"}
    assert package_imports("config") == {"config_common", "config_sm90"}
