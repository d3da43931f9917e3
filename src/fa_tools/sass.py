"""SASS of the built kernels: listing, text dump (addresses stripped on request, names
demangled), control-flow graph as DOT, the embedded PTX, and structured instructions (opcode,
operands, predicate, PTX line) from nvdisasm's JSON for the analyses."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from . import cubins
from .binaries import ToolError, demangle, run_tool

_ADDR = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s*", re.M)
_ENCODING = re.compile(r"\s*/\* 0x[0-9a-f]{16} \*/", re.M)
_MANGLED = re.compile(r"_ZN5flash\w+")
_LINE = re.compile(r'//## File "[^"]*", line (\d+)')


@dataclass(frozen=True)
class Instruction:
    opcode: str  # with modifiers, e.g. HMMA.16816.F32.BF16
    operands: str
    predicate: str  # "" or e.g. "@!P0"
    ptx_line: int | None = None

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def _demangle_text(text: str) -> str:
    names = sorted(set(_MANGLED.findall(text)), key=len, reverse=True)
    for name, plain in zip(names, demangle(names)):
        text = text.replace(name, plain)
    return text


def dump(binary: Path, kernel: str, arch: str, strip_addresses: bool = False,
         line_info: bool = False, demangled: bool = True) -> str:
    args = ["-c"] + (["-gp"] if line_info else [])
    text = run_tool("nvdisasm", *args, str(cubins.cubin(binary, kernel, arch)))
    if strip_addresses:
        text = _ENCODING.sub("", _ADDR.sub("        ", text))
    return _demangle_text(text) if demangled else text


def cfg_dot(binary: Path, kernel: str, arch: str, basic_blocks: bool = True) -> str:
    flag = "-bbcfg" if basic_blocks else "-cfg"
    text = run_tool("nvdisasm", flag, str(cubins.cubin(binary, kernel, arch)))
    if not text.lstrip().startswith("digraph"):
        raise ToolError("nvdisasm did not produce a DOT graph")
    return text


def ptx_text(binary: Path, kernel: str, arch: str) -> str:
    """The PTX of a kernel: the copy ptxas kept for line info in the cubin, else the PTX
    embedded in the fatbinary."""
    try:
        text = cubins.embedded_ptx(cubins.cubin(binary, kernel, arch))
    except ToolError:
        text = None
    if text is not None:
        return text
    return cubins.ptx(binary, kernel, arch).read_text()


def instructions(binary: Path, kernel: str, arch: str) -> list[Instruction]:
    """Every SASS instruction of the kernel in address order, with its PTX line when the
    build kept line info."""
    path = cubins.cubin(binary, kernel, arch)
    data = json.loads(run_tool("nvdisasm", "-json", str(path)))
    functions = data[1]
    if len(functions) != 1:
        raise ToolError(f"expected one function in {path.name}, found {len(functions)}")
    raw = functions[0]["sass-instructions"]
    lines = _ptx_lines(path, len(raw))
    return [Instruction(i["opcode"], i.get("operands", ""), i.get("predicate", ""), line)
            for i, line in zip(raw, lines)]


def _ptx_lines(path: Path, count: int) -> list[int | None]:
    """PTX line of each instruction, from nvdisasm -gp (one annotation precedes a run of
    instructions of the same line)."""
    text = run_tool("nvdisasm", "-c", "-gp", str(path))
    out: list[int | None] = []
    current: int | None = None
    for line in text.splitlines():
        m = _LINE.search(line)
        if m:
            current = int(m[1])
        elif re.match(r"\s*/\*[0-9a-f]{4,}\*/", line):
            out.append(current)
    if len(out) != count:
        return [None] * count
    return out
