"""Finding the CUDA binary tools and the built extension, and running the tools.

cuobjdump and nvdisasm come from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm: they land
in site-packages/nvidia/cu13/bin) or a CUDA toolkit; c++filt from binutils. A missing tool is
reported with the package that provides it."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

PROVIDERS = {
    "cuobjdump": "pip install nvidia-cuda-cuobjdump",
    "nvdisasm": "pip install nvidia-cuda-nvdisasm",
    "c++filt": "the binutils package of your OS (apt-get install binutils)",
    "compute-sanitizer": "the CUDA toolkit (its compute-sanitizer component)",
}


class ToolError(RuntimeError):
    """A tool is missing, failed, or the binary lacks what was asked for."""


def _candidate_dirs() -> list[Path]:
    """Where to look, in order: $FA_SASS_TOOLS_DIR when set (to run the analyses with, say, a
    CUDA toolkit's own tools), the PyPI packages (their versions are pinned, so SASS counts
    match the pins), then PATH, CUDA_HOME and the default toolkit."""
    dirs = [Path(os.environ["FA_SASS_TOOLS_DIR"])] if os.environ.get("FA_SASS_TOOLS_DIR") else []
    for entry in sys.path:
        for sub in ("cu13", "cu12", "cuda_cuobjdump", "cuda_nvdisasm"):
            dirs.append(Path(entry) / "nvidia" / sub / "bin")
    dirs += [Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]) / "bin")
    dirs.append(Path("/usr/local/cuda/bin"))
    return dirs


def find_tool(name: str) -> str:
    for directory in _candidate_dirs():
        path = directory / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise ToolError(f"{name} not found in site-packages, on PATH or in CUDA_HOME; install it "
                    f"with {PROVIDERS.get(name, 'the CUDA toolkit')}")


def tool_version(name: str) -> str:
    """The tool's version as it prints it (e.g. 13.5.37), or 'unknown'."""
    m = re.search(r"V(\d+\.\d+\.\d+)", run_tool(name, "--version"))
    return m[1] if m else "unknown"


def tool_origin(path: str) -> str:
    """Where a tool comes from: a PyPI package (pinned versions) or a CUDA toolkit."""
    return "PyPI package" if f"{os.sep}site-packages{os.sep}" in path else "CUDA toolkit / PATH"


def tools_in_use() -> dict[str, dict[str, str]]:
    """{tool: {path, version, origin}} of the SASS tools the analyses run (missing ones left
    out), so every report can say which tools made its counts."""
    out = {}
    for name in ("cuobjdump", "nvdisasm"):
        try:
            path = find_tool(name)
            out[name] = {"path": path, "version": tool_version(name), "origin": tool_origin(path)}
        except ToolError:
            continue
    return out


def run_tool(name: str, *args: str, cwd: str | Path | None = None) -> str:
    cmd = [find_tool(name), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, check=False)
    if proc.returncode != 0:
        raise ToolError(f"{name} {' '.join(args)} failed ({proc.returncode}): "
                        f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def demangle(names: list[str]) -> list[str]:
    if not names:
        return []
    out = subprocess.run([find_tool("c++filt")], input="\n".join(names), capture_output=True,
                         text=True, check=True).stdout.splitlines()
    return out


def package_dir() -> Path:
    spec = importlib.util.find_spec("flash_attention")  # does not import the package
    if spec is None or spec.origin is None:
        raise ToolError("the flash_attention package is not installed")
    return Path(spec.origin).parent


def extension_path() -> Path:
    """The built extension (flash_attention/_C*.so)."""
    found = sorted(package_dir().glob("_C*.so"))
    if not found:
        raise ToolError("flash_attention._C is not built; build it with "
                        "`pip install --no-build-isolation -e .`")
    return found[0]


def ptxas_log_path() -> Path:
    from flash_attention._extension import ptxas_log_path as kept_by_build

    path = kept_by_build()
    if not path.exists():
        raise ToolError(f"no ptxas report at {path}: build the extension with "
                        "`pip install --no-build-isolation -e .` (the build writes it)")
    return path
