"""The perf part of the gate: prepare and build the base (the merge-base with the target
branch, or a given tree, or the head itself for A/A), start one worker per side and run the
sequential A/B comparison of the gate's cases."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from .. import paths
from ..analysis.binaries import ToolError
from ..gpu.perfcases import GATE_CASES, Case
from . import (
    BROKEN,
    INCONCLUSIVE,
    INFRA,
    PASS,
    REGRESSION,
    VERDICT,
    accept,
    coverage,
    sassdiff,
    write_part,
)
from .abtest import CaseResult, Policy, Worker, WorkerError, compare

log = logging.getLogger(__name__)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          cwd=paths.repo_root()).stdout.strip()


def prepare_base(ref: str) -> tuple[Path, str]:
    """The source of merge-base(ref, HEAD), exported (git archive) to <cache>/base-<sha>, where
    <cache> is $FA_GATE_CACHE (default .gate/ in the repository): a runner that keeps the cache
    between jobs builds each base once. Returns (tree, sha)."""
    root = paths.repo_root()
    sha = _git("merge-base", ref, "HEAD")
    tree = Path(os.environ.get("FA_GATE_CACHE", root / ".gate")) / f"base-{sha[:12]}"
    stamp = tree / ".fa-gate-sha"
    if stamp.exists() and stamp.read_text().strip() == sha:
        log.info("base %s: reusing %s", sha[:10], tree)
        return tree, sha
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=root, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    stamp.write_text(sha + "\n")
    return tree, sha


def build_tree(tree: Path, kernels: str, archs: str, timeout_s: float) -> None:
    env = dict(os.environ, FLASH_ATTENTION_KERNELS=kernels, FLASH_ATTENTION_ARCHS=archs)
    log.info("building %s (kernels %s, archs %s), limit %.0f s", tree, kernels, archs, timeout_s)
    try:
        proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                              cwd=tree, env=env, capture_output=True, text=True, check=False,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"build of {tree} ran past {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"build of {tree} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _norm(r: dict) -> str:
    if r.get("peer_note"):
        return f"n/a: {r['peer_note']}"
    return f"{r['norm_ratio']:.3f} [{r['norm_ci_low']:.3f}, {r['norm_ci_high']:.3f}]"


def _energy(r: dict) -> str:
    base, head = r.get("base_mj", math.nan), r.get("head_mj", math.nan)
    if math.isnan(base) or math.isnan(head):
        return "n/a"
    return f"{base:.1f} / {head:.1f} ({r['mj_ratio']:.3f})"


def _verdict(r: dict) -> str:
    if r["verdict"] == "accepted":
        return f"**accepted**: {r['accepted']}"
    return f"**{r['verdict']}**" + (f" ({r['note']})" if r.get("note") else "")


def _row(r: dict) -> str:
    if r["verdict"] == "new":
        return (f"| {r['case']} | - | - | - | - | - | - | - | - | - | **new**: the base cannot "
                f"run it ({r['note']}) |")
    return (f"| {r['case']} | {r['rounds']} | {r['base_ms']:.3f} | {r['head_ms']:.3f} | "
            f"{r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['p_slower']:.2g} | "
            f"{_norm(r)} | {r['base_cv']:.1%}/{r['head_cv']:.1%} | "
            f"{r.get('time_ratio', math.nan):.3f} | {_energy(r)} | {_verdict(r)} |")


def _notes(meta: dict) -> list[str]:
    """What the table needs beside it: the cases this GPU cannot run, the energy counter's
    resolution, the SASS-chosen cases and the acceptances (used or not)."""
    lines = []
    not_run = meta.get("not_run") or {}
    if not_run.get("cases"):
        lines.append(f"- Not run here ({not_run['why']}): {', '.join(not_run['cases'])}")
    for side, g in (meta.get("energy") or {}).items():
        lines.append(f"- Energy counter ({side}): {_energy_text(g)}.")
    resolution = _energy_resolution(meta)
    if resolution:
        lines.append(f"- {resolution}")
    sass = meta.get("sass") or {}
    if sass.get("note"):
        lines.append(f"- SASS diff: {sass['note']}")
    for c in sass.get("added", []):
        lines.append(f"- Added case {c['case']}: {c['why']}")
    for c in sass.get("covered", []):
        lines.append(f"- {c['why']}")
    for c in sass.get("skipped", []):
        lines.append(f"- Not measured: {c['kernel']}: {c['why']}")
    for a in meta.get("accept_unused", []):
        lines.append(f"- Accept entry for {a['case']} unused (verdict {a['verdict']}): remove it "
                     "once the base includes the change")
    return lines


def _energy_resolution(meta: dict) -> str | None:
    """Whether the energy column can be read: the counter must update many times within the
    calls one round measures (warm-up and timed calls of one contender). On an H100 it updates
    every ~100 ms, so a round of ~140 ms holds one or two updates: mJ per call then moves by
    tens of percent between rounds and cases with no change in the kernel."""
    intervals = [g.get("interval_ms_median") for g in (meta.get("energy") or {}).values()]
    intervals = [i for i in intervals if i]
    window = meta.get("warm_ms", 0) + meta.get("round_ms", 0)
    if not intervals or not window:
        return None
    updates = window / max(intervals)
    if updates >= 10:
        return None
    return (f"Energy is indicative only: a round's {window:.0f} ms of calls spans "
            f"{updates:.1f} counter updates (every {max(intervals):.0f} ms), so mJ per call "
            f"is quantised to about {100 / max(updates, 1e-9):.0f}% of its value; judge "
            "energy with rounds of 10 or more updates (fa-tools gate calibrate, power study)")


def _energy_text(g: dict) -> str:
    from ..gpu.energy import Granularity

    known = {k: v for k, v in g.items() if k in Granularity.__dataclass_fields__}
    return Granularity(**known).describe() if "supported" in known else "n/a (not reported)"


def markdown(results: list[dict], code: int, meta: dict) -> str:
    lines = [f"### Performance A/B: {VERDICT[code]}", ""]
    if meta.get("error"):
        return "\n".join([*lines, "```", meta["error"].strip(), "```"]) + "\n"
    lines.append(
        f"{meta['base_label']} vs {meta['head_label']} on {meta.get('gpu')}, comparing "
        f"{meta.get('metric', 'time')} per call: alternating rounds "
        f"({meta['rounds']} first, +{meta['step']} for undecided cases, at most "
        f"{meta['max_rounds']}), family-wise alpha {meta['fwer']} per gate run "
        f"({meta['alpha_per_look']:.2g} per case and look; one-sided signed-rank tests on "
        "paired per-round log-ratios, Hodges-Lehmann estimates). Slower = significant on raw "
        f"times and estimated beyond {meta['threshold_pct']}% both raw and normalised by SDPA "
        f"FA2 in the same round (raw alone where SDPA cannot run the case); same = the raw 95% "
        f"interval and the normalised estimate below {meta['clear_pct']}%. Energy: NVML's "
        "total energy counter over each contender's warm and timed calls in a round, mJ per "
        "call (median over rounds; informational, not judged).")
    if meta.get("kinds"):
        lines += ["", f"**Only the cases of kind {', '.join(meta['kinds'])}** (`--kinds`): "
                  "not a whole gate run."]
    lines += ["", f"| case | rounds | base ms | head ms | head/base {meta.get('metric', 'time')} "
              "[95% CI] | p slower | vs SDPA FA2: head/base [95% CI] | spread base/head | "
              "head/base time | mJ/call base / head (ratio) | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row(r) for r in results]
    notes = _notes(meta)
    return "\n".join(lines + (["", *notes] if notes else [])) + "\n"


def verdict_code(results: list[CaseResult] | list[dict]) -> int:
    verdicts = {r["verdict"] if isinstance(r, dict) else r.verdict for r in results}
    if "slower" in verdicts:
        return REGRESSION
    return INCONCLUSIVE if "inconclusive" in verdicts else PASS


@contextlib.contextmanager
def workers(args: argparse.Namespace, policy: dict, meta: dict) -> Iterator[tuple[Worker, Worker]]:
    """The base and head workers for args (--aa, --base-dir or --base), the base built if
    needed; raises WorkerError (infra or broken) with the reason."""
    import torch

    if not torch.cuda.is_available():
        raise WorkerError("no CUDA GPU on this machine: the A/B gate needs one", "infra")
    head_src = paths.repo_root("the head's source") / "src"
    if not list((head_src / "flash_attention").glob("_C*.so")):
        raise WorkerError("the head is not built (nox -s build)", "infra")
    if args.aa:
        base_src, meta["base_label"] = head_src, "head (A/A)"
    else:
        if args.base_dir:
            tree, label = Path(args.base_dir).resolve(), f"base dir {args.base_dir}"
        else:
            tree, sha = prepare_base(args.base)
            label = f"merge-base {sha[:10]} of {args.base}"
        if not list((tree / "src" / "flash_attention").glob("_C*.so")) or args.rebuild:
            major, minor = torch.cuda.get_device_capability()
            try:
                build_tree(tree, args.kernels, args.archs or f"{major}{minor}",
                           policy.get("build_timeout_s", 1800))
            except RuntimeError as exc:
                raise WorkerError(f"the base does not build: {exc}", "infra") from exc
        base_src, meta["base_label"] = tree / "src", label
    meta["head_label"] = "head"
    base_w = Worker("base", base_src)
    try:
        head_w = Worker("head", head_src)
    except WorkerError:
        base_w.close()
        raise
    meta["gpu"] = head_w.gpu
    meta["arch"] = "{}{}".format(*torch.cuda.get_device_capability())
    meta["energy"] = {"base": base_w.energy, "head": head_w.energy}
    try:
        yield base_w, head_w
    finally:
        base_w.close()
        head_w.close()


def _binary(src: Path) -> Path:
    found = sorted((Path(src) / "flash_attention").glob("_C*.so"))
    if not found:
        raise OSError(f"no built extension in {src}")
    return found[0]


def sass_extras(base_w: Worker, head_w: Worker, rows: list[coverage.Row], policy: Policy,
                arch: str) -> sassdiff.Selection:
    """The cases added for kernels whose SASS differs between the two builds (sassdiff); a
    diff that cannot run (no cuobjdump, an unreadable binary) adds none and says why."""
    none = sassdiff.Selection([], [], [])
    if Path(base_w.src_dir) == Path(head_w.src_dir):
        none.note = "A/A: one build, nothing to compare"
        return none
    if policy.sass_extra_cases <= 0 or not arch:
        none.note = "off (policy sass_extra_cases: 0)" if arch else "no GPU architecture known"
        return none
    t0 = time.monotonic()
    try:
        sel = sassdiff.extra_cases(_binary(base_w.src_dir), _binary(head_w.src_dir), arch, rows,
                                   head_w.bwd_configs, GATE_CASES, policy.sass_extra_cases)
    except (ToolError, OSError, ValueError) as exc:
        none.note = f"not run: {exc}"
        return none
    log.info("SASS diff of %d kernels in %.1f s: %d cases added", sel.compared,
             time.monotonic() - t0, len(sel.added))
    return sel


def runnable_here(cases: list[Case], arch: str) -> tuple[list[Case], list[str]]:
    """The cases this GPU can run, and the names of those it cannot: the FP8 forward's run on
    sm_90 alone (its kernels are sm_90a code; there is no fallback)."""
    if arch == "90":
        return cases, []
    return [c for c in cases if not c.fp8], [c.name for c in cases if c.fp8]


def measurable_names(cases: list[Case], rows: list[coverage.Row], bwd_configs: list[str],
                     arch: str) -> set[str]:
    """Every case name the gate can measure with this head: its cases and the case it would
    add for any kernel of the dispatch table or the backward (what an accept entry may
    name)."""
    from flash_attention.kernels import dec_sm80

    sm90 = arch == "90"
    kernels = {r.kernel for r in rows} | {r.fallback for r in rows}
    made = [coverage.case_for_kernel(k, rows, sm90) for k in kernels]
    made += [coverage.case_for_bwd_kernel(k, bwd_configs, sm90) for k in bwd_configs]
    made += [coverage.case_for_dec_kernel(c.name, sm90) for c in dec_sm80.DEFAULT]
    return {c.name for c in cases} | {c.name for c in made if c is not None}


def _tflops(case: Case | None, ms: float) -> float | None:
    """The head's TFLOP/s on a case (its visible pairs counted under a window, a backward as
    2.5 forwards: Case.flops), None without a time."""
    if case is None or not ms > 0:
        return None
    return case.flops() / ms / 1e9


def _write(out: Path, code: int, meta: dict, rows: list[dict] | None = None) -> int:
    doc = {"code": code, "meta": meta, **({"results": rows} if rows is not None else {})}
    write_part(out, "perf", doc, markdown(rows or [], code, meta))  # an error: its text alone
    return code


def run(args: argparse.Namespace, policy_doc: dict, out: Path) -> int:
    perf = dict(policy_doc["perf"])
    for key in ("rounds", "max_rounds"):
        if getattr(args, key, None):
            perf[key] = getattr(args, key)
    policy = Policy.from_dict({k: v for k, v in perf.items() if k != "build_timeout_s"})
    kinds = getattr(args, "kinds", None)
    cases = [c for c in GATE_CASES if kinds is None or c.gate_kind in kinds]
    meta = {"metric": policy.metric, "rounds": policy.rounds, "step": policy.step,
            "max_rounds": policy.max_rounds,
            "threshold_pct": policy.threshold_pct, "clear_pct": policy.clear_pct,
            "fwer": policy.fwer, "warm_ms": policy.warm_ms, "round_ms": policy.round_ms,
            "alpha_per_look": policy.alpha_per_look(len(cases))}
    if kinds is not None:
        meta["kinds"] = list(kinds)  # a subset of the gate's cases (--kinds)
    accept_path = paths.repo_file(policy.accept_file, must_exist=False)  # absent: none accepted
    try:
        entries = accept.load(accept_path)  # a malformed file fails before any GPU work
        with workers(args, perf, meta) as (base_w, head_w):
            arch = meta.get("arch", "")
            cases, not_here = runnable_here(cases, arch)
            if not_here:
                meta["not_run"] = {"cases": not_here, "why": f"FP8 forward cases need sm_90 "
                                                           f"(this GPU: sm_{arch})"}
                log.info("%d FP8 cases left out: this GPU is sm_%s", len(not_here), arch)
            rows = coverage.dispatch_rows(head_w.configs)
            selection = sass_extras(base_w, head_w, rows, policy, arch)
            meta["sass"] = selection.as_dict()
            cases += [c for c in selection.cases if kinds is None or c.gate_kind in kinds]
            accept.check_cases(entries, measurable_names(cases, rows, head_w.bwd_configs, arch),
                               accept_path)
            meta["cases"] = len(cases)
            kernels = {c.name: " + ".join(coverage.kernels_run(c, rows, head_w.bwd_configs,
                                                               arch == "90")) or None
                       for c in cases}
            meta["alpha_per_look"] = policy.alpha_per_look(len(cases))
            results = compare(base_w, head_w, cases, policy, len(cases))
    except WorkerError as exc:
        meta["error"] = str(exc)
        return _write(out, BROKEN if exc.kind == "broken" else INFRA, meta)
    except accept.AcceptError as exc:
        meta["error"] = f"broken configuration: {exc}"
        return _write(out, BROKEN, meta)
    by_name = {c.name: c for c in cases}
    why = {a["case"]: a["why"] for a in meta.get("sass", {}).get("added", [])}
    for r in results:
        r.why = why.get(r.case, "")
    meta["accept_unused"] = accept.apply(results, entries)
    rows_out = [{**r.as_dict(), "head_tflops": _tflops(by_name.get(r.case), r.head_ms),
                 "kernel": kernels.get(r.case)}  # what the head runs: its dispatch, its backward
                for r in results]
    if results and all(r.verdict == "new" for r in results):  # nothing was compared
        meta["error"] = ("the base could run none of the gate's cases; first error: "
                         f"{results[0].note}")
        return _write(out, INFRA, meta, rows_out)
    return _write(out, verdict_code(results), meta, rows_out)
