"""The static resource ratchet: per kernel and architecture, registers, spill bytes, stack,
shared memory and SASS totals of the current build against the pins in ci/baselines/, under the
policy in ci/gate_policy.yaml. Worse fails; better but not re-pinned fails too ("re-pin with
rebaseline"), so the pins never go stale. A Hopper kernel whose wgmma ptxas serialized fails
whatever its pin says. No GPU needed."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from flash_attention.kernels import KernelConfig

from ..analysis import cubins, opcodes, ptxas_report, sass
from ..analysis.binaries import tool_version, tools_in_use
from ..analysis.kernel_names import archs_of, helpers_of, parse_kernel


@dataclass(frozen=True)
class Finding:
    kernel: str
    arch: str
    metric: str
    baseline: float | None
    current: float | None
    status: str  # ok | worse | improved | missing | unpinned
    rule: str

    @property
    def failed(self) -> bool:
        return self.status != "ok"

    def as_dict(self) -> dict:
        return asdict(self)


def _selection(spec: str | None) -> list[str]:
    """The names of a kernel selection (flash_attention.kernels.resolve): its kernels, then the
    helpers of its backward and decode ones (the preprocess and each kind's dQ conversion, the
    split-KV combine, of their dtypes: helpers.helpers)."""
    from flash_attention.kernels import resolve
    from flash_attention.kernels.helpers import helpers

    configs = resolve(spec) if spec else ()
    return [c.name for c in (*configs, *helpers(configs))]


def scope_kernels(policy: dict) -> list[str]:
    """The kernels pinned: the selection `kernels` with the helpers of its kernels."""
    return _selection(policy["static"]["kernels"])


def zero_spill_kernels(policy: dict) -> set[str]:
    """The kernels that must not spill (bar the policy's exceptions): the selection
    `zero_spills_for` with its helpers."""
    return set(_selection(policy["static"].get("zero_spills_for")))


def toolchain(build_info: dict | None) -> dict[str, str]:
    """What made the numbers: nvcc (registers, spills, SASS) and nvdisasm (the SASS counts)."""
    return {"nvcc": (build_info or {}).get("nvcc", "unknown"),
            "nvdisasm": tool_version("nvdisasm")}


def describe_toolchain(tools: dict[str, str]) -> str:
    used = tools_in_use().get("nvdisasm", {})
    where = f" ({used['origin']}: {used['path']})" if used else ""
    return f"nvcc {tools.get('nvcc')}, nvdisasm {tools.get('nvdisasm')}{where}"


def current_metrics(kernels: list[str], archs: list[str], binary: Path, log: Path
                    ) -> dict[str, dict[str, dict[str, int]]]:
    """{kernel: {arch: {metric: value}}} for the kernels and archs present in the build (a
    Hopper-family kernel, forward or backward, under 90a whatever `archs` says; a backward
    helper under the archs of the backward kernels among `kernels` whose units hold it, 90a
    too where one of them is a Hopper kernel: kernel_names.archs_of). The kernels are
    disassembled side by side (one nvdisasm process per kernel and arch, as many at once as
    there are CPUs): 195 entries took 2-3 min one after another on a 2-core machine."""
    records = {(r.kernel, r.arch): r for r in ptxas_report.load(log)}
    cfgs = {kernel: parse_kernel(kernel) for kernel in kernels}
    mains = [c for c in cfgs.values() if isinstance(c, KernelConfig) and helpers_of(c)]
    todo = [(kernel, arch) for kernel, cfg in cfgs.items()
            for arch in archs_of(cfg, archs, mains) if (kernel, arch) in records]
    if todo:
        cubins.extracted_dir(binary)  # extract once, before the threads read the cubins

    def measure(item: tuple[str, str]) -> dict[str, int]:
        kernel, arch = item
        rec = records[item]
        instrs = sass.instructions(binary, kernel, arch, ptx_lines=False)
        hist = opcodes.histogram(kernel, arch, instrs)
        return {
            "registers": rec.registers,
            "spill_bytes": rec.spill_stores + rec.spill_loads,
            "stack_frame": rec.stack_frame,
            "smem": rec.static_smem + rec.dynamic_smem,
            "sass_total": hist.total,
            "sass_local_memory": hist.categories["local_memory"],
            "sass_int_address": hist.categories["int_address"],
            "sass_tensor_mma": hist.categories["tensor_mma"],
            **({"sass_tma": hist.categories["tma"],
                "sass_setmaxnreg": hist.categories["setmaxnreg"],
                "sass_ex2_overlapped": opcodes.ex2_under_wgmma(instrs),
                "wgmma_serialized": int(bool(rec.wgmma_serialized))}
               if arch == "90a" else {}),
        }

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        values = list(pool.map(measure, todo))
    out: dict[str, dict[str, dict[str, int]]] = {}
    for (kernel, arch), metrics in zip(todo, values):
        out.setdefault(kernel, {})[arch] = metrics
    return out


def _allowance(rule: dict, base: float) -> float:
    if "max_increase_pct" in rule:
        return base * rule["max_increase_pct"] / 100
    return rule.get("max_increase", rule.get("max_decrease", 0))


def _rule_text(rule: dict) -> str:
    if "max_increase_pct" in rule:
        return f"may rise at most {rule['max_increase_pct']}%"
    if "max_decrease" in rule:  # a metric where more is better
        n = rule["max_decrease"]
        return "may not fall" if n == 0 else f"may fall at most {n}"
    n = rule.get("max_increase", 0)
    return "may not rise" if n == 0 else f"may rise at most {n}"


_SERIALIZED = ("ptxas serialized this kernel's wgmma (its 'Potential Performance Loss' note in "
               "ptxas.log; `fa-tools resources` names the code): each GEMM then waits for the "
               "previous one; must stay 0")


def compare(baseline: dict, current: dict, policy: dict) -> list[Finding]:
    static = policy["static"]
    rules = static["metrics"]
    zero_spill = zero_spill_kernels(policy)
    spill_allowed = {k: v["bytes"] for k, v in (static.get("spill_exceptions") or {}).items()}
    findings: list[Finding] = []
    pinned = baseline.get("kernels", {})
    for kernel in sorted(set(pinned) | set(current)):
        for arch in sorted(set(pinned.get(kernel, {})) | set(current.get(kernel, {}))):
            old = pinned.get(kernel, {}).get(arch)
            new = current.get(kernel, {}).get(arch)
            if old is None:
                findings.append(Finding(kernel, arch, "*", None, None, "unpinned",
                                        "new kernel: pin it with rebaseline"))
                if (new or {}).get("wgmma_serialized"):  # not to be pinned either
                    findings.append(Finding(kernel, arch, "wgmma_serialized", None, 1, "worse",
                                            _SERIALIZED))
                continue
            if new is None:
                findings.append(Finding(kernel, arch, "*", None, None, "missing",
                                        "pinned kernel not in this build"))
                continue
            for metric, rule in rules.items():
                b, c = old.get(metric), new.get(metric)
                if b is None and c is None:
                    continue  # a metric of the other family (TMA, setmaxnreg: sm_90a only)
                if b is None or c is None:
                    findings.append(Finding(kernel, arch, metric, b, c, "unpinned",
                                            "metric not pinned: rebaseline"))
                    continue
                text = _rule_text(rule)
                sign = -1 if "max_decrease" in rule else 1  # more is better for this metric
                if metric == "wgmma_serialized" and c > 0:
                    findings.append(Finding(kernel, arch, metric, b, c, "worse", _SERIALIZED))
                elif metric == "spill_bytes" and kernel in zero_spill and c > spill_allowed.get(
                        kernel, 0):
                    findings.append(Finding(
                        kernel, arch, metric, b, c, "worse",
                        f"must stay at most {spill_allowed[kernel]} (policy's spill exception)"
                        if kernel in spill_allowed else "must stay 0 for this kernel set"))
                elif sign * (c - b) > _allowance(rule, b):
                    findings.append(Finding(kernel, arch, metric, b, c, "worse", text))
                elif sign * (c - b) < 0 and static.get("fail_on_unpinned_improvement", True):
                    findings.append(Finding(kernel, arch, metric, b, c, "improved",
                                            "better than the pin: re-pin with rebaseline"))
                else:
                    findings.append(Finding(kernel, arch, metric, b, c, "ok", text))
    return findings


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(Path(path).read_text()) or {}


def rebaseline(path: Path, current: dict, tools: dict, reason: str) -> dict:
    reason = reason.strip()
    if not reason:
        raise ValueError("rebaseline needs a reason (--reason \"...\")")
    old = load_yaml(path) if Path(path).exists() else {}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    history = list(old.get("history", []))
    history.append({"date": dt.date.today().isoformat(), "commit": commit, "reason": reason})
    doc = {
        "note": "Pinned by `nox -s rebaseline -- --reason ...`; edit only through rebaseline.",
        "toolchain": tools,
        "kernels": current,
        "history": history,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(doc, sort_keys=False, width=100))
    return doc


def check_toolchain(baseline: dict, tools: dict) -> str | None:
    """None when the pins were made by the same tools; else why the counts are not comparable
    (the gate then stops with exit 3 instead of reporting a regression or an improvement)."""
    pinned = baseline.get("toolchain")
    if not pinned or pinned == tools:
        return None
    return (f"the pins were made with {pinned}, this build is measured with {tools} "
            f"({describe_toolchain(tools)}): SASS counts of different tool versions are not "
            "comparable. Use the pinned tools (`pip install nvidia-cuda-cuobjdump==<v> "
            "nvidia-cuda-nvdisasm==<v>`, or the wheelhouse on an offline runner), or re-pin "
            "on purpose after a toolchain change (`nox -s rebaseline -- --reason ...`).")
