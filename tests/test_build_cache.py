"""The object cache of the compile wrapper (src/flash_attention/codegen/nvcc_wrapper.py): a second
compile of the same translation unit is a hit with the same object, depfile and ptxas report;
any change of the source, of a header it includes or can include, of a header outside the
project that it read, or of the command line is a miss. CPU only; nvcc cases need nvcc."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flash_attention.codegen import nvcc_wrapper as w

WRAPPER = Path(w.__file__)
NVCC = Path(w._real_nvcc())
needs_nvcc = pytest.mark.skipif(not NVCC.is_file(), reason=f"no nvcc at {NVCC}")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on PATH")

KERNEL = """#include "inc/values.cuh"
#if 0
#include "inc/never.cuh"
#endif
__global__ void fill(float* p) { p[threadIdx.x] = kValue; }
"""
HOST = """#include <ext.h>
#include "local.h"
int answer() { return kExt + kLocal; }
"""


def compile_(tmp: Path, *args: str, cxx: bool = False) -> subprocess.CompletedProcess:
    prefix = ["--cxx", "g++"] if cxx else []
    env = {**os.environ, "FA_BUILD_CACHE": str(tmp / "cache")}
    return subprocess.run([sys.executable, str(WRAPPER), *prefix, *args], cwd=tmp, env=env,
                          capture_output=True, text=True, check=False)


def result_of(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(w.LOG_PREFIX)]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(lines) == 1, proc.stdout
    return lines[0].split()[1]


@pytest.fixture
def cuda_tree(tmp_path: Path) -> Path:
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "values.cuh").write_text("#pragma once\nconstexpr float kValue = 1.f;\n")
    (tmp_path / "inc" / "never.cuh").write_text("#pragma once\n")
    (tmp_path / "k.cu").write_text(KERNEL)
    return tmp_path


NVCC_ARGS = ["-O3", "-Xptxas=-v", "-gencode=arch=compute_80,code=sm_80", "-c", "k.cu"]


@needs_nvcc
def test_second_compile_is_a_hit_with_the_same_outputs(cuda_tree: Path):
    first = compile_(cuda_tree, *NVCC_ARGS, "-o", "a.o", "-MD", "-MF", "a.o.d")
    assert result_of(first) == "miss"
    second = compile_(cuda_tree, *NVCC_ARGS, "-o", "b.o", "-MD", "-MF", "b.o.d")
    assert result_of(second) == "hit"
    assert (cuda_tree / "a.o").read_bytes() == (cuda_tree / "b.o").read_bytes()
    # the ptxas report and the depfile (naming the new object) are restored
    assert "Used" in (cuda_tree / "b.o.ptxas.log").read_text()
    assert (cuda_tree / "b.o.ptxas.log").read_text() == (cuda_tree / "a.o.ptxas.log").read_text()
    depfile = (cuda_tree / "b.o.d").read_text()
    assert depfile.startswith("b.o") and "values.cuh" in depfile
    assert json.loads((cuda_tree / "b.o.fa-cache.json").read_text())["result"] == "hit"


@needs_nvcc
def test_header_changes_are_misses(cuda_tree: Path):
    assert result_of(compile_(cuda_tree, *NVCC_ARGS, "-o", "a.o")) == "miss"
    assert result_of(compile_(cuda_tree, *NVCC_ARGS, "-o", "a.o")) == "hit"
    # a header it includes
    (cuda_tree / "inc" / "values.cuh").write_text("#pragma once\nconstexpr float kValue = 2.f;\n")
    assert result_of(compile_(cuda_tree, *NVCC_ARGS, "-o", "a.o")) == "miss"
    # a header it can include (behind #if 0: the compiler never reads it)
    (cuda_tree / "inc" / "never.cuh").write_text("#pragma once\n// changed\n")
    assert result_of(compile_(cuda_tree, *NVCC_ARGS, "-o", "a.o")) == "miss"
    assert result_of(compile_(cuda_tree, *NVCC_ARGS, "-o", "a.o")) == "hit"
    # the command line (another arch)
    other = [a.replace("80", "90") for a in NVCC_ARGS]
    assert result_of(compile_(cuda_tree, *other, "-o", "a.o")) == "miss"


@needs_gxx
def test_host_compiler_and_headers_outside_the_project(tmp_path: Path):
    (tmp_path / "sys").mkdir()
    (tmp_path / "sys" / "ext.h").write_text("constexpr int kExt = 1;\n")
    (tmp_path / "local.h").write_text("constexpr int kLocal = 2;\n")
    (tmp_path / "h.cpp").write_text(HOST)
    args = ["-O2", "-isystem", "sys", "-c", "h.cpp", "-o", "h.o"]
    assert result_of(compile_(tmp_path, *args, cxx=True)) == "miss"
    assert result_of(compile_(tmp_path, *args, cxx=True)) == "hit"
    # <ext.h> is not scanned (angle brackets) but was read: the entry's manifest sees it
    (tmp_path / "sys" / "ext.h").write_text("constexpr int kExt = 3;\n")
    assert result_of(compile_(tmp_path, *args, cxx=True)) == "miss"
    # the source itself
    (tmp_path / "h.cpp").write_text(HOST + "int other() { return 0; }\n")
    assert result_of(compile_(tmp_path, *args, cxx=True)) == "miss"
    assert result_of(compile_(tmp_path, *args, cxx=True)) == "hit"


@needs_gxx
def test_failed_compiles_are_not_cached_and_off_disables(tmp_path: Path):
    (tmp_path / "bad.cpp").write_text("int f() { return undefined_name; }\n")
    args = ["-c", "bad.cpp", "-o", "bad.o"]
    for _ in range(2):
        proc = compile_(tmp_path, *args, cxx=True)
        assert proc.returncode != 0 and "undefined_name" in proc.stderr
        assert w.LOG_PREFIX not in proc.stdout
    entries = lambda: list((tmp_path / "cache").glob("*/*/manifest.json"))  # noqa: E731
    assert entries() == []
    (tmp_path / "ok.cpp").write_text("int g() { return 1; }\n")
    env = {**os.environ, "FA_BUILD_CACHE": "off"}
    proc = subprocess.run([sys.executable, str(WRAPPER), "--cxx", "g++", "-c", "ok.cpp", "-o",
                           "ok.o"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and w.LOG_PREFIX not in proc.stdout
    assert (tmp_path / "ok.o").is_file() and entries() == []


def test_depfile_parsing_and_placeholders():
    text = "out/a.o : src/a.cu \\\n    /usr/include/x.h \\\n    dir\\ with\\ space/y.h\n"
    assert w.read_depfile(text) == ["src/a.cu", "/usr/include/x.h", "dir with space/y.h"]
    comp = w.Compile(["-MD", "-MF", "/b/t1/a.o.d", "-c", "a.cu", "-o", "/b/t1/a.o"], "a.cu",
                     "/b/t1/a.o", "/b/t1/a.o.d")
    assert comp.normalised_args() == ["-MD", "-MF", "@DEP@", "-c", "a.cu", "-o", "@OBJ@"]
    assert w.Compile.parse(["--version"]) is None
    assert w.Compile.parse(["-shared", "a.o", "-o", "x.so"]) is None
