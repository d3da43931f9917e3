"""From a PTX line to what it became: the SASS instructions ptxas emitted for it (through the
line table of a -lineinfo build) and the backward register-dependence slice in the PTX (the
instructions that compute the registers it reads, transitively, scanning back in program
order without following branches)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .sass import Instruction

_REG = re.compile(r"%[a-z]+\d+")
# Instructions whose operands are all read (no register written).
_NO_DEST = ("st.", "cp.async", "bar.", "barrier.", "red.", "prefetch", "bra", "ret", "membar",
            "fence", "exit", "trap", "stmatrix", "mbarrier.arrive", "@")


@dataclass(frozen=True)
class PtxInstr:
    line: int  # 1-based
    text: str
    dests: frozenset[str]
    srcs: frozenset[str]


def _split_operands(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def parse_line(line_no: int, text: str) -> PtxInstr | None:
    """A PTX instruction line, or None for directives, labels, braces and blank lines."""
    body = text.split("//")[0].strip()
    if not body.endswith(";") or body.startswith("."):
        return None
    body = body[:-1].strip()
    pred = ""
    if body.startswith("@"):
        pred, body = body.split(None, 1)
    opcode, _, rest = body.partition(" ")
    operands = _split_operands(rest)
    pred_regs = set(_REG.findall(pred))
    if not operands or opcode.startswith(_NO_DEST):
        dests: set[str] = set()
        srcs = set(_REG.findall(rest))
    else:
        dests = set(_REG.findall(operands[0]))
        srcs = set(_REG.findall(",".join(operands[1:])))
        if operands[0].startswith("["):  # a memory destination reads its address register
            srcs |= dests
            dests = set()
    return PtxInstr(line_no, text.strip(), frozenset(dests), frozenset(srcs | pred_regs))


def backward_slice(ptx_lines: list[str], line_no: int, limit: int = 200) -> list[PtxInstr]:
    """The instructions (in program order) that the instruction at line_no depends on through
    registers, ending with that instruction."""
    if not 1 <= line_no <= len(ptx_lines):
        raise ValueError(f"PTX line {line_no} is out of range 1..{len(ptx_lines)}")
    target = parse_line(line_no, ptx_lines[line_no - 1])
    if target is None:
        raise ValueError(f"PTX line {line_no} is not an instruction: "
                         f"{ptx_lines[line_no - 1].strip()!r}")
    needed = set(target.srcs)
    found = [target]
    for n in range(line_no - 1, 0, -1):
        if not needed or len(found) >= limit:
            break
        text = ptx_lines[n - 1]
        if text.strip().startswith(".entry") or text.strip().startswith(".visible .entry"):
            break
        instr = parse_line(n, text)
        if instr is None or not (instr.dests & needed):
            continue
        found.append(instr)
        needed -= instr.dests
        needed |= instr.srcs
    return sorted(found, key=lambda i: i.line)


def sass_for_line(instrs: list[Instruction], line_no: int) -> list[tuple[int, Instruction]]:
    """(index, instruction) of every SASS instruction attributed to the PTX line."""
    return [(k, i) for k, i in enumerate(instrs) if i.ptx_line == line_no]


def find_lines(ptx_lines: list[str], pattern: str) -> list[int]:
    rx = re.compile(pattern)
    return [n for n, text in enumerate(ptx_lines, 1) if rx.search(text)]
