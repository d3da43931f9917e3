"""Build of the flash_attention CUDA extension.

Selected kernel configs (flash_attention.kernels) are generated as one .cu file each
(flash_attention.codegen), compiled in parallel by torch's ninja build (MAX_JOBS jobs) with no
torch headers in them, and linked with the two torch binding files. nvcc and the host C++
compiler run through flash_attention/codegen/nvcc_wrapper.py, which keeps each object's ptxas
resource lines (gathered into ptxas.log next to the extension and in build/ptxas.log, with
build_info.json saying what was built) and looks every object up in a content-addressed cache
first, so a translation unit that did not change is not compiled again, whichever checkout or
commit builds it (asv builds every commit in a fresh checkout).

Environment:
  FLASH_ATTENTION_KERNELS  kernel sets and/or kernel names, comma-separated (default:
                           "default"): a set of every kind that has it (ci, default, all), of one
                           kind or direction (fwd_sm90:tune, bwd:default), or names
                           (flash_attention.kernels says the scheme)
  FLASH_ATTENTION_ARCHS    SM architectures, comma-separated (default: "80,90"; "90a" allowed)
  MAX_JOBS                 parallel compile jobs
  FA_BUILD_CACHE           object cache directory (default ~/.cache/fa-build; "off" disables it)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

from setuptools import setup

# torch guesses CUDA_HOME from the nvcc on PATH, which may be a symlink outside the toolkit.
if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda/bin/nvcc").exists():
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "src" / "csrc"
GENERATED = CSRC / "generated"

sys.path.insert(0, str(ROOT / "src"))
from flash_attention.codegen.generate import generate  # noqa: E402
from flash_attention.kernels import resolve  # noqa: E402

sys.path.pop(0)

KERNELS = os.environ.get("FLASH_ATTENTION_KERNELS", "default")
ARCHS_SPEC = os.environ.get("FLASH_ATTENTION_ARCHS", "80,90")


def parse_archs(spec: str) -> list[str]:
    archs = []
    for item in re.split(r"[,;\s]+", spec.strip()):
        if not item:
            continue
        m = re.fullmatch(r"(?:sm_|compute_)?(\d)\.?(\d)(a?)", item)
        if m is None:
            raise SystemExit(f"FLASH_ATTENTION_ARCHS: cannot read {item!r}; use e.g. 80,90 or 90a")
        arch = f"{m[1]}{m[2]}{m[3]}"
        if int(arch[:2]) < 80:
            raise SystemExit(f"FLASH_ATTENTION_ARCHS: sm_{arch} is below sm_80 (mma.sync bf16, "
                             "cp.async and ldmatrix need Ampere or newer)")
        archs.append(arch)
    if not archs:
        raise SystemExit("FLASH_ATTENTION_ARCHS is empty")
    return list(dict.fromkeys(archs))


def gencode_flags(archs: list[str]) -> list[str]:
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    top = archs[-1]  # PTX of the last arch too, so newer GPUs can JIT it
    flags.append(f"-gencode=arch=compute_{top},code=compute_{top}")
    return flags


ARCHS = parse_archs(ARCHS_SPEC)
if "FLASH_ATTENTION_BWD_KERNELS" in os.environ:
    raise SystemExit("FLASH_ATTENTION_BWD_KERNELS is gone: FLASH_ATTENTION_KERNELS selects the "
                     "kernels of every kind (e.g. ci, default, default,bwd_sm90:r64; fwd:default "
                     "builds no backward kernel); docs/kernel-names.md")
CONFIGS = resolve(KERNELS)
FWD_CONFIGS = [c for c in CONFIGS if c.direction == "fwd"]
BWD_CONFIGS = [c for c in CONFIGS if c.direction == "bwd"]
DEC_CONFIGS = [c for c in CONFIGS if c.direction == "dec"]
SOURCES = [str(p.relative_to(ROOT)) for p in generate(CONFIGS, GENERATED)]
if CUDA_HOME:
    os.environ["CUDA_HOME"] = CUDA_HOME  # the nvcc wrapper runs the same toolkit as torch found
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", ";".join(f"{a[0]}.{a[1:]}" for a in ARCHS))
# Route nvcc through the wrapper that keeps the ptxas report of every object and caches objects.
WRAPPER = ROOT / "src" / "flash_attention" / "codegen" / "nvcc_wrapper.py"
os.environ["PYTORCH_NVCC"] = shlex.join([sys.executable, str(WRAPPER)])

NVCC_FLAGS = [
    "-O3",
    "-lineinfo",  # SASS <-> source mapping for the toolchain; no effect on the code
    "-Xptxas=-v",
    "--expt-relaxed-constexpr",
    *gencode_flags(ARCHS),
]


class BuildWithReport(BuildExtension):
    """torch's BuildExtension, then the ptxas report and build info beside the extension."""

    def run(self) -> None:
        print(f"flash_attention: building {len(FWD_CONFIGS)} forward, {len(BWD_CONFIGS)} "
              f"backward and {len(DEC_CONFIGS)} decode kernels ({KERNELS}) for "
              f"{', '.join('sm_' + a for a in ARCHS)}", flush=True)
        self._started = time.time()
        super().run()
        for ext in self.extensions:
            self._write_report(Path(self.get_ext_fullpath(ext.name)).parent)
        self._cache_summary()

    def build_extensions(self) -> None:
        # The C++ compile rule of torch's ninja file runs $CXX (read when the file is written,
        # after distutils configured its own compiler and linker): point it at a launcher of
        # the wrapper, so the binding (the costliest translation unit) is cached too.
        saved = {k: os.environ.get(k) for k in ("CXX", "TORCH_NO_COMPILER_WRAPPER")}
        os.environ["CXX"] = str(self._cxx_launcher(saved["CXX"] or "c++"))
        os.environ["TORCH_NO_COMPILER_WRAPPER"] = "1"  # no ccache in front of the launcher
        try:
            super().build_extensions()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _cxx_launcher(self, compiler: str) -> Path:
        path = Path(self.build_temp).resolve() / "fa-cxx"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n# written by setup.py: the host C++ compiler through the "
                        "caching wrapper\nexec " + shlex.join(
                            [sys.executable, str(WRAPPER), "--cxx", compiler]) + ' "$@"\n')
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return path

    def _cache_summary(self) -> None:
        """How many objects this build took from the object cache (the wrapper leaves a
        marker beside each object it handled; ninja does not run it for up-to-date ones)."""
        hits = misses = 0
        for marker in Path(self.build_temp).rglob("*.fa-cache.json"):
            if marker.stat().st_mtime < self._started - 1:
                continue
            result = json.loads(marker.read_text()).get("result")
            hits += result == "hit"
            misses += result == "miss"
        if hits or misses:
            print(f"flash_attention: object cache: {hits} hits, {misses} compiled "
                  f"({os.environ.get('FA_BUILD_CACHE') or '~/.cache/fa-build'})", flush=True)

    def _collect_logs(self, cfg_files: list[str]) -> str:
        logs = []
        for cfg_file in cfg_files:
            found = sorted(Path(self.build_temp).rglob(f"{cfg_file}.o.ptxas.log"))
            if found:
                logs.append(f"### {cfg_file}.cu\n{found[-1].read_text()}")
        return "".join(logs)

    def _write_report(self, ext_dir: Path) -> None:
        # One report of every kernel (forward, backward and their registries): the SASS tools
        # and the static ratchet name each by its config short form.
        report = self._collect_logs([*(c.name for c in CONFIGS), "registry"])
        info = {
            "kernels": KERNELS,
            "configs": [c.name for c in FWD_CONFIGS],
            "bwd_configs": [c.name for c in BWD_CONFIGS],
            "dec_configs": [c.name for c in DEC_CONFIGS],
            "archs": ARCHS,
            "nvcc": _nvcc_version(),
            "torch": _torch_version(),
        }
        for directory in (ext_dir, ROOT / "build"):
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "ptxas.log").write_text(report)
            (directory / "ptxas_bwd.log").unlink(missing_ok=True)  # an older build's
            (directory / "build_info.json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"flash_attention: ptxas report in {ext_dir / 'ptxas.log'}", flush=True)


def _nvcc_version() -> str:
    try:
        out = subprocess.run([os.path.join(CUDA_HOME or "/usr/local/cuda", "bin", "nvcc"),
                              "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    m = re.search(r"release ([\d.]+)", out)
    return m[1] if m else "unknown"


def _torch_version() -> str:
    import torch

    return torch.__version__


setup(
    ext_modules=[
        CUDAExtension(
            name="flash_attention._C",
            sources=["src/csrc/binding.cpp", "src/csrc/binding/backward.cpp",
                     "src/csrc/binding/decode.cpp", "src/csrc/binding/distributed.cpp",
                     "src/csrc/kvcache/append.cu", "src/csrc/distributed/merge.cu", *SOURCES],
            include_dirs=[str(CSRC)],
            extra_compile_args={"cxx": ["-O3"], "nvcc": NVCC_FLAGS},
        )
    ],
    cmdclass={"build_ext": BuildWithReport},
)
