"""The gate: the static resource ratchet, the A/B performance comparison, the A/A mode that
measures false positives and spread, re-pinning baselines, and the combined report.

Exit codes (every subcommand and the combined report):
  0 pass   1 regression   2 a benchmark, build or test of the head failed   3 infrastructure
  problem or no data (no GPU, base does not build, missing tools or baseline)
A broken benchmark is never reported as slower, and never as a pass.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from . import ratchet
from .binaries import ToolError, extension_path, ptxas_log_path

log = logging.getLogger(__name__)

PASS, REGRESSION, BROKEN, INFRA = 0, 1, 2, 3
VERDICT = {PASS: "PASS", REGRESSION: "FAIL: regression", BROKEN: "FAIL: broken",
           INFRA: "ERROR: infrastructure / no data"}
ROOT = Path.cwd()


def overall(codes: list[int]) -> int:
    """Broken beats regression beats infrastructure beats pass."""
    for code in (BROKEN, REGRESSION, INFRA):
        if code in codes:
            return code
    return PASS


def _write(out: Path, name: str, doc: dict, md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{name}.md").write_text(md)


# ---- static ------------------------------------------------------------------------------------


def static_markdown(findings: list[ratchet.Finding], code: int, note: str = "") -> str:
    failed = [f for f in findings if f.failed]
    lines = [f"### Static resource ratchet: {VERDICT[code]}", ""]
    if note:
        lines += [note, ""]
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


def run_static(policy_path: Path, baseline_path: Path, out: Path) -> int:
    import flash_attention as fa

    policy = ratchet.load_yaml(policy_path)
    try:
        binary, log_path = extension_path(), ptxas_log_path()
        tools = ratchet.toolchain(fa.build_info())
        current = ratchet.current_metrics(ratchet.scope_kernels(policy),
                                          [str(a) for a in policy["static"]["archs"]],
                                          binary, log_path)
    except ToolError as exc:
        _write(out, "static", {"code": INFRA, "error": str(exc)},
               f"### Static resource ratchet: {VERDICT[INFRA]}\n\n{exc}\n")
        return INFRA
    if not baseline_path.exists():
        msg = f"no baseline at {baseline_path}: create it with `nox -s rebaseline -- --reason ...`"
        _write(out, "static", {"code": INFRA, "error": msg},
               f"### Static resource ratchet: {VERDICT[INFRA]}\n\n{msg}\n")
        return INFRA
    baseline = ratchet.load_yaml(baseline_path)
    mismatch = ratchet.check_toolchain(baseline, tools)
    if mismatch:
        _write(out, "static", {"code": INFRA, "error": mismatch},
               f"### Static resource ratchet: {VERDICT[INFRA]}\n\n{mismatch}\n")
        return INFRA
    findings = ratchet.compare(baseline, current, policy)
    code = REGRESSION if any(f.failed for f in findings) else PASS
    _write(out, "static", {"code": code, "toolchain": tools,
                           "findings": [f.as_dict() for f in findings]},
           static_markdown(findings, code))
    return code


def run_rebaseline(policy_path: Path, baseline_path: Path, reason: str) -> int:
    import flash_attention as fa

    policy = ratchet.load_yaml(policy_path)
    current = ratchet.current_metrics(ratchet.scope_kernels(policy),
                                      [str(a) for a in policy["static"]["archs"]],
                                      extension_path(), ptxas_log_path())
    doc = ratchet.rebaseline(baseline_path, current, ratchet.toolchain(fa.build_info()), reason)
    n = sum(len(v) for v in doc["kernels"].values())
    print(f"pinned {n} kernel x arch entries in {baseline_path} ({reason})")
    return PASS


# ---- perf --------------------------------------------------------------------------------------


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip()


def prepare_base(ref: str, workdir: Path) -> tuple[Path, str]:
    """A worktree of merge-base(ref, HEAD) at workdir; returns (tree, sha)."""
    sha = _git("merge-base", ref, "HEAD")
    if workdir.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(workdir)], cwd=ROOT,
                       capture_output=True, check=False)
    _git("worktree", "add", "--detach", str(workdir), sha)
    return workdir, sha


def build_tree(tree: Path, kernels: str, archs: str) -> None:
    env = dict(os.environ, FLASH_ATTENTION_KERNELS=kernels, FLASH_ATTENTION_ARCHS=archs)
    log.info("building %s (kernels %s, archs %s)", tree, kernels, archs)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"build of {tree} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def perf_markdown(results: list[dict], code: int, meta: dict) -> str:
    lines = [f"### Performance A/B: {VERDICT[code]}", ""]
    if meta.get("error"):
        return "\n".join([*lines, meta["error"]]) + "\n"
    lines.append(
        f"{meta['base_label']} vs {meta['head_label']} on {meta.get('gpu')}: {meta['rounds']} "
        f"alternating rounds x {meta['reps']} calls, threshold {meta['threshold_pct']}%, "
        f"alpha {meta['alpha']} (one-sided Mann-Whitney on per-round medians). "
        "Slower = significant and beyond the threshold on raw times and on times normalised "
        "by SDPA FA2 in the same round.")
    lines += ["", "| case | base ms | head ms | head/base [95% CI] | p slower | "
              "vs SDPA FA2: head/base [95% CI] | spread base/head | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['case']} | {r['base_ms']:.3f} | {r['head_ms']:.3f} | {r['ratio']:.3f} "
            f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['p_slower']:.4f} | "
            f"{r['norm_ratio']:.3f} [{r['norm_ci_low']:.3f}, {r['norm_ci_high']:.3f}] | "
            f"{r['base_cv']:.1%}/{r['head_cv']:.1%} | **{r['verdict']}** |")
    return "\n".join(lines) + "\n"


def run_perf(args: argparse.Namespace, policy: dict, out: Path) -> int:
    from . import abtest
    from .perfcases import GATE_CASES

    perf = policy["perf"]
    rounds, reps = args.rounds or perf["rounds"], args.reps or perf["reps"]
    meta = {"rounds": rounds, "reps": reps, "threshold_pct": perf["threshold_pct"],
            "alpha": perf["alpha"]}
    try:
        import torch

        if not torch.cuda.is_available():
            raise abtest.WorkerError("no CUDA GPU on this machine: the A/B gate needs one",
                                     "infra")
        head_src = ROOT / "src"
        if not list((head_src / "flash_attention").glob("_C*.so")):
            raise abtest.WorkerError("the head is not built (nox -s build)", "infra")
        if args.aa:
            base_src, meta["base_label"] = head_src, "head (A/A)"
        else:
            if args.base_dir:
                tree, label = Path(args.base_dir).resolve(), f"base dir {args.base_dir}"
            else:
                tree, sha = prepare_base(args.base, ROOT / ".gate" / "base")
                label = f"merge-base {sha[:10]} of {args.base}"
            if not list((tree / "src" / "flash_attention").glob("_C*.so")) or args.rebuild:
                major, minor = torch.cuda.get_device_capability()
                try:
                    build_tree(tree, args.kernels, args.archs or f"{major}{minor}")
                except RuntimeError as exc:
                    raise abtest.WorkerError(f"the base does not build: {exc}", "infra") from exc
            base_src, meta["base_label"] = tree / "src", label
        meta["head_label"] = "head"
        runs = []
        base_w = abtest.Worker("base", base_src)
        head_w = abtest.Worker("head", head_src)
        meta["gpu"] = head_w.gpu
        try:
            for rep in range(args.repeat):
                results = abtest.compare(base_w, head_w, list(GATE_CASES), rounds, reps,
                                         perf["threshold_pct"], perf["alpha"])
                runs.append([r.as_dict() for r in results])
                log.info("comparison %d/%d: %d slower", rep + 1, args.repeat,
                         sum(r.verdict == "slower" for r in results))
        finally:
            base_w.close()
            head_w.close()
    except abtest.WorkerError as exc:
        code = BROKEN if exc.kind == "broken" else INFRA
        meta["error"] = str(exc)
        _write(out, "perf", {"code": code, "meta": meta}, perf_markdown([], code, meta))
        return code
    slower = [sum(r["verdict"] == "slower" for r in run) for run in runs]
    code = REGRESSION if any(slower) else PASS
    md = perf_markdown(runs[-1], code, meta)
    doc = {"code": code, "meta": meta, "results": runs[-1]}
    if args.repeat > 1:
        fp = sum(slower)
        md += (f"\n{args.repeat} comparisons x {len(GATE_CASES)} cases: {fp} 'slower' verdicts "
               f"({fp / (args.repeat * len(GATE_CASES)):.1%}); per comparison: {slower}.\n")
        doc["runs"] = runs
    _write(out, "perf", doc, md)
    return code


# ---- report ------------------------------------------------------------------------------------


def tests_summary(junit: Path) -> dict:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites)
             for k in ("tests", "failures", "errors", "skipped")}
    total["code"] = BROKEN if total["failures"] or total["errors"] else PASS
    return total


def run_report(out: Path) -> int:
    parts, codes, summary = [], [], []
    for name in ("static", "tests", "perf"):
        if name == "tests":
            junit = out / "tests.xml"
            if not junit.exists():
                continue
            t = tests_summary(junit)
            codes.append(t["code"])
            summary.append(f"| tests | {VERDICT[t['code']]} | {t['tests']} run, "
                           f"{t['failures']} failed, {t['errors']} errors, "
                           f"{t['skipped']} skipped |")
            continue
        path = out / f"{name}.json"
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        codes.append(doc["code"])
        parts.append((out / f"{name}.md").read_text())
        if name == "static":
            fs = doc.get("findings", [])
            detail = (f"{sum(f['status'] == 'worse' for f in fs)} worse, "
                      f"{sum(f['status'] in ('improved', 'unpinned', 'missing') for f in fs)} "
                      f"to re-pin, {len(fs)} checked" if fs else doc.get("error", ""))
        else:
            rs = doc.get("results", [])
            detail = (f"{sum(r['verdict'] == 'slower' for r in rs)} slower, "
                      f"{sum(r['verdict'] == 'faster' for r in rs)} faster, {len(rs)} cases"
                      if rs else doc["meta"].get("error", ""))
        summary.append(f"| {name} | {VERDICT[doc['code']]} | {detail} |")
    if not codes:
        codes = [INFRA]
        summary.append("| - | no results | nothing ran |")
    code = overall(codes)
    md = "\n".join([f"## Gate: {VERDICT[code]} (exit {code})", "", "| check | result | detail |",
                    "|---|---|---|", *summary, "", *parts])
    (out / "report.md").write_text(md)
    (out / "report.json").write_text(json.dumps({"code": code, "verdict": VERDICT[code]},
                                                indent=1) + "\n")
    summary_file = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary_file:
        with open(summary_file, "a") as fh:
            fh.write(md)
    print(md)
    return code


# ---- CLI ---------------------------------------------------------------------------------------


def command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    policy_path, baseline_path = Path(args.policy), Path(args.baseline)
    if args.action == "static":
        code = run_static(policy_path, baseline_path, out)
        print((out / "static.md").read_text())
        return code
    if args.action == "rebaseline":
        try:
            return run_rebaseline(policy_path, baseline_path, args.reason or "")
        except ValueError as exc:
            print(f"fa-tools gate rebaseline: {exc}", file=sys.stderr)
            return BROKEN
    if args.action == "perf":
        if not (args.aa or args.base or args.base_dir):
            raise SystemExit("fa-tools gate perf: give --base REF, --base-dir DIR or --aa")
        code = run_perf(args, ratchet.load_yaml(policy_path), out)
        print((out / "perf.md").read_text())
        return code
    return run_report(out)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gate", help="static ratchet, A/B perf gate, rebaseline, report",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("static", "perf", "rebaseline", "report"))
    p.add_argument("--policy", default="ci/gate_policy.yaml")
    p.add_argument("--baseline", default="ci/baselines/static.yaml")
    p.add_argument("--out", default="gate-report", help="directory for reports")
    p.add_argument("--reason", help="why the pins change (rebaseline)")
    p.add_argument("--base", help="git ref of the target branch; its merge-base is compared")
    p.add_argument("--base-dir", help="a source tree to use as base instead of a git ref")
    p.add_argument("--aa", action="store_true", help="A/A: the head against itself")
    p.add_argument("--repeat", type=int, default=1, help="repeat the comparison (A/A studies)")
    p.add_argument("--rounds", type=int, help="override the policy's rounds per side")
    p.add_argument("--reps", type=int, help="override the policy's calls per round")
    p.add_argument("--rebuild", action="store_true", help="rebuild the base even if built")
    p.add_argument("--kernels", default=os.environ.get("FLASH_ATTENTION_KERNELS", "ci,default"))
    p.add_argument("--archs", help="archs of the base build (default: this GPU's)")
    p.set_defaults(func=command)
