"""Runs nvcc and keeps its ptxas resource report.

The build points torch's ninja rules at this script (PYTORCH_NVCC). It runs the real nvcc with
the same arguments, writes everything nvcc printed on stderr to ``<object>.ptxas.log`` beside
the object, and passes through only what is not a ptxas info line, so warnings and errors still
reach the console while the per-kernel resource lines (registers, spills, stack, smem, compile
time) land in a file for the resource report. Standalone: imports nothing from the package.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

# ptxas -v lines: "ptxas info : ..." and the indented "N bytes stack frame, ..." property line.
_PTXAS_INFO = re.compile(r"^(ptxas info\s*:|\s+\d+ bytes stack frame,)")


def _real_nvcc() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return os.path.join(cuda_home, "bin", "nvcc")


def main(argv: list[str]) -> int:
    proc = subprocess.run([_real_nvcc(), *argv], stdout=sys.stdout, stderr=subprocess.PIPE,
                          text=True, check=False)
    if "-o" in argv and argv.index("-o") + 1 < len(argv):
        obj = argv[argv.index("-o") + 1]
        with open(obj + ".ptxas.log", "w") as fh:
            fh.write(proc.stderr)
    for line in proc.stderr.splitlines(keepends=True):
        if not _PTXAS_INFO.match(line):
            sys.stderr.write(line)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
