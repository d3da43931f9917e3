"""The repository the tools belong to, and its files. The gate's policy and pins
(ci/gate_policy.yaml, ci/perf_accept.yaml, ci/baselines/static.yaml) and the head it measures
are found from it, never from the current directory: a gate command run from elsewhere (a
workflow step's own directory, /tmp) reads the same files as one run from the top level."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .analysis.binaries import ToolError

CHECKOUT = Path(__file__).resolve().parents[2]  # src/fa_tools/paths.py -> the top level
MARKERS = ("noxfile.py", "setup.py")  # the project's files there


class RepoFileError(ToolError):
    """No repository to read a file from, or the file is not in it (exit 3, as a missing
    tool)."""


def _git_toplevel() -> Path | None:
    try:
        proc = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                              text=True, check=False)
    except OSError:  # no git
        return None
    top = proc.stdout.strip()
    return Path(top) if proc.returncode == 0 and top else None


def repo_root(needed_for: str = "the repository") -> Path:
    """The checkout holding this package (the directory above src/ with the project's
    noxfile.py and setup.py); for a copy installed elsewhere (site-packages), the git toplevel
    of the current directory. Raises RepoFileError naming `needed_for` and where it looked."""
    if all((CHECKOUT / name).is_file() for name in MARKERS):
        return CHECKOUT
    top = _git_toplevel()
    if top is None:
        raise RepoFileError(f"cannot find {needed_for}: {CHECKOUT} (the top level, were this "
                            f"fa_tools a checkout's src/fa_tools) has no {' and '.join(MARKERS)}, "
                            f"and {Path.cwd()} is in no git checkout")
    return top


def repo_file(relpath: str | Path, must_exist: bool = True) -> Path:
    """`relpath` in the repository (an absolute path as it is). With must_exist, a file that
    is not there raises RepoFileError naming the path looked at."""
    path = Path(relpath)
    if path.is_absolute():
        return path
    found = repo_root(str(relpath)) / path
    if must_exist and not found.exists():
        raise RepoFileError(f"{relpath} not found: no {found}")
    return found
