"""The static part of the gate: the resource ratchet of the current build against the pins,
and re-pinning. Counts made by other SASS tools than the pins' are refused (exit 3), never
compared."""

from __future__ import annotations

from pathlib import Path

from ..analysis.binaries import ToolError, extension_path, ptxas_log_path
from . import INFRA, PASS, REGRESSION, VERDICT, ratchet, write_part


def markdown(findings: list[ratchet.Finding], code: int, tools: dict) -> str:
    failed = [f for f in findings if f.failed]
    lines = [f"### Static resource ratchet: {VERDICT[code]}", "",
             f"Tools: {ratchet.describe_toolchain(tools)}.", ""]
    counts = {s: sum(1 for f in findings if f.status == s)
              for s in ("ok", "worse", "improved", "unpinned", "missing")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) + " (kernel x arch x metric)")
    if failed:
        lines += ["", "| kernel | arch | metric | pinned | now | change | status | rule |",
                  "|---|---|---|---|---|---|---|---|"]
        for f in sorted(failed, key=lambda f: (f.status != "worse", f.kernel, f.arch, f.metric)):
            change = (f"{f.current - f.baseline:+g}" if f.current is not None
                      and f.baseline is not None else "")
            lines.append(f"| {f.kernel} | {f.arch} | {f.metric} | {_v(f.baseline)} | "
                         f"{_v(f.current)} | {change} | {f.status} | {f.rule} |")
    return "\n".join(lines) + "\n"


def _v(x: object) -> str:
    return "-" if x is None else str(x)


def _infra(out: Path, message: str) -> int:
    write_part(out, "static", {"code": INFRA, "error": message},
               f"### Static resource ratchet: {VERDICT[INFRA]}\n\n{message}\n")
    return INFRA


def run(policy_path: Path, baseline_path: Path, out: Path) -> int:
    import flash_attention as fa

    policy = ratchet.load_yaml(policy_path)
    if not baseline_path.exists():
        return _infra(out, f"no baseline at {baseline_path}: create it with "
                           "`nox -s rebaseline -- --reason ...`")
    try:
        binary, log_path = extension_path(), ptxas_log_path()
        tools = ratchet.toolchain(fa.build_info())
        mismatch = ratchet.check_toolchain(ratchet.load_yaml(baseline_path), tools)
        if mismatch:
            return _infra(out, mismatch)
        current = ratchet.current_metrics(ratchet.scope_kernels(policy),
                                          [str(a) for a in policy["static"]["archs"]],
                                          binary, log_path)
    except ToolError as exc:
        return _infra(out, str(exc))
    findings = ratchet.compare(ratchet.load_yaml(baseline_path), current, policy)
    code = REGRESSION if any(f.failed for f in findings) else PASS
    write_part(out, "static", {"code": code, "toolchain": tools,
                               "findings": [f.as_dict() for f in findings]},
               markdown(findings, code, tools))
    return code


def rebaseline(policy_path: Path, baseline_path: Path, reason: str) -> int:
    import flash_attention as fa

    policy = ratchet.load_yaml(policy_path)
    current = ratchet.current_metrics(ratchet.scope_kernels(policy),
                                      [str(a) for a in policy["static"]["archs"]],
                                      extension_path(), ptxas_log_path())
    doc = ratchet.rebaseline(baseline_path, current, ratchet.toolchain(fa.build_info()), reason)
    n = sum(len(v) for v in doc["kernels"].values())
    print(f"pinned {n} kernel x arch entries in {baseline_path} ({reason})")
    return PASS
