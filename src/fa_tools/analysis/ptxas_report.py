"""Parsing the ptxas resource report the build keeps (ptxas.log: forward and backward
kernels) into one record per kernel and architecture, with the occupancy those resources
allow, and whether ptxas serialized the kernel's wgmma instructions (its "Potential
Performance Loss" notes, C75xx: each wgmma then waits for the previous one, which cost a Hopper
kernel here 1.5x the cycles per KV block with no other sign in the resource lines)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

from .kernel_names import config_of

_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for 'sm_(?P<arch>\w+)'")
_PROPS = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, "
    r"(?P<ld>\d+) bytes spill loads"
)
_USED = re.compile(r"Used (?P<regs>\d+) registers")
_BARRIERS = re.compile(r"used (?P<n>\d+) barriers")
_SMEM = re.compile(r"(?P<n>\d+) bytes smem")
_CMEM0 = re.compile(r"(?P<n>\d+) bytes cmem\[0\]")
_CUM_STACK = re.compile(r"(?P<n>\d+) bytes cumulative stack size")
_TIME = re.compile(r"Compile time = (?P<ms>[\d.]+) ms")
# Printed before the function's entry line, naming it: "(C7512) Potential Performance Loss:
# wgmma.mma_async instructions are serialized due to insufficient register resources for the
# function '...'".
_PERF_LOSS = re.compile(r"\((?P<code>C\d{4})\) Potential Performance Loss: (?P<what>.*?)"
                        r"(?: for the function | in the function )'(?P<name>[^']+)'")


@dataclass(frozen=True)
class KernelResources:
    kernel: str  # kernel name (the mangled name if not a known kernel)
    arch: str  # "80", "90", "90a"
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_frame: int  # bytes
    cumulative_stack: int  # bytes
    static_smem: int  # bytes
    dynamic_smem: int  # bytes the launcher requests (the config's tiles)
    barriers: int
    cmem0: int  # bytes of constant bank 0 (kernel parameters)
    compile_ms: float
    ctas_per_sm: int | None  # occupancy these resources allow (None: unknown arch)
    warps_per_sm: int | None
    limited_by: str | None
    # ptxas codes of "Potential Performance Loss" notes that say the wgmma were serialized
    # (e.g. "C7512"), comma-separated; "" when none.
    wgmma_serialized: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _int(pattern: re.Pattern, text: str) -> int:
    m = pattern.search(text)
    return int(m["n"]) if m else 0


def parse(text: str) -> list[KernelResources]:
    """Records for every 'Compiling entry function' block, sorted by (kernel, arch); a kernel
    compiled in several translation units (the backward's helpers, instantiated by every
    backward unit of their dtype that holds them: the same code) is recorded once, from its
    first block.
    Raises ValueError on a block that lacks its register line (a truncated log)."""
    blocks: list[tuple[str, str, list[str], list[str]]] = []
    pending: dict[str, list[str]] = {}  # serialization notes of functions not yet entered
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            blocks.append((m["name"], m["arch"], [], pending.pop(m["name"], [])))
            continue
        note = _PERF_LOSS.search(line)
        if note and "serializ" in note["what"] and "wgmma" in note["what"]:
            codes = pending.setdefault(note["name"], [])
            if note["code"] not in codes:
                codes.append(note["code"])
        elif blocks:
            blocks[-1][2].append(line)
    records = []
    seen: set[tuple[str, str]] = set()
    for name, arch, lines, serialized in blocks:
        if (name, arch) in seen:
            continue
        seen.add((name, arch))
        body = "\n".join(line for line in lines if "Compiling entry" not in line)
        # A block ends where the next file's or function's lines begin; only the first Used /
        # properties / compile-time lines after the entry belong to it.
        used = next((line for line in lines if _USED.search(line)), None)
        if used is None:
            raise ValueError(f"ptxas report: no 'Used N registers' line for {name} sm_{arch}")
        props = _PROPS.search(body)
        ctime = _TIME.search(body)
        cfg = config_of(name)
        regs = int(_USED.search(used)["regs"])
        static_smem = _int(_SMEM, used)
        occ = None
        arch_num = int(re.match(r"\d+", arch)[0])
        if cfg is not None:
            try:
                occ = cfg.occupancy(arch_num, regs, static_smem)
            except ValueError:
                occ = None
        limited = None
        if occ:
            limits = {k: v for k, v in occ.items() if k.startswith("by_")}
            limited = min(limits, key=lambda k: limits[k])[3:]
        records.append(KernelResources(
            kernel=cfg.name if cfg else name,
            arch=arch,
            registers=regs,
            spill_stores=int(props["st"]) if props else 0,
            spill_loads=int(props["ld"]) if props else 0,
            stack_frame=int(props["stack"]) if props else 0,
            cumulative_stack=_int(_CUM_STACK, used),
            static_smem=static_smem,
            dynamic_smem=cfg.smem_bytes if cfg else 0,
            barriers=_int(_BARRIERS, used),
            cmem0=_int(_CMEM0, used),
            compile_ms=float(ctime["ms"]) if ctime else 0.0,
            ctas_per_sm=occ["ctas"] if occ else None,
            warps_per_sm=occ["warps"] if occ else None,
            limited_by=limited,
            wgmma_serialized=",".join(serialized),
        ))
    return sorted(records, key=lambda r: (r.kernel, r.arch))


def load(path: Path) -> list[KernelResources]:
    return parse(Path(path).read_text())
