"""Code generation: one .cu per config, a registry of exactly the selected configs, stale files
removed, unchanged files left alone."""

from __future__ import annotations

import os
from pathlib import Path

from flash_attention.codegen import generate, kernel_source, template_args
from flash_attention.config import FLAGS, KernelConfig
from flash_attention.config_sets import CI
from flash_attention.nvcc_wrapper import ARCH_MARKER, arch_override


def test_one_file_per_config_and_registry(tmp_path):
    paths = generate(CI, tmp_path)
    assert [p.name for p in paths] == [f"fwd_{c.short}.cu" for c in CI] + ["registry.cu"]
    registry = (tmp_path / "registry.cu").read_text()
    for cfg in CI:
        src = (tmp_path / f"fwd_{cfg.short}.cu").read_text()
        assert "torch" not in src, "kernel translation units must not include torch"
        template = "sm90::Sm90Config" if cfg.family == "sm90" else "FwdConfig"
        assert f"{template}<{template_args(cfg)}>" in src
        assert (ARCH_MARKER in src) == (cfg.family == "sm90"), "sm_90a sources carry the marker"
        assert f'make_entry<Cfg_{cfg.short}>("{cfg.short}")' in src
        assert f"&entry_{cfg.short}," in registry
    assert f"*count = {len(CI)};" in registry


def test_stale_files_removed_and_unchanged_kept(tmp_path):
    generate(CI, tmp_path)
    keep = tmp_path / f"fwd_{CI[0].short}.cu"
    os.utime(keep, (1, 1))
    generate(CI[:2], tmp_path)
    assert keep.stat().st_mtime == 1, "an unchanged file must not be rewritten (no rebuild)"
    assert sorted(p.name for p in tmp_path.glob("*.cu")) == sorted(
        [f"fwd_{c.short}.cu" for c in CI[:2]] + ["registry.cu"]
    )
    assert f"entry_{CI[2].short}" not in (tmp_path / "registry.cu").read_text()


def test_every_flag_changes_the_instantiation():
    base = KernelConfig.parse("bf16_d64_r64_c64_w4_fseqkvbor")
    for name in FLAGS:
        flipped = base.replace(**{name: not getattr(base, name)})
        assert template_args(flipped) != template_args(base)
        assert kernel_source(flipped) != kernel_source(base)


def test_template_args_types():
    args = template_args(KernelConfig.parse("fp16_d128_r64_c32_w4_fqkv")).split(", ")
    assert args[:5] == ["__half", "128", "64", "32", "4"]
    assert len(args) == 5 + len(FLAGS)


def test_wgmma_header_is_current():
    """src/csrc/sm90/wgmma.cuh is generated; a hand edit or a stale copy fails here."""
    from flash_attention.codegen_wgmma import header

    path = Path(__file__).resolve().parents[1] / "src/csrc/sm90/wgmma.cuh"
    assert path.read_text() == header(), (
        "regenerate: python -m flash_attention.codegen_wgmma > src/csrc/sm90/wgmma.cuh")


def test_sm90_sources_compile_for_sm90a_only(tmp_path):
    """The nvcc wrapper swaps a marked source's -gencode flags for sm_90a (wgmma and
    setmaxnreg exist only there) and leaves other sources alone."""
    marked = tmp_path / "fwd_sm90.cu"
    marked.write_text(f"// Generated\n{ARCH_MARKER}\n")
    plain = tmp_path / "fwd.cu"
    plain.write_text("// Generated\n")
    args = ["-c", "x.cu", "-gencode=arch=compute_80,code=sm_80", "-gencode",
            "arch=compute_90,code=sm_90", "-O3"]
    out = arch_override(args, str(marked))
    assert out == ["-c", "x.cu", "-O3", "-gencode=arch=compute_90a,code=sm_90a"]
    assert arch_override(args, str(plain)) == args
