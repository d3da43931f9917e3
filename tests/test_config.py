"""Kernel configs (flash_attention.kernels): name round trips, validity rules, derived sizes,
named sets of the forward kinds (the backward's: tests/test_backward_cpu.py; names, selections
and the old scheme: tests/test_kernel_names.py)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from flash_attention.kernels import ConfigError, KernelConfig, fwd_sm80, fwd_sm90, parse, resolve
from flash_attention.kernels.fwd_sm80 import FLAGS, Sm80FwdConfig
from flash_attention.kernels.fwd_sm90 import Sm90FwdConfig
from flash_attention.kernels.legacy import current_name

ROOT = Path(__file__).resolve().parents[1]
CI = fwd_sm80.CI
DEFAULT = fwd_sm80.DEFAULT
TUNE = fwd_sm80.SETS["tune"]
PROG = fwd_sm80.SETS["prog"]

# A Row's call kind -> the feature letters of the calls it serves (a softcap call of any mask).
ROW_CALL_LETTERS = {"plain": ("",), "masked": ("m",), "local": ("m",), "softcap": ("t", "mt")}


@pytest.mark.parametrize("cfg", resolve("all"), ids=str)
def test_name_round_trip(cfg):
    assert parse(cfg.name) == cfg
    assert parse(cfg.name).name == cfg.name
    assert type(cfg).parse(cfg.name) == cfg
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.name), "a name must be a C identifier"
    assert cfg.name.startswith(cfg.KIND + "_") and isinstance(cfg, KernelConfig)


def test_name_example():
    cfg = Sm80FwdConfig("bf16", 128, 128, 64, 4)
    assert cfg.name == "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor" == Sm80FwdConfig.EXAMPLE
    assert str(cfg) == cfg.name and cfg.KIND == "fwd_sm80"
    assert (cfg.family, cfg.direction) == ("sm80", "fwd")
    small = Sm80FwdConfig("fp16", 64, 64, 32, 4)
    plain = small.replace(**{name: name == "slice_q" for name in FLAGS})
    assert plain.name == "fwd_sm80_fp16_d64_r64_c32_w4_fq"
    assert fwd_sm80.Config is Sm80FwdConfig and fwd_sm80.parse(plain.name) == plain


@pytest.mark.parametrize(
    "text, message",
    [
        ("fwd_sm80_bf16_d128_r128_c64_w4", "cannot parse"),
        ("fwd_sm80_fp32_d128_r128_c64_w4_f", "cannot parse"),
        ("fwd_sm80_bf16_d128_r128_c64_w4_fx", "must be a subset"),
        ("fwd_sm80_bf16_d128_r128_c64_w4_frs", "in that order"),
        ("fwd_sm80_bf16_d128_c64_r128_w4_fqkv", "cannot parse"),  # r before c
        ("fwd_sm80_bf16_d80_r128_c64_w4_fqkv", "d_head must be one of"),
        ("fwd_sm80_bf16_d256_r128_c64_w4_fqkv", "8 warps above d_head 128"),
        ("fwd_sm80_bf16_d256_r128_c128_w8_fqkv", "shared memory"),
        ("fwd_sm80_bf16_d128_r32_c64_w4_fqkv", "B_r must be one of"),
        ("fwd_sm80_bf16_d128_r128_c48_w4_fqkv", "B_c must be one of"),
        ("fwd_sm80_bf16_d128_r128_c64_w2_fqkv", "warps must be one of"),
        ("fwd_sm90_bf16_d128_r128_c128_s2_fwpia", "cannot parse fwd_sm80"),  # another kind's
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        Sm80FwdConfig.parse(text)


def test_d_head_variants_and_padding():
    from flash_attention.kernels.base import MAX_D_HEAD
    from flash_attention.kernels.fwd_sm80 import D_HEADS, smem_d_head, variant_for

    assert tuple(range(32, 257, 32)) == D_HEADS and MAX_D_HEAD == 256
    assert [variant_for(d) for d in (8, 32, 40, 64, 72, 96, 136, 200, 256)] == [
        32, 32, 64, 64, 96, 96, 160, 224, 256]
    assert [variant_for(d) for d in (0, -8, 12, 100, 264)] == [None] * 5
    # smem rows are whole 8-chunk swizzle groups: 96 pads to 128, 160..224 to 256.
    assert [smem_d_head(d) for d in D_HEADS] == [64, 64, 128, 128, 256, 256, 256, 256]
    assert parse("fwd_sm80_bf16_d96_r128_c64_w4_fqkv").smem_bytes == (128 + 128) * 128 * 2
    # The Hopper kinds' variants: 64, 128, 256 (a call's sm80 variant rounded up).
    assert [fwd_sm90.variant_for(d) for d in (8, 64, 72, 128, 136, 256, 12)] == [
        64, 64, 128, 128, 256, 256, None]


def test_rows_per_warp_rule():
    with pytest.raises(ConfigError, match="multiple of 16"):
        Sm80FwdConfig("fp16", 64, 64, 64, 8)


def test_double_buffer_needs_a_sliced_operand():
    with pytest.raises(ConfigError, match="double_buffer needs"):
        Sm80FwdConfig("fp16", 64, 64, 32, 4, slice_q=False, slice_k=False, slice_v=False)
    # The same without double buffering is fine.
    Sm80FwdConfig("fp16", 64, 64, 32, 4, slice_q=False, slice_k=False, slice_v=False,
                  double_buffer=False)


def test_register_budget_rule():
    # B_r=128 over 4 warps with B_c=128 and d=128: 256 accumulator registers per thread.
    with pytest.raises(ConfigError, match="over the budget"):
        Sm80FwdConfig("bf16", 128, 128, 128, 4)
    # Whole-block K at B_c=64, d=128 needs 128 more registers than the sliced form: it fits
    # beside one m-tile of accumulators (96 + 128 = 224) but not beside two (192 + 128).
    Sm80FwdConfig("bf16", 128, 64, 64, 4, slice_k=False)
    with pytest.raises(ConfigError, match="over the budget"):
        Sm80FwdConfig("bf16", 128, 128, 64, 4, slice_k=False)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        Sm80FwdConfig("fp8", 80, 64, 64, 4)
    assert "dtype" in str(info.value) and "d_head" in str(info.value)
    assert "invalid fwd_sm80 config" in str(info.value)


def test_flags_must_be_bools():
    with pytest.raises(ConfigError, match="swizzle must be a bool"):
        Sm80FwdConfig("bf16", 128, 128, 64, 4, swizzle=1)


def test_derived_sizes():
    cfg = parse("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor")
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


def _row_names(module, dtypes=("fp16", "bf16"), rows=None) -> set[str]:
    """Every kernel name a kind's ROWS (or `rows`) name, derived from the rows alone: each
    d_head variant (the Hopper kernel of the call's sm80 variant) and feature letters of each
    call kind."""
    out = set()
    for row, dtype, call in itertools.product(rows or module.ROWS, dtypes, ROW_CALL_LETTERS):
        if call not in row.calls:
            continue
        for d, letters in itertools.product(row.d_heads, ROW_CALL_LETTERS[call]):
            variant = fwd_sm90.variant_for(d) if module is fwd_sm90 else d
            out.add(f"{module.KIND}_{dtype}_d{variant}_{row.kernel}{letters}")
    return out


def test_sets_sizes_and_content():
    sm80 = list(fwd_sm80.CI)
    sm90 = list(fwd_sm90.CI)
    assert resolve("fwd:ci") == (*sm80, *sm90)
    assert {c.family for c in sm80} == {"sm80"} and {c.family for c in sm90} == {"sm90"}
    assert 1 <= len(sm80) <= 6 and len(sm90) == 6  # CI builds six Hopper kernels for sm_90a
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
    assert sm90[3].consumer_wgs == 3 and sm90[3].block_r == 192 and sm90[3].tile_overlap

    assert sm90[4].varlen and sm90[4].softcap and sm90[4].mask and sm90[4].pingpong
    assert sm90[5].fp8 and sm90[5].mask  # the FP8 forward (the producer transposes V)
    for name in fwd_sm90.FLAGS:  # every Hopper flag is on in one of them
        assert any(getattr(c, name) for c in sm90), name
    # The default sets are the kernels of the default tables' rows, each once.
    assert {c.name for c in DEFAULT} == _row_names(fwd_sm80)
    assert {c.name for c in fwd_sm90.DEFAULT} == (
        _row_names(fwd_sm90) | _row_names(fwd_sm90, rows=fwd_sm90.VARLEN_ROWS)
        | _row_names(fwd_sm90, rows=fwd_sm90.ONE_WAVE_ROWS)
        | _row_names(fwd_sm90, rows=fwd_sm90.KEY_PAD_ROWS)
        | _row_names(fwd_sm90, dtypes=("e4m3",), rows=fwd_sm90.FP8_ROWS)
        | _row_names(fwd_sm90, dtypes=("e4m3",), rows=fwd_sm90.FP8_VARLEN_ROWS))
    for configs in (DEFAULT, fwd_sm90.DEFAULT):
        assert len(configs) == len(set(configs))
    assert resolve("fwd:default") == (*DEFAULT, *fwd_sm90.DEFAULT)
    assert len(TUNE) == len(set(TUNE)) and len(TUNE) > len(DEFAULT)
    # The tune space holds every default tile; the features (masks, softcap) ride on a tile.
    assert {c.replace(mask=False, softcap=False) for c in DEFAULT} <= set(TUNE)
    sm90_tune = fwd_sm90.SETS["tune"]
    assert len(sm90_tune) == len(set(sm90_tune)) > len(fwd_sm90.DEFAULT)
    assert all(isinstance(c, Sm90FwdConfig) and not c.mask for c in sm90_tune)


def test_sm90_configs_round_trip_and_rules():
    cfg = Sm90FwdConfig("bf16", 128, 128, 128, 2)
    assert cfg.name == "fwd_sm90_bf16_d128_r128_c128_s2_fwpia" == Sm90FwdConfig.EXAMPLE
    assert cfg.block_r == 128 and cfg.consumer_wgs == 2 and cfg.block_c == 128
    assert parse(cfg.name) == cfg and cfg.threads == 384
    assert cfg.replace(warp_spec=False, pingpong=False).threads == 256
    assert Sm90FwdConfig("bf16", 64, 192, 96, 3, pingpong=False).consumer_wgs == 3
    for old, message in [
        ("sm90_bf16_d96_c128_g2_s2_f", "d_head must be one of"),
        ("sm90_bf16_d128_c80_g2_s2_f", "B_c must be one of"),
        ("sm90_bf16_d128_c128_g1_s2_fwp", "pingpong needs two consumer warpgroups"),
        ("sm90_bf16_d256_c192_g2_s2_fw", "registers"),
        ("sm90_bf16_d256_c64_g2_s2_fwpoeq", "registers"),  # Q's 64 fragment registers too
        ("sm90_bf16_d128_c128_g2_s2_fwesxm", "cluster needs warp_spec, without dynamic or mask"),
        ("sm90_bf16_d256_c128_g2_s3_fw", "shared memory"),
        ("sm90_bf16_d128_c128_g2_s2_fpw", "in that order"),
        ("sm90_bf16_d128_c128_g4_s2_fw", "B_r must be one of"),  # 4 consumer warpgroups
    ]:
        with pytest.raises(ConfigError, match=message):
            parse(current_name(old))
    with pytest.raises(ConfigError, match="cannot parse fwd_sm90"):
        parse("fwd_sm90_bf16_d128_r128_c128")
    # The C++ template holds the same rules.
    text = (ROOT / "src/csrc/sm90/forward_config.cuh").read_text()
    assert "static_assert(!kPingPong || (kConsumerWGs == 2 && kWarpSpec)" in text


def test_sm90_progression_adds_one_technique_per_step():
    steps = fwd_sm90.PROG_STEPS
    assert [s.step for s in steps] == list(range(1, 7))
    assert fwd_sm90.SETS["prog"] == tuple(dict.fromkeys(s.config for s in steps))
    for before, after in itertools.pairwise(steps):
        changed = {f for f in ("stages", "warp_spec", "pingpong", "overlap", "tma_store")
                   if getattr(before.config, f) != getattr(after.config, f)}
        assert len(changed) == 1, (before.step, after.step, changed)


def test_prog_steps():
    assert [s.step for s in fwd_sm80.PROG_STEPS] == list(range(1, 17))
    assert set(PROG) == {s.config for s in fwd_sm80.PROG_STEPS}
    for before, after in itertools.pairwise(fwd_sm80.PROG_STEPS):
        if after.config == before.config:
            assert after.note, f"step {after.step} repeats a config without saying why"


def test_resolve():
    assert resolve("fwd_sm80:ci") == CI
    mixed = resolve("fwd_sm80:ci, fwd_sm80_bf16_d64_r64_c64_w4_fseqkvbor ,fwd_sm80:ci")
    assert mixed[: len(CI)] == CI and mixed[-1].name == "fwd_sm80_bf16_d64_r64_c64_w4_fseqkvbor"
    assert len(mixed) == len(set(mixed))
    with pytest.raises(ConfigError, match="or name a set"):
        resolve("nonsense")
    with pytest.raises(ConfigError, match="empty"):
        resolve(" , ")


# Each kind's C++ config template: its header and struct (flash::<family>::<Direction>Config).
CPP_CONFIGS = {"fwd_sm80": ("sm80/forward_config.cuh", "FwdConfig"),
               "fwd_sm90": ("sm90/forward_config.cuh", "FwdConfig"),
               "bwd_sm80": ("sm80/backward_config.cuh", "BwdConfig"),
               "bwd_sm90": ("sm90/backward_config.cuh", "BwdConfig")}


@pytest.mark.parametrize("kind", CPP_CONFIGS)
def test_template_parameters_match_the_generated_arguments(kind):
    """A kind's C++ config template lists its parameters in the order codegen's template
    arguments follow (the config's fields: Elem, d_head, B_r, B_c, warps or stages, then the
    flags in name order), so a name's segments and flags are the template's."""
    from flash_attention.codegen.templates import TEMPLATES

    header, struct = CPP_CONFIGS[kind]
    assert TEMPLATES[kind].config == f"{kind[4:]}::{struct}"
    text = (ROOT / "src/csrc" / header).read_text()
    params = re.search(rf"template <(typename Elem_.*?)>\s*struct {struct} {{", text, re.S)[1]
    names = [re.search(r"(\w+)_$", p.strip().split("=")[0].strip())[1]
             for p in params.split(",")]
    cpp = {"dtype": "Elem", "d_head": "kDHead", "block_r": "kBr", "block_c": "kBc"}
    expected = [cpp.get(f, "k" + "".join(w.title() for w in f.split("_")))
                for f in TEMPLATES[kind].args]
    assert [n.lower() for n in names] == [e.lower() for e in expected]


def test_kernel_modules_import_one_way():
    """No import cycle between the kind modules: base imports nothing of the package, a kind
    base and at most fwd_sm80 (its d_head variants), fwd_sm80 base alone, helpers only
    base; legacy nothing at all (the benchmarks load it by path from commits that predate the
    package)."""
    import ast

    def package_imports(module: str) -> set[str]:
        tree = ast.parse((ROOT / "src/flash_attention/kernels" / f"{module}.py").read_text())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                out |= ({node.module} if node.module else {a.name for a in node.names})
        return out

    assert package_imports("base") == set()
    assert package_imports("legacy") == set()
    assert package_imports("fwd_sm80") == {"base"}
    assert package_imports("helpers") == {"base"}
    for kind in ("fwd_sm90", "bwd_sm80", "bwd_sm90"):
        assert "base" in package_imports(kind) <= {"base", "fwd_sm80"}, kind
