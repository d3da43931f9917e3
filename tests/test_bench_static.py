"""benchmarks/bench_static.py (asv's register/SMEM/SASS tracks) against a build of two real
kernels, one per family: an sm80 one for sm_80 and a Hopper one for sm_90a, compiled here with
nvcc into a shared library named as the build names its objects (CPU); and its kernel names,
the current ones whether the installed package is this tree's or an older commit's."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fa_tools.analysis import binaries, opcodes, ptxas_report, sass

from .script_modules import load_script, run_asv_class

ROOT = Path(__file__).resolve().parents[1]


bs = load_script("benchmarks/bench_static.py")


def _smallest(family: str) -> str:
    from fa_tools.analysis.kernel_names import parse_kernel

    cfgs = [parse_kernel(k) for k in bs.KERNELS]
    forward = [c for c in cfgs if getattr(c, "KIND", None) == f"fwd_{family}"]
    return min(forward, key=lambda c: (c.d_head, c.name)).name


SM80, SM90 = _smallest("sm80"), _smallest("sm90")


def _nvcc_or_skip() -> str:
    """nvcc's path, once nvcc, g++, cuobjdump and nvdisasm are all found (else a skip that
    names the missing one): what building and disassembling a unit here needs."""
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        pytest.skip("nvcc not found")
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    try:
        for tool in ("cuobjdump", "nvdisasm"):
            binaries.find_tool(tool)
    except binaries.ToolError as exc:
        pytest.skip(str(exc))
    return nvcc


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """(binary, ptxas log) of SM80 for sm_80 and SM90 for sm_90a. -lineinfo, as in the build:
    cuobjdump then names each cubin after its source (<kernel>.sm_<arch>.cubin)."""
    from flash_attention.codegen.generate import kernel_filename, kernel_source
    from flash_attention.kernels import parse

    nvcc = _nvcc_or_skip()
    out = tmp_path_factory.mktemp("bench_static")
    objects, log = [], []
    for name, arch in ((SM80, "80"), (SM90, "90a")):
        src = out / kernel_filename(parse(name))
        src.write_text(kernel_source(parse(name)))
        obj = src.with_suffix(".o")
        proc = subprocess.run([nvcc, "-c", "-O3", "-lineinfo", "-std=c++17", "-Xcompiler=-fPIC",
                               f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas=-v",
                               f"-I{ROOT / 'src/csrc'}", str(src), "-o", str(obj)],
                              capture_output=True, text=True, check=True)
        objects.append(str(obj))
        log.append(proc.stderr)
    binary = out / "_C.so"
    subprocess.run(["g++", "-shared", *objects, "-o", str(binary)], check=True)
    (out / "ptxas.log").write_text("".join(log))
    return binary, out / "ptxas.log"


@pytest.fixture
def cache(build, monkeypatch):
    """What asv's setup_cache returns for that build."""
    binary, log = build
    monkeypatch.setattr(binaries, "extension_path", lambda: binary)
    monkeypatch.setattr(binaries, "ptxas_log_path", lambda: log)
    return bs._collect()


def test_hopper_kernel_is_collected_under_90a(cache, build):
    _, log = build
    assert set(cache) == {(SM80, "80"), (SM90, "90a")}
    records = {(r.kernel, r.arch): r for r in ptxas_report.load(log)}
    resources = run_asv_class(bs.KernelResources, cache)
    assert set(resources) == {(SM80, "80"), (SM90, "90a")}  # (SM90, "90") etc.: skipped
    for key, rec in records.items():
        assert resources[key]["track_registers"] == rec.registers > 0
        assert resources[key]["track_smem_bytes"] == rec.static_smem + rec.dynamic_smem > 0
        assert resources[key]["track_spill_bytes"] == rec.spill_stores + rec.spill_loads


def test_sass_categories_of_both_families(cache, build):
    binary, _ = build
    counts = {k: v["track_count"] for k, v in run_asv_class(bs.SassInstructions, cache).items()}
    assert {(k, a) for k, a, _ in counts} == {(SM80, "80"), (SM90, "90a")}
    for kernel, arch, mma in ((SM80, "80", "HMMA"), (SM90, "90a", "HGMMA")):
        instrs = sass.instructions(binary, kernel, arch)
        assert counts[(kernel, arch, "total")] == opcodes.histogram(kernel, arch, instrs).total
        assert counts[(kernel, arch, "tensor_mma")] == sum(i.base == mma for i in instrs) > 0

    hopper = {k: v["track_count"]
              for k, v in run_asv_class(bs.HopperSassInstructions, cache).items()}
    assert set(hopper) == {(SM90, "90a", c) for c in bs.HOPPER_CATEGORIES}
    instrs = sass.instructions(binary, SM90, "90a")
    for category in bs.HOPPER_CATEGORIES:
        ops = opcodes.CATEGORIES[category]  # a name opcodes.histogram produces
        assert hopper[(SM90, "90a", category)] == sum(i.base in ops for i in instrs) > 0
    # an sm80 kernel has none of them
    assert all(cache[(SM80, "80")]["sass"][c] == 0 for c in bs.HOPPER_CATEGORIES)


def test_wgmma_schedule_of_the_hopper_kernel(cache, build):
    binary, log = build
    got = run_asv_class(bs.HopperWgmma, cache)
    assert set(got) == {(SM90, "90a")}
    (rec,) = [r for r in ptxas_report.load(log) if r.arch == "90a"]
    assert got[(SM90, "90a")]["track_serialized"] == int(bool(rec.wgmma_serialized))
    assert got[(SM90, "90a")]["track_ex2_under_wgmma"] == opcodes.ex2_under_wgmma(
        sass.instructions(binary, SM90, "90a"))
    # fa_tools of a commit that could not tell: nan, what asv records for a skipped case
    older = {key: {k: v for k, v in row.items() if k != "ex2_under_wgmma"}
             for key, row in cache.items()}
    assert math.isnan(run_asv_class(bs.HopperWgmma, older)[(SM90, "90a")]["track_ex2_under_wgmma"])


def test_missing_build_skips_every_case(monkeypatch):
    def missing():
        raise binaries.ToolError("flash_attention._C is not built")

    monkeypatch.setattr(binaries, "extension_path", missing)
    cache = bs._collect()
    for cls in (bs.KernelResources, bs.SassInstructions, bs.HopperSassInstructions,
                bs.HopperWgmma):
        assert run_asv_class(cls, cache) == {}
    with pytest.raises(NotImplementedError, match="not built"):
        bs.KernelResources().setup(cache, SM90, "90a")


def test_recorded_parameter_values_are_kept():
    """asv keys results by parameter values: every arch and category of a recorded run is
    still a value now (added ones are fine), or the history of those cases would end. (The
    kernels are the default set's, whatever this file says.)"""
    recorded = json.loads((ROOT / "benchmarks" / "results" / "benchmarks.json").read_text())
    classes = {"KernelResources": bs.KernelResources, "SassInstructions": bs.SassInstructions}
    found = 0
    for name, entry in recorded.items():
        if not name.startswith("bench_static."):
            continue
        _, cls, _ = name.split(".")
        found += 1
        bench = classes[cls]
        assert entry["param_names"] == bench.param_names
        for param, old, now in zip(bench.param_names, entry["params"], bench.params, strict=True):
            if param != "kernel":
                assert set(old) <= {repr(v) for v in now}, (name, param)
    assert found


def test_backward_kernels_have_tracks_as_the_ratchet_pins_them(monkeypatch):
    """Every backward kernel the static ratchet pins (the backward kernels of the policy's
    selection with the preprocess and each kind's dQ conversion of each dtype) is a kernel
    value of the static tracks, and a backward record of the build's report is collected like a
    forward one (the analysis functions faked here; test_hopper_kernel_is_collected_under_90a
    runs them for real)."""
    from types import SimpleNamespace

    from fa_tools.gate import ratchet
    from flash_attention.kernels import HelperKernel

    policy = ratchet.load_yaml(str(ROOT / "ci" / "gate_policy.yaml"))
    pinned = [k for k in ratchet.scope_kernels(policy) if k.startswith("bwd_")]
    assert pinned and set(pinned) <= set(bs.KERNELS)
    # the Hopper backward kernels among them get the Hopper tracks too; their helpers do not
    assert set(pinned) & set(bs.HOPPER_KERNELS) == {
        k for k in pinned if k.startswith("bwd_sm90_") and not HelperKernel.matches(k)}
    assert {k for k in pinned if k.startswith("bwd_sm90_") and HelperKernel.matches(k)}

    bwd = "bwd_sm80_bf16_d128_r64_c128_w8_fh"
    rec = SimpleNamespace(kernel=bwd, arch="90", registers=244, spill_stores=0, spill_loads=0,
                          static_smem=128, dynamic_smem=81920)
    other = SimpleNamespace(**{**vars(rec), "kernel": "not_a_tracked_kernel"})
    instrs = [SimpleNamespace(base=b, opcode=b, predicate="") for b in ("HMMA", "HMMA", "EXIT")]
    fake = SimpleNamespace(
        extension_path=lambda: "x.so", ptxas_log_path=lambda: "ptxas.log", ToolError=OSError)
    analysis = (fake, opcodes, SimpleNamespace(load=lambda log: [rec, other]),
                SimpleNamespace(instructions=lambda binary, kernel, arch: instrs))
    monkeypatch.setattr(bs, "_analysis", lambda: analysis)
    cache = bs._collect()
    assert set(cache) == {(bwd, "90")}
    got = cache[(bwd, "90")]
    assert got["registers"] == 244 and got["smem_bytes"] == 128 + 81920
    assert got["sass"]["total"] == 3 and got["sass"]["tensor_mma"] == 2
    resources = run_asv_class(bs.KernelResources, cache)
    assert resources[(bwd, "90")]["track_spill_bytes"] == 0


# An older commit's build, as its fa_tools reports it (names of the old scheme), and the names
# the tracks keep (the current ones)
OLD_NAMES = {"bwd_bf16_d128_c128_r64_w8_fb": "bwd_sm80_bf16_d128_r64_c128_w8_fh",
             "sm90_bf16_d128_c128_g2_s2_fwoesqr": "fwd_sm90_bf16_d128_r128_c128_s2_fwialgz",
             "bwd_convert_dq_tiles_bf16": "bwd_sm90_convert_dq_bf16",
             "bf16_d128_r128_c64_w4_fseqkvbor": "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"}


def test_an_older_commits_build_is_collected_under_the_current_names(monkeypatch):
    """asv runs this tree's bench_static.py against older commits: their fa_tools names the
    kernels the old way. The records are kept under the current names (the series of a kernel
    go on), the old fa_tools is asked by its own names, and only a Hopper main kernel gets the
    wgmma figures (not the Hopper dQ conversion, whose new name starts with bwd_sm90_)."""
    from types import SimpleNamespace

    assert set(OLD_NAMES.values()) <= set(bs.KERNELS)
    records = [SimpleNamespace(kernel=old, arch="90a" if "sm90" in new else "90", registers=99,
                               spill_stores=0, spill_loads=0, static_smem=0, dynamic_smem=64,
                               wgmma_serialized="")
               for old, new in OLD_NAMES.items()]
    asked = []

    def instructions(binary, kernel, arch):
        asked.append(kernel)
        return [SimpleNamespace(base="HGMMA", opcode="HGMMA", predicate="")]

    fake = SimpleNamespace(
        extension_path=lambda: "x.so", ptxas_log_path=lambda: "ptxas.log", ToolError=OSError)
    analysis = (fake, opcodes, SimpleNamespace(load=lambda log: records),
                SimpleNamespace(instructions=instructions))
    monkeypatch.setattr(bs, "_analysis", lambda: analysis)
    cache = bs._collect()
    assert set(cache) == {(new, r.arch) for r, new in zip(records, OLD_NAMES.values())}
    assert asked == list(OLD_NAMES)
    with_wgmma = {k for (k, _), v in cache.items() if "wgmma_serialized" in v}
    assert with_wgmma == {"fwd_sm90_bf16_d128_r128_c128_s2_fwialgz"}
    assert bs.is_hopper_kernel("bwd_sm90_bf16_d128_r64_c128_f")
    assert not bs.is_hopper_kernel("bwd_sm90_convert_dq_bf16")


def test_kernel_names_are_the_current_ones_for_an_older_package(tmp_path):
    """Loaded where flash_attention is an older commit's (config_sets and config_bwd, no
    flash_attention.kernels), the module takes the default sets from those and names them as
    now, with kernels/legacy.py of this tree loaded by path: the same parameter values as with
    this tree's package."""
    import sys
    import textwrap

    old = tmp_path / "flash_attention"
    old.mkdir()
    (old / "__init__.py").write_text("")
    shorts = {new: old_name for old_name, new in OLD_NAMES.items()}
    fwd = [shorts["fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"],
           shorts["fwd_sm90_bf16_d128_r128_c128_s2_fwialgz"]]
    (old / "config_sets.py").write_text(textwrap.dedent(f"""
        from types import SimpleNamespace
        SETS = {{"default": [SimpleNamespace(short=s) for s in {fwd!r}]}}
        """))
    (old / "config_bwd.py").write_text(textwrap.dedent(f"""
        from types import SimpleNamespace
        DEFAULT = [SimpleNamespace(short={shorts["bwd_sm80_bf16_d128_r64_c128_w8_fh"]!r})]
        def aux_kernels(configs):
            return [SimpleNamespace(short=s) for s in ("bwd_preprocess_bf16",
                                                       "bwd_convert_dq_bf16")]
        """))
    code = textwrap.dedent(f"""
        import importlib.util, json
        path = {str(ROOT / "benchmarks" / "bench_static.py")!r}
        spec = importlib.util.spec_from_file_location("bs", path)
        bs = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bs)
        print(json.dumps([bs.KERNELS, bs.HOPPER_KERNELS, bs.current_name.__module__]))
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=True)
    kernels, hopper, module = json.loads(proc.stdout)
    assert kernels == ["fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor",
                       "fwd_sm90_bf16_d128_r128_c128_s2_fwialgz",
                       "bwd_sm80_bf16_d128_r64_c128_w8_fh", "bwd_sm80_preprocess_bf16",
                       "bwd_sm80_convert_dq_bf16"]
    assert hopper == ["fwd_sm90_bf16_d128_r128_c128_s2_fwialgz"]
    assert module != "flash_attention.kernels.legacy"  # this tree's file, loaded by path
    assert bs.LEGACY.is_file()


HOPPER_BWD = "bwd_sm90_bf16_d64_r64_c128_f"


@pytest.fixture(scope="module")
def bwd_build(tmp_path_factory):
    """(binary, ptxas log) of one Hopper backward unit (HOPPER_BWD and its kind's bf16
    helpers, the preprocess and the tile-order dQ conversion) for sm_90a, built as `build`
    builds its kernels; cuobjdump names its cubin bwd_sm90_....sm_90a.cubin."""
    from flash_attention.codegen.generate import kernel_source
    from flash_attention.kernels import parse

    nvcc = _nvcc_or_skip()
    out = tmp_path_factory.mktemp("bench_static_bwd")
    src = out / f"{HOPPER_BWD}.cu"
    src.write_text(kernel_source(parse(HOPPER_BWD)))
    proc = subprocess.run([nvcc, "-c", "-O3", "-lineinfo", "-std=c++17", "-Xcompiler=-fPIC",
                           "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
                           "-Xptxas=-v", f"-I{ROOT / 'src/csrc'}", str(src), "-o",
                           str(src.with_suffix(".o"))],
                          capture_output=True, text=True, check=True)
    binary = out / "_C.so"
    subprocess.run(["g++", "-shared", str(src.with_suffix(".o")), "-o", str(binary)], check=True)
    (out / "ptxas.log").write_text(proc.stderr)
    return binary, out / "ptxas.log"


def test_hopper_backward_kernel_gets_the_hopper_tracks(bwd_build, monkeypatch):
    """A Hopper backward kernel, once a tracked set holds it, is collected under 90a with the
    Hopper figures (HGMMA as tensor_mma, TMA, setmaxnreg, the wgmma schedule), its helpers
    (the preprocess and the sm_90a-only dQ conversion) under 90a beside it without them."""
    from fa_tools.analysis.kernel_names import parse_kernel

    binary, log = bwd_build
    helpers = ["bwd_sm80_preprocess_bf16", "bwd_sm90_convert_dq_bf16"]
    monkeypatch.setattr(binaries, "extension_path", lambda: binary)
    monkeypatch.setattr(binaries, "ptxas_log_path", lambda: log)
    monkeypatch.setattr(bs, "KERNELS", [HOPPER_BWD, *helpers])
    hopper = [k for k in bs.KERNELS if bs.is_hopper_kernel(k)]
    assert hopper == [HOPPER_BWD]
    monkeypatch.setattr(bs.HopperSassInstructions, "params",
                        (hopper, ["90a"], bs.HOPPER_CATEGORIES))
    monkeypatch.setattr(bs.HopperWgmma, "params", (hopper, ["90a"]))
    cache = bs._collect()
    assert set(cache) == {(k, "90a") for k in bs.KERNELS}
    got = cache[(HOPPER_BWD, "90a")]
    instrs = sass.instructions(binary, HOPPER_BWD, "90a")
    assert got["sass"]["tensor_mma"] == sum(i.base == "HGMMA" for i in instrs) == 20
    assert got["sass"]["tensor_mma"] == opcodes.expected_mma_count(parse_kernel(HOPPER_BWD))
    assert got["spill_bytes"] == 0 and got["registers"] > 0
    hopper_counts = {k: v["track_count"] for k, v in run_asv_class(bs.HopperSassInstructions,
                                                           cache).items()}
    assert all(hopper_counts[(HOPPER_BWD, "90a", c)] > 0 for c in bs.HOPPER_CATEGORIES)
    wgmma = run_asv_class(bs.HopperWgmma, cache)[(HOPPER_BWD, "90a")]
    assert wgmma["track_serialized"] == 0
    assert wgmma["track_ex2_under_wgmma"] == opcodes.ex2_under_wgmma(instrs)
    for helper in helpers:
        assert "wgmma_serialized" not in cache[(helper, "90a")]
        assert cache[(helper, "90a")]["sass"]["tensor_mma"] == 0
