"""The toolchain (fa-tools) against the real built extension and recorded ptxas output (CPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import flash_attention as fa
from fa_tools.analysis import binaries, cubins, diff, opcodes, ptx2sass, ptxas_report, sass
from fa_tools.analysis.kernel_names import archs_of, parse_kernel
from fa_tools.cli import main as cli
from fa_tools.gate import ratchet
from flash_attention.kernels import HelperKernel, bwd_sm90, resolve
from flash_attention.kernels.helpers import helpers, helpers_of

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built():
    """(binary, build info) of the installed extension, with the binary tools available."""
    if not fa.is_built():
        if os.environ.get("FLASH_ATTENTION_REQUIRE_EXT") == "1":
            pytest.fail("flash_attention._C is not built but FLASH_ATTENTION_REQUIRE_EXT=1")
        pytest.skip("flash_attention._C is not built")
    try:
        for tool in ("cuobjdump", "nvdisasm", "c++filt"):
            binaries.find_tool(tool)
    except binaries.ToolError as exc:
        if os.environ.get("FLASH_ATTENTION_REQUIRE_EXT") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    return binaries.extension_path(), fa.build_info()


@pytest.fixture(scope="module")
def sass_counts(built):
    """counts(pairs): {(kernel, arch): (opcode histogram, opcodes.ex2_under_wgmma)} of the
    built kernels, each disassembled once for the module (two tests walk the forward ones),
    side by side: nvdisasm takes ~0.5 s a kernel, a ci,default build has 363."""
    binary, _ = built
    done: dict[tuple[str, str], tuple[opcodes.Histogram, int]] = {}

    def measure(pair: tuple[str, str]) -> tuple[opcodes.Histogram, int]:
        instrs = sass.instructions(binary, *pair, ptx_lines=False)
        return opcodes.histogram(*pair, instrs), opcodes.ex2_under_wgmma(instrs)

    def counts(pairs: list[tuple[str, str]]) -> dict[tuple[str, str], tuple]:
        todo = [p for p in dict.fromkeys(pairs) if p not in done]
        if todo:
            cubins.extracted_dir(binary)  # extract once, before the threads read the cubins
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                done.update(zip(todo, pool.map(measure, todo)))
        return {p: done[p] for p in pairs}

    return counts


# ---- resources ---------------------------------------------------------------------------------


def _mains(info: dict) -> list:
    """The main kernels of the build that run helpers: backward (either kind) and decode."""
    return [fa.parse(k) for k in (*info["bwd_configs"], *info.get("dec_configs", ()))]


def _built_kernels(info: dict) -> list[str]:
    """Names of every kernel the build holds: forward, backward (either kind), decode and
    their helpers (the preprocess and each built kind's dQ conversion, the combine) of their
    dtypes."""
    from flash_attention.kernels.helpers import helpers

    mains = _mains(info)
    return [*info["configs"], *(c.name for c in (*mains, *helpers(mains)))]


def test_resource_report_covers_every_built_kernel_and_arch(built):
    """Every kernel under each arch the build compiles it for: a Hopper one (forward or
    backward, the Hopper dQ conversion too) under 90a alone, the preprocess also under 90a
    where a Hopper backward unit of its dtype compiles it."""
    _, info = built
    records = ptxas_report.load(binaries.ptxas_log_path())
    got = {(r.kernel, r.arch) for r in records}
    mains = _mains(info)
    assert got == {(k, a) for k in _built_kernels(info)
                   for a in archs_of(parse_kernel(k), info["archs"], mains)}
    for r in records:
        cfg = parse_kernel(r.kernel)
        assert 0 < r.registers <= 255
        assert r.barriers >= 1 or HelperKernel.matches(r.kernel)
        assert r.dynamic_smem == cfg.smem_bytes
        # an sm_90-only decode kernel (more shared memory than sm_80 gives) fits no CTA there
        fits = 0 if getattr(cfg, "sm90_only", False) and r.arch == "80" else 1
        assert r.ctas_per_sm >= fits and r.warps_per_sm == r.ctas_per_sm * cfg.warps


def test_backward_kernels_in_the_sass_tools(built, capsys):
    """A bwd_sm80 cubin holds the main kernel and its kind's two helpers of its dtype (the
    preprocess, the row-order dQ conversion): each is listed, counted and dumped alone, by
    name."""
    binary, info = built
    sm80 = [k for k in info["bwd_configs"] if k.startswith("bwd_sm80_")]
    if not sm80:
        pytest.skip("no bwd_sm80 kernels built")
    main = sm80[0]
    dtype = main.split("_")[2]
    helpers = [f"bwd_sm80_preprocess_{dtype}", f"bwd_sm80_convert_dq_{dtype}"]
    listed = {m.kernel for m in cubins.list_cubins(binary) if m.arch == "90"}
    assert {main, *helpers} <= listed
    mmas = {k: opcodes.histogram(k, "90", sass.instructions(binary, k, "90"))
            .categories["tensor_mma"] for k in (main, *helpers)}
    assert mmas[main] > 0 and mmas[helpers[0]] == mmas[helpers[1]] == 0, mmas
    text = sass.dump(binary, main, "90")
    assert "flash::sm80::bwd_kernel<" in text and "bwd_preprocess_kernel" not in text
    text = sass.dump(binary, helpers[0], "90")
    assert "bwd_preprocess_kernel" in text and "flash::sm80::bwd_kernel<" not in text
    # The set count over an arch the build has (a GPU runner's build may hold sm_90 only).
    arches = {m.arch for m in cubins.list_cubins(binary)}
    arch = "80" if "80" in arches else "90"
    assert cli(["count", "bwd:default", "--arch", arch, "--format", "csv"]) == 0  # a selection
    rows = capsys.readouterr().out.splitlines()[1:]
    assert {r.split(",")[0] for r in rows} >= {main, *helpers} & {
        m.kernel for m in cubins.list_cubins(binary) if m.arch == arch}


def test_hopper_backward_kernels_in_the_sass_tools(built, sass_counts):
    """A Hopper backward unit (sm_90a alone) holds its main kernel and its kind's two helpers
    of its dtype, the preprocess and the tile-order dQ conversion (not the sm80 kind's): the
    main kernel found under --arch 90 as under 90a, with the wgmma count of its tile
    (opcodes.expected_mma_count), TMA loads and stores, mbarriers, setmaxnreg and no mma.sync;
    its helpers there without matrix instructions, the dQ conversion under 90a alone."""
    binary, info = built
    hopper = [k for k in info["bwd_configs"] if k.startswith("bwd_sm90_")]
    if not hopper:
        pytest.skip("no Hopper backward kernels built (FLASH_ATTENTION_KERNELS=default)")
    listed = {(m.kernel, m.arch) for m in cubins.list_cubins(binary)}
    counts = sass_counts([(k, "90a") for short in hopper
                          for k in (short, *(h.name for h in helpers_of(parse_kernel(short))))])
    for short in hopper:
        cfg = parse_kernel(short)
        assert archs_of(cfg, info["archs"]) == ["90a"] and (short, "90a") in listed
        assert cubins.cubin(binary, short, "90") == cubins.cubin(binary, short, "90a")
        hist, _ = counts[(short, "90a")]
        assert hist.categories["tensor_mma"] == opcodes.expected_mma_count(cfg), short
        assert set(hist.base) >= {"HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "WARPGROUP",
                                  "USETMAXREG", "MUFU"}, short
        assert "HMMA" not in hist.base and "LDGSTS" not in hist.base, short
        for helper in (f"bwd_sm80_preprocess_{cfg.dtype}", f"bwd_sm90_convert_dq_{cfg.dtype}"):
            assert (helper, "90a") in listed
            assert counts[(helper, "90a")][0].categories["tensor_mma"] == 0
        tiles = f"bwd_sm90_convert_dq_{cfg.dtype}"
        assert {a for k, a in listed if k == tiles} == {"90a"}
        assert cubins.cubin(binary, tiles, "90") == cubins.cubin(binary, tiles, "90a")
        assert (f"bwd_sm80_convert_dq_{cfg.dtype}", "90a") not in listed


def test_default_backward_kernels_do_not_spill(built):
    """The backward kernels users run (`bwd:default` and its helpers), as built (the build
    compiles them for both architectures; ptxas's word): no spill, no stack."""
    default = resolve("bwd:default")
    wanted = {c.name for c in (*default, *helpers(default))}
    records = [r for r in ptxas_report.load(binaries.ptxas_log_path()) if r.kernel in wanted]
    if not records:
        pytest.skip("the default backward set is not built")
    spilling = [(r.kernel, r.arch, r.spill_stores, r.stack_frame) for r in records
                if r.spill_stores or r.spill_loads or r.stack_frame]
    assert not spilling, f"default backward kernels spill: {spilling}"


def test_recorded_log_edge_cases():
    records = ptxas_report.load(DATA / "ptxas_sample.log")
    by = {(r.kernel, r.arch): r for r in records}
    spill = by[("fwd_sm80_bf16_d64_r128_c128_w4_fsekvbor", "90")]
    assert (spill.registers, spill.spill_stores, spill.spill_loads) == (255, 124, 116)
    assert spill.stack_frame == 104 and spill.cumulative_stack == 104
    plain80 = by[("fwd_sm80_fp16_d64_r64_c32_w4_fqkv", "80")]
    assert plain80.cmem0 == 512 and plain80.compile_ms == pytest.approx(57.277)
    assert by[("fwd_sm80_fp16_d64_r64_c32_w4_fqkv", "90")].cmem0 == 0
    assert [r.kernel for r in records] == sorted(r.kernel for r in records)


def test_static_smem_and_foreign_kernels_parse():
    text = ("ptxas info    : Compiling entry function '_Z6helperPf' for 'sm_90'\n"
            "ptxas info    : Function properties for _Z6helperPf\n"
            "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
            "ptxas info    : Used 32 registers, used 1 barriers, 1024 bytes smem\n")
    (r,) = ptxas_report.parse(text)
    assert (r.kernel, r.registers, r.static_smem, r.ctas_per_sm) == ("_Z6helperPf", 32, 1024, None)


# flash::sm90::fwd_kernel<flash::sm90::FwdConfig<bf16, d 128, B_r 128, B_c 128, 2 stages, ...>>
SM90_MANGLED = ("_ZN5flash4sm9010fwd_kernelINS0_9FwdConfigI13__nv_bfloat16Li128ELi128ELi128E"
                "Li2ELb1ELb0ELb1ELb1ELb1ELb0ELb0ELb1ELb1ELb1ELb1ELb0EEEEEvNS0_15FwdKernelParamsE")
# ... as builds before the one name scheme named it (Sm90Config<Elem, d, B_c, warpgroups, ...>)
OLD_SM90_MANGLED = ("_ZN5flash4sm9015fwd_sm90_kernelINS0_10Sm90ConfigI13__nv_bfloat16Li128ELi128"
                    "ELi2ELi2ELb1ELb0ELb1ELb1ELb1ELb0ELb0ELb1ELb1ELb1ELb1ELb0EEEEEvNS0_10Sm90Params"
                    "E")


def test_forward_symbols_of_either_scheme_name_the_same_kernel():
    from fa_tools.analysis.kernel_names import short_of

    assert short_of(SM90_MANGLED) == short_of(OLD_SM90_MANGLED) == (
        "fwd_sm90_bf16_d128_r128_c128_s2_fwialngzm")
    assert short_of(SM90_MANGLED.replace("4sm9010fwd", "4sm9110fwd")) is None
    # today's template: exp2_fma (u) and varlen (j) after lazy_rescale, before the features
    now = SM90_MANGLED.replace("Lb1ELb1ELb1ELb0EEEE", "Lb1ELb1ELb1ELb0ELb1ELb0EEEE")
    assert now.count("Lb") == 14
    assert short_of(now) == "fwd_sm90_bf16_d128_r128_c128_s2_fwialngzum"


def test_serialized_wgmma_note_is_attributed_to_its_kernel():
    """ptxas prints its serialization note (C75xx) before the entry line of the function it
    names; the record of that function (and only that one) carries the code."""
    entry = ("ptxas info    : Compiling entry function '{0}' for 'sm_90a'\n"
             "ptxas info    : Function properties for {0}\n"
             "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
             "ptxas info    : Used 168 registers, used 16 barriers\n")
    text = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are "
            f"serialized due to insufficient register resources for the function '{SM90_MANGLED}'\n"
            "ptxas info    : 0 bytes gmem\n" + entry.format(SM90_MANGLED) +
            entry.format("_Z6helperPf"))
    by = {r.kernel: r for r in ptxas_report.parse(text)}
    assert by["fwd_sm90_bf16_d128_r128_c128_s2_fwialngzm"].wgmma_serialized == "C7512"
    assert by["_Z6helperPf"].wgmma_serialized == ""
    # the same note for a function of another compile does not stick to the next entry
    other = text.replace(SM90_MANGLED + "'\n", "_Z5otherv'\n", 1)
    assert all(r.wgmma_serialized == "" for r in ptxas_report.parse(other))


def test_truncated_log_is_an_error():
    text = (DATA / "ptxas_sample.log").read_text().split("ptxas info    : Used")[0]
    with pytest.raises(ValueError, match="no 'Used N registers' line"):
        ptxas_report.parse(text)


def test_resources_cli_formats_are_deterministic(built, capsys):
    outputs = []
    for fmt in ("json", "json", "csv", "yaml", "table"):
        assert cli(["resources", "--format", fmt]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    rows = json.loads(outputs[0])
    assert outputs[2].splitlines()[0].startswith("kernel,arch,registers,spill_stores")
    assert len(outputs[2].splitlines()) == len(rows) + 1
    assert rows[0]["kernel"] in outputs[4]


# ---- SASS ------------------------------------------------------------------------------------


def test_mma_count_matches_tile_shapes(built, sass_counts):
    """HMMA count = m_tiles x (B_c/8 x d/16 + d/8 x B_c/16), twice with the peeled first block
    (opt_softmax): the loop body holds one KV block's MMAs and nothing unrolls it further (the
    Hopper kinds: opcodes.expected_mma_count)."""
    _, info = built
    counts = sass_counts([(short, arch) for short in info["configs"]
                          for arch in archs_of(fa.parse(short), info["archs"])])
    for (short, arch), (hist, ex2_overlapped) in counts.items():
        cfg = fa.parse(short)
        assert hist.categories["tensor_mma"] == opcodes.expected_mma_count(cfg), (short, arch)
        if cfg.family == "sm90":  # wgmma, TMA, mbarriers; setmaxnreg with a producer
            # the overlap puts one block's exp2s (B_c/2 per thread, 2 rescale factors)
            # under the running P V wgmma, the tile hand-over the next tile's first block's
            # (B_c/2, no rescale); without them none
            # (a softcap's tanh is MUFU.TANH, not an exp2; with exp2_fma the score tiles on the
            # FMA pipe, 4 values a thread each, take none)
            per_block = cfg.block_c // 2 - 4 * cfg.exp2_fma_tiles
            overlapped = ((per_block + 2 if cfg.overlap else 0)
                          + (per_block if cfg.tile_overlap else 0))
            assert ex2_overlapped == overlapped, short
            gmma = "QGMMA" if cfg.dtype == "e4m3" else "HGMMA"  # FP8 wgmma: QGMMA
            assert set(hist.base) >= {gmma, "UTMALDG", "SYNCS", "WARPGROUP", "MUFU"}
            assert "HMMA" not in hist.base and "LDGSTS" not in hist.base
            assert (hist.categories["setmaxnreg"] > 0) == cfg.warp_spec, short
            assert (hist.base.get("UTMASTG", 0) > 0) == cfg.tma_store, short
        else:
            assert set(hist.base) >= {"HMMA", "LDSM", "LDGSTS", "MUFU", "BAR"}


def test_no_local_memory_when_spill_free(sass_counts):
    records = ptxas_report.load(binaries.ptxas_log_path())
    counts = sass_counts([(r.kernel, r.arch) for r in records])
    for r in records:
        hist, _ = counts[(r.kernel, r.arch)]
        spills = r.spill_stores + r.spill_loads + r.stack_frame
        assert (hist.categories["local_memory"] == 0) == (spills == 0), (r.kernel, r.arch)


def test_spilling_kernel_shows_local_memory(tmp_path):
    """Consistency the other way round: a config ptxas spills has LDL/STL in its SASS."""
    from flash_attention.codegen.generate import kernel_source

    cfg = fa.parse("fwd_sm80_bf16_d64_r128_c128_w4_fsekvbor")
    src = tmp_path / "k.cu"
    src.write_text(kernel_source(cfg))
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        pytest.skip("nvcc not found")
    if "nvdisasm" not in binaries.tools_in_use():
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm, or the CUDA toolkit's)")
    proc = subprocess.run([nvcc, "-cubin", "-O3", "-std=c++17", "-arch=sm_90", "-Xptxas=-v",
                           f"-I{ROOT / 'src/csrc'}", str(src), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, check=True)
    (rec,) = ptxas_report.parse(proc.stderr)
    assert rec.spill_stores > 0
    data = json.loads(binaries.run_tool("nvdisasm", "-json", str(tmp_path / "k.cubin")))
    ops = [i["opcode"].split(".")[0] for i in data[1][0]["sass-instructions"]]
    assert ops.count("STL") > 0 and ops.count("LDL") > 0


def test_histogram_diff_with_itself_is_empty(built, capsys):
    binary, info = built
    kernel = info["configs"][0]
    hist = opcodes.histogram(kernel, "90", sass.instructions(binary, kernel, "90")).as_dict()
    flat = diff.flatten([hist], opcodes=True)
    assert diff.compare(flat, flat) == []
    assert diff.markdown([], len(flat)).startswith("No differences")
    assert cli(["diff", "--configs", kernel, kernel]) == 0
    assert "No differences" in capsys.readouterr().out


def test_diff_of_two_configs_sorted_by_change(built, capsys):
    _, info = built
    a, b = info["configs"][0], info["configs"][-1]
    assert cli(["diff", "--configs", a, b]) == 0
    out = capsys.readouterr().out
    deltas = [abs(float(m)) for m in re.findall(r"\| ([+-][\d.e+]+) \|", out)]
    assert deltas == sorted(deltas, reverse=True)
    assert re.search(r"\d+ of \d+ values changed", out)


def test_cfg_is_valid_dot(built):
    binary, info = built
    dot = sass.cfg_dot(binary, info["configs"][0], "90")
    assert dot.lstrip().startswith("digraph")
    body = re.sub(r'"(?:[^"\\]|\\.)*"', '""', dot)  # drop quoted labels
    assert body.count("{") == body.count("}")
    assert re.search(r'""(:\w+)*\s*->\s*""', body), "no edges"
    assert "EXIT" in dot


def test_sass_dump_strips_addresses_and_demangles(built):
    binary, info = built
    text = sass.dump(binary, info["configs"][0], "90", strip_addresses=True)
    assert "flash::sm80::fwd_kernel<flash::sm80::FwdConfig<" in text
    assert not re.search(r"/\*[0-9a-f]{4}\*/", text)
    assert "HMMA" in text


def test_ptx2sass_maps_mma_line(built):
    binary, info = built
    kernel = info["configs"][0]
    lines = sass.ptx_text(binary, kernel, "90").splitlines()
    mma_line = ptx2sass.find_lines(lines, r"mma\.sync")[0]
    instrs = sass.instructions(binary, kernel, "90")
    hits = ptx2sass.sass_for_line(instrs, mma_line)
    assert [i.base for _, i in hits] == ["HMMA"]
    # the counts' disassembly, without the lines: the same instructions
    unlined = sass.instructions(binary, kernel, "90", ptx_lines=False)
    assert [(i.opcode, i.operands, i.predicate) for i in unlined] == [
        (i.opcode, i.operands, i.predicate) for i in instrs]
    assert all(i.ptx_line is None for i in unlined)
    sl = ptx2sass.backward_slice(lines, mma_line)
    assert sl[-1].line == mma_line and any("ldmatrix" in p.text for p in sl)


def test_ptx_slice_parsing():
    ptx = ["mov.u32 %r1, %tid.x;", "add.s32 %r2, %r1, 4;", "mov.u32 %r9, 7;",
           "st.shared.u32 [%r2], %r9;", "@%p1 bra $L1;"]
    sl = ptx2sass.backward_slice(ptx, 4)
    assert [p.line for p in sl] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="out of range"):
        ptx2sass.backward_slice(ptx, 9)


# ---- errors ------------------------------------------------------------------------------------


def test_kernel_code_includes_internal_subroutines_listed_apart():
    """nvdisasm 13.0/13.1 list compiler subroutines as functions of their own, 13.5 inside the
    kernel: both must give the kernel's whole code."""
    kernel = {"function-name": "_ZN5flash10fwd_kernel", "start": 0,
              "sass-instructions": [{"opcode": "HMMA"}, {"opcode": "CALL.REL"}]}
    sub = {"function-name": "$__internal_0_$__cuda_sm20_div_s64", "start": 32,
           "sass-instructions": [{"opcode": "IMAD"}, {"opcode": "RET.REL"}]}
    split = sass.kernel_code([sub, kernel], "k.cubin")
    merged = sass.kernel_code([{**kernel, "sass-instructions": [*kernel["sass-instructions"],
                                                                 *sub["sass-instructions"]]}],
                              "k.cubin")
    assert [i["opcode"] for i in split] == [i["opcode"] for i in merged] == [
        "HMMA", "CALL.REL", "IMAD", "RET.REL"]
    with pytest.raises(binaries.ToolError, match="expected one kernel"):
        sass.kernel_code([kernel, {**kernel, "function-name": "_ZN5other"}], "k.cubin")


# flash::sm80::bwd_kernel<flash::sm80::BwdConfig<bf16, d 128, B_r 64, B_c 128, 8 warps, ...>>
BWD_MAIN = ("_ZN5flash4sm8010bwd_kernelINS0_9BwdConfigI13__nv_bfloat16Li128ELi64ELi128ELi8ELb1E"
            "Lb0EEEEEvNS_9BwdParamsE")
# ... before the one name scheme: flash::bwd::bwd_kernel<flash::BwdConfig<Elem, d, B_c, B_r, ...>>
OLD_BWD_MAIN = ("_ZN5flash3bwd10bwd_kernelINS_9BwdConfigI13__nv_bfloat16Li128ELi128ELi64ELi8ELb1E"
                "Lb0EEEEvNS_9BwdParamsE")
BWD_PRE = "_ZN5flash3bwd21bwd_preprocess_kernelI13__nv_bfloat16EEvNS_9BwdParamsE"


# The Hopper backward's dQ conversion as nvcc 13.0 names it (flash::bwd, like the other helpers)
BWD_TILES = "_ZN5flash3bwd27bwd_convert_dq_tiles_kernelI13__nv_bfloat16EEvNS_9BwdParamsE"


def test_backward_kernel_names():
    assert parse_kernel("bwd_sm80_bf16_d128_r64_c128_w8_fh").block_r == 64
    assert parse_kernel("bwd_sm80_convert_dq_fp16").threads == 256
    from fa_tools.analysis.kernel_names import short_of

    assert short_of(BWD_MAIN) == short_of(OLD_BWD_MAIN) == "bwd_sm80_bf16_d128_r64_c128_w8_fh"
    assert short_of(BWD_PRE) == "bwd_sm80_preprocess_bf16"
    assert short_of(BWD_PRE.replace("preprocess", "convert_dq").replace("13__nv_bfloat16",
                                                                        "6__half")) \
        == "bwd_sm80_convert_dq_fp16"


def test_hopper_backward_dq_conversion_names():
    """The Hopper kind's dQ conversion (bwd_convert_dq_tiles_kernel) parses to its name for
    either dtype, a helper of 256 threads without dynamic shared memory, sm_90a code alone (a
    Hopper kernel by config and by name), held by the Hopper units alone."""
    from fa_tools.analysis.kernel_names import config_of, is_hopper, is_hopper_name, short_of

    assert short_of(BWD_TILES) == "bwd_sm90_convert_dq_bf16"
    assert config_of(BWD_TILES) == HelperKernel("sm90", "convert_dq", "bf16")
    assert short_of(BWD_TILES.replace("13__nv_bfloat16", "6__half")) \
        == "bwd_sm90_convert_dq_fp16"
    assert short_of(BWD_TILES.replace("27bwd_convert_dq_tiles", "26bwd_convert_dq_tile")) is None
    tiles = parse_kernel("bwd_sm90_convert_dq_bf16")
    assert (tiles.job, tiles.dtype, tiles.threads, tiles.smem_bytes) == (
        "convert_dq", "bf16", 256, 0)
    assert tiles.family == "sm90" and is_hopper(tiles) and is_hopper_name(tiles.name)
    assert archs_of(tiles, ["80", "90"]) == ["90a"]
    assert [h.name for h in helpers_of(parse_kernel("bwd_sm90_bf16_d128_r64_c128_f"))] == [
        "bwd_sm80_preprocess_bf16", "bwd_sm90_convert_dq_bf16"]
    assert [h.name for h in helpers_of(parse_kernel("bwd_sm80_fp16_d64_r128_c128_w8_fh"))] == [
        "bwd_sm80_preprocess_fp16", "bwd_sm80_convert_dq_fp16"]


# The Hopper backward's symbol as nvcc 13.0 names it (ptxas -v of the generated unit):
# flash::sm90::bwd_kernel<flash::sm90::BwdConfig<Elem, d_head, B_r, B_c, varlen, softcap>>
BWD_SM90 = ("_ZN5flash4sm9010bwd_kernelINS0_9BwdConfigI13__nv_bfloat16Li128ELi64ELi128ELb0ELb0E"
            "EEEEvNS0_15BwdKernelParamsE")
# ... before flag j (varlen): flash::sm90::BwdConfig<Elem, d_head, B_r, B_c, softcap>
PRE_VARLEN_BWD_SM90 = ("_ZN5flash4sm9010bwd_kernelINS0_9BwdConfigI13__nv_bfloat16Li128ELi64E"
                       "Li128ELb0EEEEEvNS0_15BwdKernelParamsE")
# ... before the one name scheme: B_c fixed by d_head, the template's arguments Elem, d_head,
# softcap and B_r (absent in builds before B_r was one: read as 64).
OLD_BWD_SM90 = ("_ZN5flash4sm9015bwd_sm90_kernelINS0_13Sm90BwdConfigI13__nv_bfloat16Li128ELb0ELi64E"
                "EEEEvNS0_13Sm90BwdParamsE")


def test_hopper_backward_kernel_names():
    from fa_tools.analysis.kernel_names import config_of, is_hopper, short_of
    from flash_attention.kernels.bwd_sm90 import Sm90BwdConfig

    assert short_of(BWD_SM90) == short_of(OLD_BWD_SM90) == "bwd_sm90_bf16_d128_r64_c128_f"
    assert short_of(PRE_VARLEN_BWD_SM90) == "bwd_sm90_bf16_d128_r64_c128_f"
    assert config_of(BWD_SM90) == Sm90BwdConfig("bf16", 128, 64, 128)
    fp16_d64_cap = BWD_SM90.replace("13__nv_bfloat16Li128ELi64ELi128ELb0ELb0E",
                                    "6__halfLi64ELi128ELi128ELb0ELb1E")
    assert short_of(fp16_d64_cap) == "bwd_sm90_fp16_d64_r128_c128_ft"
    varlen = BWD_SM90.replace("Li128ELb0ELb0E", "Li128ELb1ELb0E")
    assert short_of(varlen) == "bwd_sm90_bf16_d128_r64_c128_fj"
    assert short_of(BWD_SM90.replace("Lb0E", "Lb0ELb1E")) is None  # a flag more: not ours
    assert short_of(BWD_SM90.replace("Li64ELi128E", "Li64ELi64E")) is None  # B_c 64 at d 128
    assert short_of(BWD_SM90.replace("4sm9010bwd", "4sm9110bwd")) is None
    old_fp16 = OLD_BWD_SM90.replace("13__nv_bfloat16Li128ELb0ELi64E", "6__halfLi64ELb1ELi128E")
    assert short_of(old_fp16) == "bwd_sm90_fp16_d64_r128_c128_ft"
    assert short_of(OLD_BWD_SM90.replace("Li64E", "")) == "bwd_sm90_bf16_d128_r64_c128_f"
    for cfg in bwd_sm90.DEFAULT:
        assert parse_kernel(cfg.name) == cfg and is_hopper(cfg)
        assert archs_of(cfg, ["80", "90"]) == ["90a"]
    assert not is_hopper(parse_kernel("bwd_sm80_bf16_d128_r64_c128_w8_fh"))
    assert not is_hopper(parse_kernel("bwd_sm80_preprocess_bf16"))
    assert not is_hopper(parse_kernel("bwd_sm80_convert_dq_bf16"))


def test_hopper_names_and_families_agree():
    """The name prefix the SASS tools go by names the same kernels as the family."""
    from fa_tools.analysis.kernel_names import is_hopper, is_hopper_name

    kernels = [*resolve("all"), *helpers(resolve("all"))]
    assert {c.family for c in kernels} == {"sm80", "sm90"}
    assert {c.KIND for c in kernels if not isinstance(c, HelperKernel)} == {
        "fwd_sm80", "fwd_sm90", "bwd_sm80", "bwd_sm90", "dec_sm80"}
    for cfg in kernels:
        assert is_hopper_name(cfg.name) == is_hopper(cfg), cfg.name


def test_backward_helpers_have_the_archs_of_their_units():
    """A helper is compiled in every backward unit of its dtype that holds it (the preprocess
    in both kinds', a dQ conversion in its own kind's): under the build's archs for an
    sm80-family unit, under 90a for a Hopper one; without the build's backward kernels, its
    family's (the build's archs, 90a alone for the Hopper dQ conversion)."""
    pre = parse_kernel("bwd_sm80_preprocess_bf16")
    rows, tiles = parse_kernel("bwd_sm80_convert_dq_bf16"), parse_kernel("bwd_sm90_convert_dq_bf16")
    sm80 = parse_kernel("bwd_sm80_bf16_d128_r64_c128_w8_fh")
    hopper = parse_kernel("bwd_sm90_bf16_d128_r64_c128_f")
    fp16_hopper = parse_kernel("bwd_sm90_fp16_d64_r64_c128_ft")
    assert archs_of(pre, ["80", "90"]) == ["80", "90"]
    assert archs_of(pre, ["80", "90"], [sm80]) == ["80", "90"]
    assert archs_of(pre, ["80", "90"], [hopper, sm80]) == ["80", "90", "90a"]
    assert archs_of(pre, ["80", "90"], [hopper]) == ["90a"]
    assert archs_of(pre, ["80", "90"], [fp16_hopper]) == []
    assert archs_of(pre, ["90a"], [sm80, hopper]) == ["90a"]
    assert archs_of(rows, ["80", "90"]) == ["80", "90"]
    assert archs_of(rows, ["80", "90"], [hopper, sm80]) == ["80", "90"]
    assert archs_of(rows, ["80", "90"], [hopper]) == []
    assert archs_of(tiles, ["80", "90"]) == ["90a"]
    assert archs_of(tiles, ["80", "90"], [hopper, sm80]) == ["90a"]
    assert archs_of(tiles, ["80", "90"], [sm80]) == []
    assert archs_of(tiles, ["80", "90"], [fp16_hopper]) == []


def test_hopper_backward_ptxas_records():
    """ptxas's report of a Hopper backward unit (its main kernel and its kind's helpers of
    its dtype, all sm_90a): named by kernel name, with the config's shared memory and
    occupancy."""
    def entry(name: str, regs: int, barriers: int) -> str:
        return (f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'\n"
                f"ptxas info    : Function properties for {name}\n"
                "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
                f"ptxas info    : Used {regs} registers, used {barriers} barriers\n")

    text = entry(BWD_SM90, 168, 16) + entry(BWD_PRE, 28, 0) + entry(BWD_TILES, 20, 0)
    by = {r.kernel: r for r in ptxas_report.parse(text)}
    main = by["bwd_sm90_bf16_d128_r64_c128_f"]
    assert (main.arch, main.registers, main.barriers, main.dynamic_smem) == ("90a", 168, 16,
                                                                             198784)
    assert (main.ctas_per_sm, main.warps_per_sm) == (1, 12)
    assert by["bwd_sm80_preprocess_bf16"].arch == "90a"
    tiles = by["bwd_sm90_convert_dq_bf16"]
    assert (tiles.arch, tiles.dynamic_smem) == ("90a", 0)
    assert tiles.warps_per_sm == tiles.ctas_per_sm * 8  # 256 threads a CTA


# cuobjdump's names of a build's units: this scheme's (a unit named after its kernel, one
# registry) and the old one's (fwd_<old name>, <old backward name>, bwd_registry), which the
# tools read under the current names (a gate base from before the one name scheme)
UNITS = {"new": ["bwd_sm80_bf16_d128_r64_c128_w8_fh.sm_90", "registry.sm_90",
                 "bwd_sm90_bf16_d128_r64_c128_f.sm_90a",
                 "fwd_sm90_bf16_d128_r128_c128_s2_fwal.sm_90a",
                 "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor.sm_90"],
         "old": ["bwd_bf16_d128_c128_r64_w8_fb.sm_90", "bwd_registry.sm_90",
                 "bwd_sm90_bf16_d128_c128_r64_f.sm_90a",
                 "fwd_sm90_bf16_d128_c128_g2_s2_fwes.sm_90a",
                 "fwd_bf16_d128_r128_c64_w4_fseqkvbor.sm_90", "registry.sm_90"]}


@pytest.mark.parametrize("scheme", UNITS)
def test_hopper_backward_cubin_members(monkeypatch, tmp_path, scheme):
    """cuobjdump's listing of a build with both backward kinds: a Hopper unit adds its main
    kernel and its kind's helpers (the preprocess, the tile-order dQ conversion) under 90a;
    --arch 90 finds a Hopper kernel's sm_90a code, the Hopper dQ conversion's too. A build from
    before the one name scheme lists the same kernels under their current names."""
    units = UNITS[scheme]
    listing = "".join(f"ELF file {i}: {name}.cubin\n" for i, name in enumerate(units))
    monkeypatch.setattr(cubins, "run_tool", lambda *args, **kw: listing)
    binary = tmp_path / "x.so"  # a file: listings are cached by its state
    binary.touch()
    members = cubins.list_cubins(binary)
    got = {(m.kernel, m.arch): m.file for m in members}
    hopper = "bwd_sm90_bf16_d128_r64_c128_f"
    assert set(got) == {("bwd_sm80_bf16_d128_r64_c128_w8_fh", "90"),
                        ("bwd_sm80_preprocess_bf16", "90"), ("bwd_sm80_convert_dq_bf16", "90"),
                        (hopper, "90a"), ("bwd_sm80_preprocess_bf16", "90a"),
                        ("bwd_sm90_convert_dq_bf16", "90a"),
                        ("fwd_sm90_bf16_d128_r128_c128_s2_fwal", "90a"),
                        ("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor", "90")}
    hopper_file, sm80_file = f"{units[2]}.cubin", f"{units[0]}.cubin"
    assert got[("bwd_sm80_preprocess_bf16", "90a")] == hopper_file
    assert got[("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor", "90")] == f"{units[4]}.cubin"
    monkeypatch.setattr(cubins, "_extracted", lambda binary, stamp: Path("/x"))
    monkeypatch.setattr(cubins, "_stamp", lambda binary: "s")
    assert cubins.cubin(binary, hopper, "90") == Path(f"/x/{hopper_file}")
    assert cubins.cubin(binary, "bwd_sm80_preprocess_bf16", "90") == Path(
        f"/x/{sm80_file}")
    assert cubins.cubin(binary, "bwd_sm90_convert_dq_bf16", "90") == Path(
        f"/x/{hopper_file}")
    with pytest.raises(binaries.ToolError, match="no sm_80 code for " + hopper):
        cubins.cubin(binary, hopper, "80")


def test_listings_and_stamp_are_cached_by_file_state(monkeypatch, tmp_path):
    """cuobjdump lists a binary, and its content is hashed, once per state of its file: a
    rebuilt binary is listed and hashed anew, never served from an older build's."""
    runs = []

    def listing(name, *args, **kw):
        runs.append(args)
        return f"ELF file 1: {unit}.sm_90.cubin\n"

    monkeypatch.setattr(cubins, "run_tool", listing)
    binary = tmp_path / "x.so"
    unit = "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"
    binary.write_bytes(b"first build")
    first = cubins._stamp(binary)
    assert cubins.list_cubins(binary) == cubins.list_cubins(binary) == [
        cubins.Member(unit, "90", f"{unit}.sm_90.cubin")]
    assert len(runs) == 1 and cubins._stamp(binary) == first
    unit = "fwd_sm80_fp16_d128_r128_c64_w4_fseqkvbor"
    binary.write_bytes(b"the second build")
    assert [m.kernel for m in cubins.list_cubins(binary)] == [unit]
    assert len(runs) == 2 and cubins._stamp(binary) != first


def test_cli_names_the_hopper_backward_set(monkeypatch):
    """bwd_sm90:default names the built Hopper backward kernels and their helpers (the
    preprocess and the tile-order dQ conversion); bwd:default both kinds' (the Hopper set is
    part of it); with an arch, a selection keeps the kernels that have code for it (the Hopper
    ones under 90, none of them under 80); a selection of every kind (default) the forward
    kernels too; a helper's name is kept as it is."""
    from fa_tools import cli as cli_module

    built = ["bwd_sm90_bf16_d128_r64_c128_f", "bwd_sm90_bf16_d128_r64_c128_ft",
             "bwd_sm80_bf16_d128_r64_c128_w8_fh", "bwd_sm80_preprocess_bf16",
             "bwd_sm80_convert_dq_bf16", "bwd_sm90_convert_dq_bf16",
             "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor", "fwd_sm90_bf16_d128_r128_c128_s2_fwal"]
    monkeypatch.setattr(cubins, "list_cubins", lambda binary: [
        cubins.Member(k, "90a" if "_sm90_" in k else "90", "f") for k in built])
    assert cli_module._kernels(Path("x.so"), ["bwd_sm90:default"]) == [
        "bwd_sm90_bf16_d128_r64_c128_f", "bwd_sm90_bf16_d128_r64_c128_ft",
        "bwd_sm80_preprocess_bf16", "bwd_sm90_convert_dq_bf16"]
    assert cli_module._kernels(Path("x.so"), ["bwd:default"]) == [
        "bwd_sm80_bf16_d128_r64_c128_w8_fh", "bwd_sm90_bf16_d128_r64_c128_f",
        "bwd_sm90_bf16_d128_r64_c128_ft", "bwd_sm80_preprocess_bf16", "bwd_sm80_convert_dq_bf16",
        "bwd_sm90_convert_dq_bf16"]
    assert cli_module._kernels(Path("x.so"), ["bwd:default"], "90") == cli_module._kernels(
        Path("x.so"), ["bwd:default"])
    assert cli_module._kernels(Path("x.so"), ["bwd:default"], "80") == []
    assert cli_module._kernels(Path("x.so"), ["default"])[:2] == [
        "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor", "fwd_sm90_bf16_d128_r128_c128_s2_fwal"]
    assert cli_module._kernels(Path("x.so"), ["bwd_sm90_convert_dq_bf16", "fwd_sm90:prog"]) == [
        "bwd_sm90_convert_dq_bf16"]


def test_hopper_backward_kernels_do_not_spill_or_serialize(tmp_path):
    """The Hopper backward's default set compiled here for sm_90a (its one target), named from
    ptxas's own output: no spill, no stack and no wgmma serialized by ptxas (a C75xx note);
    each unit holds its main kernel and its kind's two helpers of its dtype (the preprocess,
    the tile-order dQ conversion)."""
    from flash_attention.codegen.generate import kernel_source

    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        pytest.skip("nvcc not found")

    def compile_one(cfg):
        src = tmp_path / f"{cfg.name}.cu"
        src.write_text(kernel_source(cfg))
        proc = subprocess.run([nvcc, "-cubin", "-O3", "-std=c++17", "--expt-relaxed-constexpr",
                               "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas=-v",
                               f"-I{ROOT / 'src/csrc'}", str(src), "-o",
                               str(src.with_suffix(".cubin"))],
                              capture_output=True, text=True, check=True)
        return cfg, ptxas_report.parse(proc.stderr)

    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        done = list(pool.map(compile_one, bwd_sm90.DEFAULT))
    for cfg, records in done:
        assert {(r.kernel, r.arch) for r in records} == {
            (cfg.name, "90a"), *((h.name, "90a") for h in helpers_of(cfg))}
        bad = [(r.kernel, r.spill_stores, r.stack_frame, r.wgmma_serialized) for r in records
               if r.spill_stores or r.spill_loads or r.stack_frame or r.wgmma_serialized]
        assert not bad, f"{cfg.name}: {bad}"


def test_kernel_code_picks_one_kernel_of_a_backward_cubin():
    main = {"function-name": BWD_MAIN, "start": 0, "sass-instructions": [{"opcode": "HMMA"}]}
    pre = {"function-name": BWD_PRE, "start": 16, "sass-instructions": [{"opcode": "FMUL"}]}
    assert sass.kernel_code([pre, main], "b.cubin", "bwd_sm80_preprocess_bf16") == [
        {"opcode": "FMUL"}]
    assert sass.kernel_code([pre, main], "b.cubin", "bwd_sm80_bf16_d128_r64_c128_w8_fh") == [
        {"opcode": "HMMA"}]
    text = (f"\t.headerflags x\n//----- .text.{BWD_PRE} -----\n"
            f"\t.section\t.text.{BWD_PRE},\"ax\",@progbits\n  FMUL\n"
            f"//----- .text.{BWD_MAIN} -----\n"
            f"\t.section\t.text.{BWD_MAIN},\"ax\",@progbits\n  HMMA\n")
    assert "HMMA" not in sass.function_text(text, "bwd_sm80_preprocess_bf16")
    assert BWD_MAIN not in sass.function_text(text, "bwd_sm80_preprocess_bf16")
    assert "FMUL" not in sass.function_text(text, "bwd_sm80_bf16_d128_r64_c128_w8_fh")
    assert ".headerflags" in sass.function_text(text, "bwd_sm80_bf16_d128_r64_c128_w8_fh")


def _other_sass_tools() -> Path | None:
    """cuobjdump + nvdisasm of another version than the pinned ones: $FA_OTHER_SASS_TOOLS_DIR,
    else the copies triton ships (13.1, which, like the CUDA 13.0 toolkit, lists subroutines
    as functions of their own)."""
    if os.environ.get("FA_OTHER_SASS_TOOLS_DIR"):
        return Path(os.environ["FA_OTHER_SASS_TOOLS_DIR"])
    for entry in sys.path:
        d = Path(entry) / "triton" / "backends" / "nvidia" / "bin"
        if (d / "nvdisasm").is_file() and (d / "cuobjdump").is_file():
            return d
    return None


def test_counts_agree_across_nvdisasm_versions(built, monkeypatch):
    other = _other_sass_tools()
    if other is None:
        pytest.skip("no second set of SASS tools (set FA_OTHER_SASS_TOOLS_DIR)")
    binary, info = built
    kernel = info["configs"][0]
    mine = sass.instructions(binary, kernel, "90")
    version = binaries.tool_version("nvdisasm")
    monkeypatch.setenv("FA_SASS_TOOLS_DIR", str(other))
    if binaries.tool_version("nvdisasm") == version:
        pytest.skip(f"{other} holds the same nvdisasm version ({version})")
    theirs = sass.instructions(binary, kernel, "90")
    assert len(theirs) == len(mine)
    assert (opcodes.histogram(kernel, "90", theirs).categories
            == opcodes.histogram(kernel, "90", mine).categories)


def test_missing_tool_names_its_package(monkeypatch):
    monkeypatch.setattr(binaries, "_candidate_dirs", lambda: [])
    with pytest.raises(binaries.ToolError, match="pip install nvidia-cuda-nvdisasm"):
        binaries.find_tool("nvdisasm")


def test_missing_arch_and_kernel(built):
    binary, info = built
    with pytest.raises(binaries.ToolError, match="has no sm_86 code"):
        cubins.cubin(binary, info["configs"][0], "86")
    with pytest.raises(binaries.ToolError, match="is not in"):
        cubins.cubin(binary, "fwd_sm80_bf16_d64_r64_c64_w4_f", "90")


def test_cli_module_entry_point(built):
    out = subprocess.run([sys.executable, "-m", "fa_tools", "sass", "list", "--format", "csv"],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "kernel,arch,fatbin_ptx"


def test_default_configs_do_not_spill_or_serialize(tmp_path):
    """The kernels dispatch runs must be spill-free on both architectures (the Hopper family on
    sm_90a, the only one it compiles for; ptxas's word), except
    the ones ci/gate_policy.yaml lists with a byte limit and the measurement behind it; and no
    Hopper kernel may have its wgmma serialized by ptxas (a C75xx note)."""
    from flash_attention.codegen.generate import kernel_source

    default = resolve("fwd:default")
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        pytest.skip("nvcc not found")

    def compile_one(job):
        cfg, arch = job
        src = tmp_path / f"{cfg.name}_{arch}.cu"
        src.write_text(kernel_source(cfg))
        target = f"-gencode=arch=compute_{arch},code=sm_{arch}"  # 90a: the Hopper family
        proc = subprocess.run([nvcc, "-cubin", "-O3", "-std=c++17", target,
                               "-Xptxas=-v", f"-I{ROOT / 'src/csrc'}", str(src), "-o",
                               str(src.with_suffix(".cubin"))],
                              capture_output=True, text=True, check=True)
        return ptxas_report.parse(proc.stderr)[0]

    jobs = [(cfg, arch) for cfg in default for arch in archs_of(cfg, ["80", "90"])]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        records = list(pool.map(compile_one, jobs))
    allowed = {k: v["bytes"] for k, v in
               ratchet.load_yaml(ROOT / "ci" / "gate_policy.yaml")["static"].get(
                   "spill_exceptions", {}).items()}
    spilling = [(r.kernel, r.arch, r.spill_stores) for r in records
                if r.spill_stores > allowed.get(r.kernel, 0)]
    assert not spilling, f"default kernels spill (beyond the policy's exceptions): {spilling}"
    serialized = [(r.kernel, r.wgmma_serialized) for r in records if r.wgmma_serialized]
    assert not serialized, f"ptxas serialized the wgmma of default kernels: {serialized}"
    assert all(k in {c.name for c in default} for k in allowed), \
        "a spill exception names a kernel that is not a default kernel"


def test_diff_of_names_that_are_not_files_says_so(tmp_path):
    """Two config names given as files: a clear error pointing at --configs, not a traceback."""
    with pytest.raises(SystemExit, match=r"is not a file.*--configs A B"):
        cli(["diff", "fwd_sm90_bf16_d128_r128_c128_s2_fwal",
             "fwd_sm90_bf16_d128_r128_c128_s2_fwalx"])
    bad = tmp_path / "report.json"
    bad.write_text("not json")
    with pytest.raises(SystemExit, match="is not a JSON report"):
        cli(["diff", str(bad), str(bad)])
