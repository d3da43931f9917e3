"""Cases for the kernels a pull request changed: the SASS of every kernel in the base's and the
head's extension, compared for the GPU the gate runs on; each kernel whose code differs and
that no gate case runs gets a case dispatch runs it for (coverage.case_for_kernel; for a
backward kernel, `bwd_*`, a backward case the operator runs it for:
coverage.case_for_bwd_kernel; for a decode kernel, `dec_*`, a decode step:
coverage.case_for_dec_kernel), the kernels with the most changed instructions first, up to the
policy's `sass_extra_cases`.

The code compared is the bytes of each kernel's .text sections in its cubin (cuobjdump
extracts the cubins; no disassembly): one SASS instruction is 16 bytes from sm_70 on, so two
builds' kernels are compared instruction by instruction. A kernel counts as changed when any
instruction word differs (opcode, operands, registers, scheduling bits, branch offsets).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..analysis.kernel_names import is_hopper_name, short_of
from ..gpu.perfcases import Case
from .coverage import Row, case_for_bwd_kernel, case_for_dec_kernel, case_for_kernel, kernels_run

INSTRUCTION_BYTES = 16  # sm_70 and later


def arch_of_kernel(kernel: str, gpu_arch: str) -> str | None:
    """The cubin architecture whose code runs the kernel on a GPU of gpu_arch ("90", "80",
    ...): Hopper kernels (fwd_sm90_*, bwd_sm90_*, the Hopper backward's dQ conversion
    bwd_sm90_convert_dq_*) exist as sm_90a only and run on sm_90 alone. The
    preprocess is compared as the code of the GPU's arch (its sm_90a copy in a Hopper backward
    unit is left out)."""
    if is_hopper_name(kernel):
        return "90a" if gpu_arch == "90" else None
    return gpu_arch


def _code_of(section: str, kernel: str) -> bool:
    """Whether a .text section is the kernel's code: its own, or a compiler subroutine (a
    backward cubin also holds the two helper kernels of its family and dtype, each listed
    apart)."""
    owner = short_of(section[len(".text."):])
    return owner is None or owner == kernel


def kernel_code(binary: Path, gpu_arch: str) -> dict[str, list[bytes]]:
    """{kernel name: its SASS instruction words} for every kernel of the binary with code
    for this GPU (the concatenated .text sections of its cubin). A kernel the listing gives a
    unit whose cubin names other kernels but not it is left out: the listing names a backward
    unit's helpers by this commit's configs, and a base build from before a helper changed
    (a Hopper unit holding the sm80 dQ conversion instead of bwd_sm90_convert_dq_<dtype>) does
    not hold the helper, which is then new in the head."""
    from ..analysis import cubins

    root = cubins.extracted_dir(binary)
    out: dict[str, list[bytes]] = {}
    for member in cubins.list_cubins(binary):
        if member.arch != arch_of_kernel(member.kernel, gpu_arch):
            continue
        sections = cubins.elf_sections(root / member.file)
        owners = {short_of(name[len(".text."):]) for name in sections
                  if name.startswith(".text.")} - {None}
        if owners and member.kernel not in owners:
            continue
        code = b"".join(data for name, data in sections.items()
                        if name.startswith(".text.") and _code_of(name, member.kernel))
        out[member.kernel] = [code[i:i + INSTRUCTION_BYTES]
                              for i in range(0, len(code), INSTRUCTION_BYTES)]
    return out


@dataclass(frozen=True)
class KernelChange:
    """A kernel whose code differs: instructions of the head without a counterpart in the base
    (added) and the other way (removed), as multisets; a pure reordering counts the positions
    that moved. new: the base has no code for it."""

    kernel: str
    added: int
    removed: int
    total: int  # instructions of the head's kernel
    new: bool = False

    @property
    def changed(self) -> int:
        return max(self.added, self.removed)

    def describe(self) -> str:
        if self.new:
            return f"kernel {self.kernel}: new in the head ({self.total} instructions)"
        return (f"kernel {self.kernel}: SASS differs ({self.changed} instructions changed: "
                f"+{self.added} -{self.removed} of {self.total})")


def changed_kernels(base: Mapping[str, Sequence[Hashable]],
                    head: Mapping[str, Sequence[Hashable]]) -> list[KernelChange]:
    """The head's kernels whose instructions differ from the base's (or that the base lacks),
    most changed first. Any sequences of hashable instructions compare: 16-byte words from the
    cubins, or SASS text lines."""
    out = []
    for kernel, code in head.items():
        old = base.get(kernel)
        if old is None:
            out.append(KernelChange(kernel, len(code), 0, len(code), new=True))
            continue
        if list(old) == list(code):
            continue
        a, b = Counter(old), Counter(code)
        added, removed = sum((b - a).values()), sum((a - b).values())
        if added == removed == 0:  # the same instructions in another order
            added = removed = sum(1 for x, y in zip(old, code) if x != y)
        out.append(KernelChange(kernel, added, removed, len(code)))
    return sorted(out, key=lambda c: (not c.new, -c.changed, c.kernel))


@dataclass
class Selection:
    """What the SASS diff did: the cases added (with why), the changed kernels a gate case
    already runs, those left out (with why), and a note when the diff itself did not run."""

    added: list[dict]
    covered: list[dict]
    skipped: list[dict]
    compared: int = 0
    note: str = ""

    @property
    def cases(self) -> list[Case]:
        return [Case(**a["spec"]) for a in self.added]

    def as_dict(self) -> dict:
        return asdict(self)


def select(changes: Sequence[KernelChange], rows: Sequence[Row], bwd_configs: Sequence[str],
           sm90: bool, gate_cases: Sequence[Case], cap: int, compared: int = 0) -> Selection:
    """The extra cases for the changed kernels, in the order given (most changed first): none
    for a kernel a gate case runs (or an extra chosen before; coverage.kernels_run, the
    backward's helpers included), none for one no dispatch row runs on this GPU or the
    backward operator never picks among bwd_configs, at most `cap`."""
    runs: dict[str, str] = {}
    for c in gate_cases:
        for kernel in kernels_run(c, rows, bwd_configs, sm90):
            runs.setdefault(kernel, c.name)
    sel = Selection([], [], [], compared)
    for ch in changes:
        if ch.kernel in runs:
            sel.covered.append({"kernel": ch.kernel, "case": runs[ch.kernel],
                                "why": f"{ch.describe()}; measured by {runs[ch.kernel]}"})
            continue
        if ch.kernel.startswith("dec_"):
            case = case_for_dec_kernel(ch.kernel, sm90)
            unrun = "the decode table runs another kernel for its calls (a kernel of a test set)"
        elif ch.kernel.startswith("bwd_"):
            case = case_for_bwd_kernel(ch.kernel, bwd_configs, sm90)
            unrun = "the backward operator picks another kernel for its calls (a kernel of a " \
                    "test set)"
        else:
            case = case_for_kernel(ch.kernel, rows, sm90)
            unrun = "no dispatch row runs it on this GPU (a kernel of a test set, not dispatched)"
        if case is None:
            sel.skipped.append({"kernel": ch.kernel, "why": f"{ch.describe()}; {unrun}"})
        elif len(sel.added) >= cap:
            sel.skipped.append({"kernel": ch.kernel, "why": f"{ch.describe()}; over the policy's "
                                f"cap of {cap} extra cases"})
        else:
            runs[ch.kernel] = case.name
            sel.added.append({"case": case.name, "kernel": ch.kernel, "why": ch.describe(),
                              "spec": case.as_dict()})
    return sel


def extra_cases(base_binary: Path, head_binary: Path, gpu_arch: str, rows: Sequence[Row],
                bwd_configs: Sequence[str], gate_cases: Sequence[Case], cap: int) -> Selection:
    """select() on the two extensions' SASS for this GPU (gpu_arch "90", "80", ...); rows and
    bwd_configs: the head's dispatch rows and backward kernels."""
    base = kernel_code(base_binary, gpu_arch)
    head = kernel_code(head_binary, gpu_arch)
    if not head:
        return Selection([], [], [], note=f"the head's extension has no sm_{gpu_arch} code")
    changes = changed_kernels(base, head)
    sel = select(changes, rows, bwd_configs, gpu_arch == "90", gate_cases, cap,
                 compared=len(head))
    if not changes:
        sel.note = f"no kernel's sm_{gpu_arch} SASS differs ({len(head)} compared)"
    return sel
