"""Kernel names and selections of flash_attention.kernels: every kind's names round-trip through
parse for every config of every set, the one table of flag letters, selections
(kernels.resolve) by set, kind, direction, `all` and `none` with errors that name the bad item,
and the names of the old scheme (kernels.legacy): each old form's current name, old names
refused by parse with their new one, rename_in_text leaving new names alone, and legacy.py
standalone (the benchmarks load it by path). docs/kernel-names.md, the table of every name:
tests/test_kernel_name_table.py."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flash_attention as fa
from flash_attention import kernels
from flash_attention.kernels import (
    KINDS,
    ConfigError,
    HelperKernel,
    KernelConfig,
    bwd_sm80,
    bwd_sm90,
    dec_sm80,
    fwd_sm80,
    fwd_sm90,
    parse,
    parse_kernel,
    resolve,
)
from flash_attention.kernels.base import FEATURE_FLAGS, FLAG_LETTERS
from flash_attention.kernels.helpers import helpers
from flash_attention.kernels.legacy import current_name, old_form, old_name, rename_in_text

ROOT = Path(__file__).resolve().parents[1]
LEGACY = ROOT / "src" / "flash_attention" / "kernels" / "legacy.py"

# One example of every form of the old scheme and its name now.
OLD_FORMS = {
    # fwd_sm80: the kind in front
    "bf16_d128_r128_c64_w4_fseqkvbor": "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor",
    "fp16_d64_r64_c32_w4_fqkv": "fwd_sm80_fp16_d64_r64_c32_w4_fqkv",
    # fwd_sm90: g<wgs> is r<64 wgs>, before c; o, e, s, q, r are i, a, l, g, z
    "sm90_bf16_d128_c128_g2_s2_fwpoe": "fwd_sm90_bf16_d128_r128_c128_s2_fwpia",
    "sm90_fp16_d64_c96_g3_s3_fwesnqr": "fwd_sm90_fp16_d64_r192_c96_s3_fwalngz",
    "sm90_bf16_d128_c128_g2_s2_fwesdqrm": "fwd_sm90_bf16_d128_r128_c128_s2_fwaldgzm",
    "sm90_bf16_d128_c128_g2_s2_fwesxqr": "fwd_sm90_bf16_d128_r128_c128_s2_fwalxgz",
    "sm90_bf16_d128_c128_g2_s1_f": "fwd_sm90_bf16_d128_r128_c128_s1_f",
    # bwd_sm80: r before c, the prefetch b is h
    "bwd_bf16_d128_c128_r64_w8_fb": "bwd_sm80_bf16_d128_r64_c128_w8_fh",
    "bwd_fp16_d64_c128_r128_w8_fbt": "bwd_sm80_fp16_d64_r128_c128_w8_fht",
    "bwd_fp16_d256_c64_r64_w8_ft": "bwd_sm80_fp16_d256_r64_c64_w8_ft",
    # bwd_sm90: r before c
    "bwd_sm90_bf16_d128_c128_r64_f": "bwd_sm90_bf16_d128_r64_c128_f",
    "bwd_sm90_fp16_d64_c128_r128_ft": "bwd_sm90_fp16_d64_r128_c128_ft",
    # the helpers: the kind of the code they are compiled as
    "bwd_preprocess_bf16": "bwd_sm80_preprocess_bf16",
    "bwd_convert_dq_fp16": "bwd_sm80_convert_dq_fp16",
    "bwd_convert_dq_tiles_bf16": "bwd_sm90_convert_dq_bf16",
}


# The kinds that had names before the one scheme (kernels.legacy maps them)
LEGACY_KINDS = ("fwd_sm80", "fwd_sm90", "bwd_sm80", "bwd_sm90")


def _set_params():
    return [pytest.param(kind, name, id=f"{kind}:{name}")
            for kind, module in KINDS.items() for name in module.SETS]


# ---- names -------------------------------------------------------------------------------------


def test_kinds_in_build_order():
    assert list(KINDS) == ["fwd_sm80", "fwd_sm90", "bwd_sm80", "bwd_sm90", "dec_sm80"]
    assert kernels.DIRECTIONS == ("fwd", "bwd", "dec")
    for kind, module in KINDS.items():
        assert module.KIND == module.Config.KIND == kind
        assert module.parse == module.Config.parse
        assert issubclass(module.Config, KernelConfig)
        example = module.Config.parse(module.Config.EXAMPLE)
        assert example.name == module.Config.EXAMPLE
        assert (example.direction, example.family) == tuple(kind.split("_"))
    assert {m.Config.ARCH for m in KINDS.values()} == {80, 90}


def test_every_kind_module_exports_the_same_names():
    """One module per kind, each with the same names: its config class, parse, sets (ci and
    default among them), default table (rows whose kernels it can build and that serve their
    calls) and select (its table's kernel for a call among built ones, None when none)."""
    from flash_attention.kernels import Call
    from flash_attention.kernels.base import D_HEADS, Row

    for kind, module in KINDS.items():
        for name in ("KIND", "Config", "parse", "SETS", "ROWS", "select", "FLAGS"):
            assert hasattr(module, name), (kind, name)
        assert {"ci", "default"} <= set(module.SETS), kind
        assert module.ROWS and all(isinstance(r, Row) for r in module.ROWS), kind
        built = module.SETS["default"]
        assert all(isinstance(c, module.Config) for c in built), kind
        for d in D_HEADS:
            call = Call("bf16", d, 4096)
            picked = module.select(call, built)
            if picked is not None:
                assert picked.serves(call) and picked in built, (kind, d)
            assert module.select(call, ()) is None, kind
        if module.FLAGS:
            assert list(module.FLAGS)[-1] == "softcap", "the feature letters end every name"
        else:  # a kind whose masks and softcap are run-time arguments of every kernel
            assert module.Config.mask and module.Config.softcap, kind
    # the package's names are the kernels package's
    assert fa.parse is parse and fa.resolve is resolve and fa.KernelConfig is KernelConfig
    assert fa.ConfigError is ConfigError and not hasattr(fa, "SETS")


@pytest.mark.parametrize("kind, set_name", _set_params())
def test_every_name_of_every_set_round_trips(kind, set_name):
    """Each config of each set of each kind: a C identifier of its kind that its kind's parse,
    kernels.parse and parse_kernel all read back to the same config; its old name (legacy)
    maps back to it."""
    module = KINDS[kind]
    configs = module.SETS[set_name]
    assert configs and len(configs) == len(set(configs)), "a set lists each kernel once"
    for cfg in configs:
        name = cfg.name
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name) and name.isidentifier(), name
        cache = f"{cfg.cache}_" if getattr(cfg, "cache", "") else ""  # an FP8 cache's dtype
        assert name.startswith(f"{kind}_{cfg.dtype}_{cache}d{cfg.d_head}_r{cfg.block_r}_"), name
        assert module.parse(name) == parse(name) == parse_kernel(name) == cfg
        assert parse(name).name == name == str(cfg)
        assert name.endswith("_f" + cfg.flag_letters)
        if (kind in LEGACY_KINDS and not getattr(cfg, "varlen", False)
                and cfg.dtype != "e4m3" and not getattr(cfg, "cache", "")):
            assert current_name(old_name(name)) == name, name
        else:  # a kind, flag or dtype born in the one scheme has no old name
            assert old_name(name) is None, name
        assert old_form(name) is None, f"{name} reads as an old-scheme name"


def test_helper_names_round_trip():
    every = helpers(resolve("bwd:all"))
    assert [h.name for h in every] == [
        f"bwd_{f}_{j}_{d}" for d in ("fp16", "bf16")
        for f, j in (("sm80", "preprocess"), ("sm80", "convert_dq"), ("sm90", "convert_dq"),
                     ("sm90", "preprocess_varlen"), ("sm90", "convert_dq_varlen"))]
    for h in every:
        assert parse_kernel(h.name) == HelperKernel.parse(h.name) == h
        assert HelperKernel.matches(h.name)
        if h.job.endswith("_varlen"):  # born in the one scheme: no old name
            assert old_name(h.name) is None
        else:
            assert current_name(old_name(h.name)) == h.name
        assert h.family in ("sm80", "sm90") and h.direction == "bwd"
    with pytest.raises(ConfigError, match="cannot parse bwd_sm80 kernel name"):
        parse("bwd_sm80_preprocess_bf16")  # parse reads main kernels; parse_kernel helpers too


def test_flag_letters_are_one_table():
    """One letter per flag, no letter for two flags, every kind's flags in the table, and the
    features (mask, softcap) last in each kind's order; a letter means one thing in every kind
    (mask is m and softcap t wherever they are)."""
    letters = list(FLAG_LETTERS.values())
    assert len(letters) == len(set(letters)), "a letter names two flags"
    assert all(re.fullmatch(r"[a-z]", x) for x in letters)
    assert (FLAG_LETTERS["mask"], FLAG_LETTERS["softcap"]) == ("m", "t")
    for kind, module in KINDS.items():
        flags = list(module.FLAGS)
        assert set(flags) <= set(FLAG_LETTERS), kind
        assert all(isinstance(v, str) and v for v in module.FLAGS.values()), "each says what"
        features = [f for f in flags if f in FEATURE_FLAGS]
        assert flags[len(flags) - len(features):] == features, kind
        # the name's flag letters are the table's, in the kind's order
        cfg = module.Config.parse(module.Config.EXAMPLE)
        assert cfg.flag_letters == "".join(FLAG_LETTERS[f] for f in flags if getattr(cfg, f))
    used = {f for m in KINDS.values() for f in m.FLAGS}
    assert used == set(FLAG_LETTERS), "a letter of no kind's flag"


@pytest.mark.parametrize("name, message", [
    ("fwd_sm80_bf16_d128_r128_c64_w4_fwp", r"must be a subset of 'seqkvbormt'"),
    ("fwd_sm90_bf16_d128_r128_c128_s2_fwpoe", r"must be a subset of 'wpialdxngzujmt'"),
    ("bwd_sm80_bf16_d128_r64_c128_w8_fb", r"must be a subset of 'ht'"),
    ("bwd_sm90_bf16_d128_r64_c128_fh", r"must be a subset of 'jt'"),
    ("fwd_sm70_bf16_d128_r128_c64_w4_f", r"a name starts with its kind, one of fwd_sm80, "
                                         "fwd_sm90, bwd_sm80, bwd_sm90, dec_sm80"),
    ("nonsense", r"cannot parse kernel name 'nonsense'"),
])
def test_parse_names_the_kinds_letters(name, message):
    with pytest.raises(ConfigError, match=message):
        parse(name)


# ---- selections ------------------------------------------------------------------------------


def test_resolve_a_set_of_every_kind():
    """A set name alone: that set of every kind that has one, in kind order."""
    for set_name in ("ci", "default"):
        want = tuple(c for m in KINDS.values() for c in m.SETS[set_name])
        assert resolve(set_name) == want
    assert resolve("tune") == (fwd_sm80.SETS["tune"] + fwd_sm90.SETS["tune"]
                               + dec_sm80.SETS["tune"])
    assert resolve("variants") == bwd_sm80.SETS["variants"]
    assert resolve("r64") == bwd_sm90.SETS["r64"]
    assert resolve("deep") == dec_sm80.SETS["deep"]
    assert kernels.set_names() == ["ci", "default", "tune", "prog", "variants", "r64", "deep"]
    assert kernels.set_names("bwd") == ["ci", "default", "variants", "r64"]
    assert kernels.set_names("fwd_sm90") == ["ci", "default", "tune", "prog"]


def test_resolve_scoped_by_kind_and_direction():
    assert resolve("fwd_sm90:tune") == fwd_sm90.SETS["tune"]
    assert resolve("bwd_sm90:r64") == bwd_sm90.SETS["r64"]
    assert resolve("bwd:default") == bwd_sm80.DEFAULT + bwd_sm90.DEFAULT
    assert resolve("fwd:ci") == fwd_sm80.CI + fwd_sm90.CI
    assert resolve("fwd:default") == fwd_sm80.DEFAULT + fwd_sm90.DEFAULT
    assert {c.direction for c in resolve("fwd:default")} == {"fwd"}
    assert {c.KIND for c in resolve("bwd:ci")} == {"bwd_sm80", "bwd_sm90"}
    # a direction's set: its kinds that have it (only bwd_sm80 has `variants`)
    assert resolve("bwd:variants") == bwd_sm80.SETS["variants"]
    # bwd ci is a subset of bwd default (its d_head 64 kernel is the default tile)
    assert set(resolve("bwd:ci")) <= set(resolve("bwd:default"))
    assert bwd_sm80.default_tile("bf16", 64).name == "bwd_sm80_bf16_d64_r128_c128_w8_fh"
    assert bwd_sm80.default_tile("bf16", 64) in resolve("bwd:ci")


def test_resolve_all_and_none():
    """`all`: every set of its scope (each kernel once, in kind and set order); `none`:
    nothing (in a scope too, so `fwd:default,bwd:none` is the forward default alone)."""
    every = tuple(dict.fromkeys(c for m in KINDS.values() for s in m.SETS.values() for c in s))
    assert resolve("all") == every
    assert resolve("bwd:all") == tuple(dict.fromkeys(
        c for m in (bwd_sm80, bwd_sm90) for s in m.SETS.values() for c in s))
    assert resolve("fwd_sm80:all") == tuple(dict.fromkeys(
        c for s in fwd_sm80.SETS.values() for c in s))
    assert set(resolve("all")) == (set(resolve("fwd:all")) | set(resolve("bwd:all"))
                                   | set(resolve("dec:all")))
    assert resolve("none") == resolve("bwd:none") == resolve("fwd_sm90:none") == ()
    assert resolve("fwd:default,bwd:none") == resolve("fwd:default")
    assert resolve("none,fwd_sm80:ci") == fwd_sm80.CI


def test_resolve_mixes_sets_and_names_in_order_without_duplicates():
    name = "fwd_sm90_bf16_d128_r128_c128_s2_fwpi"  # a prog step, in no other set
    got = resolve(f" bwd_sm90:ci , {name}, fwd_sm90:prog,bwd_sm90:ci ")
    ci = len(bwd_sm90.SETS["ci"])
    assert got[:ci + 1] == (*bwd_sm90.SETS["ci"], parse(name))
    assert got[ci + 1:] == tuple(c for c in fwd_sm90.SETS["prog"] if c != parse(name))
    assert len(got) == len(set(got))


@pytest.mark.parametrize("spec, message", [
    ("", "empty kernel selection: name a set"),
    (" , ", "empty kernel selection"),
    ("fwd:nonsense", r"no set 'nonsense' in fwd; its sets: ci, default, tune, prog"),
    ("bwd_sm90:tune", r"no set 'tune' in bwd_sm90; its sets: ci, default, r64"),
    ("fwd_sm70:ci", r"unknown kernel kind or direction 'fwd_sm70'; known: fwd_sm80, fwd_sm90, "
                    "bwd_sm80, bwd_sm90, dec_sm80, fwd, bwd, dec"),
    ("sm90:none", r"unknown kernel kind or direction 'sm90'"),
    ("ci,nonsense", r"cannot parse kernel name 'nonsense'.*or name a set: ci, default"),
    ("default,fwd_sm80_bf16_d80_r128_c64_w4_f", r"d_head must be one of"),
    ("bf16_d128_r128_c64_w4_fseqkvbor",
     r"its name now is fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"),
])
def test_resolve_errors_name_the_bad_item(spec, message):
    with pytest.raises(ConfigError, match=message):
        resolve(spec)


# ---- the old scheme ----------------------------------------------------------------------------


@pytest.mark.parametrize("old, new", OLD_FORMS.items(), ids=OLD_FORMS)
def test_current_name_of_every_old_form(old, new):
    assert old_form(old) is not None and old_form(new) is None
    assert current_name(old) == new and current_name(f"  {old}\n") == new
    assert current_name(new) == new, "a current name stays as it is"
    assert old_name(new) == old
    assert parse_kernel(new).name == new  # a valid kernel


@pytest.mark.parametrize("old, new", [pytest.param(old, new, id=old)
                                      for old, new in OLD_FORMS.items()])
def test_parse_refuses_an_old_name_naming_the_new_one(old, new):
    with pytest.raises(ConfigError, match=rf"old scheme; its name now is {new} "):
        parse_kernel(old)
    if not HelperKernel.matches(new):
        with pytest.raises(ConfigError, match=rf"its name now is {new} "):
            parse(old)


def test_old_form_wants_the_old_flag_letters():
    """A letter no kind of the old scheme had is not an old name (a typo stays a typo)."""
    assert old_form("sm90_bf16_d128_c128_g2_s2_fwpoy") is None
    assert old_form("bwd_bf16_d128_c128_r64_w8_fh") is None  # h is the new prefetch letter
    assert current_name("sm90_bf16_d128_c128_g2_s2_fwpoy") == "sm90_bf16_d128_c128_g2_s2_fwpoy"
    assert old_name("nonsense") is None


def test_rename_in_text_rewrites_old_names_alone():
    """Every old name that is a whole token is rewritten; new names (whose tails look like old
    fwd_sm80 names), mangled symbols, file names and other words stay as they are."""
    new_names = [c.name for c in (*resolve("ci"), *helpers(resolve("ci")))]
    text = "\n".join(new_names) + "\nfwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor.cu x.fwd_sm90_a\n"
    assert rename_in_text(text) == text
    symbol = ("_ZN5flash10fwd_kernelINS_9FwdConfigI13__nv_bfloat16Li128ELi128ELi64ELi4ELb1E"
              "EEEvNS_9FwdParamsE")
    assert rename_in_text(symbol) == symbol
    old = ", ".join(OLD_FORMS)
    assert rename_in_text(f"configs: {old}.") == f"configs: {', '.join(OLD_FORMS.values())}."
    assert rename_in_text('{"bf16/d128/q4096": "sm90_bf16_d128_c128_g2_s2_fwpoe"}') == (
        '{"bf16/d128/q4096": "fwd_sm90_bf16_d128_r128_c128_s2_fwpia"}')
    # a unit file of an old build: fwd_<old name>.cu is not a whole old name
    assert rename_in_text("fwd_bf16_d128_r128_c64_w4_fseqkvbor.cu") == (
        "fwd_bf16_d128_r128_c64_w4_fseqkvbor.cu")
    # idempotent: renamed text has no old name left
    once = rename_in_text(old)
    assert rename_in_text(once) == once


def test_legacy_is_standalone():
    """kernels/legacy.py imports the standard library alone and works loaded by path without
    the package (asv's benchmarks do so against commits from before it)."""
    import ast

    tree = ast.parse(LEGACY.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('names', {str(LEGACY)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "assert 'flash_attention' not in sys.modules; "
            "print(m.current_name('bwd_bf16_d128_c128_r64_w8_fb'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PATH": "/usr/bin:/bin"}).stdout
    assert out.strip() == "bwd_sm80_bf16_d128_r64_c128_w8_fh"


def test_rename_cli(tmp_path):
    """python -m flash_attention.kernels name OLD... / rewrite FILE... (docs/kernel-names.md)."""
    src = str(ROOT / "src")
    run = [sys.executable, "-m", "flash_attention.kernels"]
    out = subprocess.run([*run, "name", *itertools.islice(OLD_FORMS, 3)], capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"})
    assert out.stdout.splitlines() == [f"{o} -> {n}" for o, n in
                                       itertools.islice(OLD_FORMS.items(), 3)]
    tuning = tmp_path / "tuning.json"
    tuning.write_text('{"entries": {"bf16/d128/q4096": "sm90_bf16_d128_c128_g2_s2_fwpoe"}}\n')
    untouched = tmp_path / "new.txt"
    untouched.write_text("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor\n")
    before = untouched.stat().st_mtime_ns
    out = subprocess.run([*run, "rewrite", str(tuning), str(untouched)], capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"})
    assert out.stdout.splitlines() == [f"{tuning}: renamed"]
    assert "fwd_sm90_bf16_d128_r128_c128_s2_fwpia" in tuning.read_text()
    assert untouched.stat().st_mtime_ns == before


def test_importing_the_kernels_needs_no_torch():
    code = ("import sys; import flash_attention.kernels, flash_attention.codegen.generate, "
            "flash_attention.dispatch; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
