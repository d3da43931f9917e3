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
from .kernel_names import short_of

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


# A section's `.section` line, with the `//---- name ----` banner nvdisasm prints before it.
_SECTION = re.compile(r"^(?://-+ \S+ -+\n)?\s*\.section\s+(?P<name>[^,\s]+)", re.M)


def function_text(text: str, kernel: str) -> str:
    """nvdisasm's text of a cubin with the code sections of its other kernels left out (a
    backward cubin holds three kernels; a forward one is returned as is). A section runs from
    its banner and `.section` line to the next; code sections are `.text.<symbol>`."""
    starts = list(_SECTION.finditer(text))
    kernels = {m["name"] for m in starts if m["name"].startswith(".text.")
               and short_of(m["name"][len(".text."):]) is not None}
    if len(kernels) <= 1:
        return text
    out = [text[:starts[0].start()] if starts else text]
    for m, nxt in zip(starts, [*starts[1:], None]):
        name = m["name"]
        if name in kernels and short_of(name[len(".text."):]) != kernel:
            continue
        out.append(text[m.start():nxt.start() if nxt else len(text)])
    return "".join(out)


def dump(binary: Path, kernel: str, arch: str, strip_addresses: bool = False,
         line_info: bool = False, demangled: bool = True) -> str:
    """nvdisasm's text of the kernel's cubin; of a backward cubin, the kernel's code alone."""
    args = ["-c"] + (["-gp"] if line_info else [])
    text = function_text(run_tool("nvdisasm", *args, str(cubins.cubin(binary, kernel, arch))),
                         kernel)
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


def instructions(binary: Path, kernel: str, arch: str, ptx_lines: bool = True
                 ) -> list[Instruction]:
    """Every SASS instruction of the kernel in address order, with its PTX line when the
    build kept line info; without `ptx_lines`, every line is None (the lines take a second
    disassembly, as long as the first: the counts do without)."""
    path = cubins.cubin(binary, kernel, arch)
    data = json.loads(run_tool("nvdisasm", "-json", str(path)))
    raw = kernel_code(data[1], path.name, kernel)
    lines = _ptx_lines(path, len(raw), kernel) if ptx_lines else [None] * len(raw)
    return [Instruction(i["opcode"], i.get("operands", ""), i.get("predicate", ""), line)
            for i, line in zip(raw, lines)]


def kernel_code(functions: list[dict], cubin_name: str, kernel: str | None = None
                ) -> list[dict]:
    """The kernel's instructions from nvdisasm -json's function list, in address order. A
    forward cubin holds one kernel; subroutines the compiler added to it (64-bit division, the
    slow path of an IEEE reciprocal: `$__internal_N_$__cuda_sm20_...`) are part of its code.
    nvdisasm 13.5 lists them inside the kernel's function, 13.0 and 13.1 as functions of their
    own; concatenating by address gives the same instructions either way. A backward cubin
    holds three kernels: `kernel` (a name) picks its function alone (the backward
    kernels call no subroutine)."""
    kernels = [f for f in functions if not f["function-name"].startswith("$__internal")]
    if len(kernels) > 1 and kernel is not None:
        mine = [f for f in kernels if short_of(f["function-name"]) == kernel]
        if len(mine) == 1:
            return list(mine[0]["sass-instructions"])
    if len(kernels) != 1:
        names = ", ".join(f["function-name"] for f in functions) or "none"
        raise ToolError(f"expected one kernel in {cubin_name}, found {len(kernels)}: {names}")
    code: list[dict] = []
    for function in sorted(functions, key=lambda f: f.get("start", 0)):
        code += function["sass-instructions"]
    return code


def _ptx_lines(path: Path, count: int, kernel: str | None = None) -> list[int | None]:
    """PTX line of each instruction, from nvdisasm -gp (one annotation precedes a run of
    instructions of the same line)."""
    text = run_tool("nvdisasm", "-c", "-gp", str(path))
    if kernel is not None:
        text = function_text(text, kernel)
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
