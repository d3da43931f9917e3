"""asv benchmarks of flash_attention, and the glue asv.conf.json runs (standard library only).

asv builds every commit it measures in a virtualenv of its own (asv.conf.json: environment
type "virtualenv"), so `asv run A..B`, `asv continuous` and `asv find` work. torch is never
installed there (several GB, and GPU runners have no network): the environment uses the torch
of the interpreter that runs asv. A virtualenv's system site-packages are those of the *base*
interpreter, so VIRTUALENV_SYSTEM_SITE_PACKAGES does not reach a torch installed in a venv
(the GPU runner's /opt/torch/.venv, this repository's .venv); instead:

- ``setup()`` runs in the asv process (asv.conf.json loads this package as a plugin,
  ``"plugins": [".benchmarks"]``, so asv must run from the repository root). It exports
  FA_ASV_HOST_SITE, the site-packages directories of that interpreter (set it yourself to use
  another torch), and forgets the install of any environment whose build was made for another
  kernel or arch selection, so the next run reinstalls it.
- ``python benchmarks/__init__.py build|install BUILD_DIR WHEEL_DIR`` are asv.conf.json's
  build and install commands, run by the environment's python. Both first write
  ``fa_host_site.pth`` into the environment: it appends FA_ASV_HOST_SITE to sys.path *after*
  the environment's own site-packages, so the commit's build always wins over anything
  installed in the host. ``build`` runs ``pip wheel --no-build-isolation --no-deps`` for the
  selection below (asv keeps the wheel per commit); ``install`` installs it with ``--no-deps``
  (torch is never resolved), rebuilding first if it was made for another selection.

Selection: FLASH_ATTENTION_KERNELS (default ``default``), FLASH_ATTENTION_ARCHS (default: the
local GPU's arch from nvidia-smi, else ``80,90``), MAX_JOBS (default: all cores). Unchanged
translation units come from the object cache of the compile wrapper (FA_BUILD_CACHE, see
src/flash_attention/codegen/nvcc_wrapper.py; src/flash_attention/nvcc_wrapper.py in commits from
before flash_attention.codegen), so a commit that changes Python only builds in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HOST_SITE_VAR = "FA_ASV_HOST_SITE"
PTH_NAME = "fa_host_site.pth"
STAMP = "fa-build.json"  # the selection a wheel (in its cache dir) or an install was made for


def host_site_dirs() -> list[str]:
    """The site-packages directories of the running interpreter (a venv's and, if it includes
    them, its base's), without source trees that .pth files or PYTHONPATH put on sys.path."""
    dirs = [p for p in sys.path
            if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
    return list(dict.fromkeys(os.path.realpath(p) for p in dirs))


def local_archs() -> str:
    """The compute capabilities of the local GPUs (e.g. "90"), else "80,90"."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "80,90"
    caps = sorted({line.strip().replace(".", "") for line in out.splitlines() if line.strip()})
    return ",".join(caps) if caps and all(c.isdigit() for c in caps) else "80,90"


def selection() -> dict[str, str]:
    return {"kernels": os.environ.get("FLASH_ATTENTION_KERNELS") or "default",
            "archs": os.environ.get("FLASH_ATTENTION_ARCHS") or local_archs()}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- asv plugin: runs in the asv process ----------------------------------------------------

def setup() -> None:
    """asv plugin hook (called once when asv starts)."""
    os.environ.setdefault(HOST_SITE_VAR, os.pathsep.join(host_site_dirs()))
    try:
        from asv import util

        conf = util.load_json("asv.conf.json", js_comments=True)
    except Exception:  # another config file or no asv: nothing to check
        return
    wanted = None
    for env in Path(conf.get("env_dir", "env")).glob("*"):
        stamp = _read_json(env / STAMP)
        if stamp is None:
            continue
        wanted = wanted or selection()
        if stamp.get("selection") != wanted:
            # asv skips the install when the same commit is installed; make it reinstall
            (env / "asv-install-status.json").unlink(missing_ok=True)


# --- build and install commands: run by the environment's python ----------------------------

def _say(message: str) -> None:
    print(f"asv-build: {message}", flush=True)


def ensure_host_site() -> None:
    """Write fa_host_site.pth into this environment and check that torch imports."""
    import sysconfig

    dirs = [d for d in os.environ.get(HOST_SITE_VAR, "").split(os.pathsep) if d]
    if not dirs:
        raise SystemExit(f"asv-build: {HOST_SITE_VAR} is not set: run asv from the repository "
                         "root (asv.conf.json loads the benchmarks plugin that sets it), or "
                         "set it to the site-packages directory that holds torch")
    own = os.path.realpath(sysconfig.get_paths()["purelib"])
    lines = [d for d in dirs if os.path.realpath(d) != own]
    Path(own, PTH_NAME).write_text("".join(f"{d}\n" for d in lines))
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise SystemExit(f"asv-build: torch does not import in the asv environment with "
                         f"{HOST_SITE_VAR}={os.pathsep.join(lines)}:\n{probe.stderr[-2000:]}")
    _say(f"torch {probe.stdout.strip()} from the host site-packages: {', '.join(lines)}")


def _wheels(wheel_dir: Path) -> list[Path]:
    return sorted(wheel_dir.glob("*.whl"))


def build(build_dir: Path, wheel_dir: Path) -> None:
    wanted = selection()
    env = {**os.environ, "FLASH_ATTENTION_KERNELS": wanted["kernels"],
           "FLASH_ATTENTION_ARCHS": wanted["archs"],
           "MAX_JOBS": os.environ.get("MAX_JOBS") or str(os.cpu_count() or 2)}
    for old in _wheels(wheel_dir):
        old.unlink()
    _say(f"building kernels {wanted['kernels']} for archs {wanted['archs']} "
         f"({env['MAX_JOBS']} jobs) in {build_dir}")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation",
                           "--no-deps", "-w", str(wheel_dir), str(build_dir)],
                          env=env, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    (wheel_dir / "build.log").write_text(log)
    for line in log.splitlines():
        if line.lstrip().startswith(("flash_attention:", "fa-build-cache:")):
            print(line.strip(), flush=True)
    if proc.returncode != 0 or len(_wheels(wheel_dir)) != 1:
        sys.stdout.write(log[-20000:])
        raise SystemExit(f"asv-build: the build failed ({proc.returncode}); log in "
                         f"{wheel_dir / 'build.log'}")
    (wheel_dir / STAMP).write_text(json.dumps({"selection": wanted,
                                               "seconds": round(seconds, 1)}) + "\n")
    _say(f"built {_wheels(wheel_dir)[0].name} in {seconds:.0f} s")


def install(build_dir: Path, wheel_dir: Path) -> None:
    wanted = selection()
    stamp = _read_json(wheel_dir / STAMP) or {}
    if stamp.get("selection") != wanted or len(_wheels(wheel_dir)) != 1:
        _say(f"the cached wheel was built for {stamp.get('selection')}; rebuilding")
        build(build_dir, wheel_dir)
    wheel = _wheels(wheel_dir)[0]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--force-reinstall", "--no-index", str(wheel)], check=True)
    Path(sys.prefix, STAMP).write_text(json.dumps({"selection": wanted}) + "\n")
    info = subprocess.run(
        [sys.executable, "-c", "import json, flash_attention as fa; "
         "print(json.dumps(fa.build_info()))"],
        capture_output=True, text=True, check=False, cwd=sys.prefix)
    _say(f"installed {wheel.name}: {info.stdout.strip() or info.stderr.strip()[-500:]}")


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("build", "install"):
        sys.stderr.write("usage: python benchmarks/__init__.py build|install BUILD_DIR "
                         "WHEEL_DIR\n")
        return 2
    ensure_host_site()
    command, build_dir, wheel_dir = argv[0], Path(argv[1]), Path(argv[2])
    wheel_dir.mkdir(parents=True, exist_ok=True)
    (build if command == "build" else install)(build_dir, wheel_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
