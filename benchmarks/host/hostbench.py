"""Driver of `nox -s hostbench`: the host-side cost benchmarks of this folder under
pytest-benchmark, saved per commit, and optionally compared with a base commit.

    python benchmarks/host/hostbench.py                      record the head (no comparison)
    python benchmarks/host/hostbench.py --base origin/main   compare with the merge-base
    python benchmarks/host/hostbench.py --base REF --base-dir DIR   base = an already built tree

Record: one run of the head, saved as `--benchmark-save=<short commit>` in the storage
(.gate/hostbench/results, or $HOSTBENCH_STORAGE). Compare: the merge-base of REF and HEAD is
checked out in a worktree (.gate/hostbench-base) and timed by the head's benchmark code (this
folder copied to .gate/hostbench/bench, run with the base's src first on PYTHONPATH); then the
head runs with `--benchmark-compare=<base run> --benchmark-compare-fail=median:<N>%`. A base
worktree has no built extension, so its GPU benchmarks are not run and only the CPU ones are
compared (the report says so); `--base-dir DIR` names a tree whose extension is built, and then
the GPU benchmarks are compared too.

The machine this runs on is shared and its speed moves in episodes of seconds (on the 2-core CI
machine one benchmark's median comes out 1.5-1.8x its usual value now and then, in CPU time as
much as in wall time; docs/pipeline.md). No threshold separates that from a regression in one
pair of runs, so a benchmark that trips the threshold is measured again, base and head, and is
reported slower only if it trips in every one of ATTEMPTS pairs of runs.

Writes <out>/hostbench.json ({"code": 0 pass | 1 regression | 2 broken (a benchmark of the head
errored) | 3 infrastructure or no data, ...}) and <out>/hostbench.md (a markdown section for the
gate report) and exits with the code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = ROOT / ".gate" / "hostbench"
BASE_TREE = ROOT / ".gate" / "hostbench-base"
DEFAULT_STORAGE = WORK / "results"

# Percent by which a head median may exceed the base median (pytest-benchmark's
# --benchmark-compare-fail=median:N%); docs/pipeline.md has the A/A spread behind it.
THRESHOLD_PCT = 20
ATTEMPTS = 3  # pairs of runs a benchmark must trip in to count as slower

PASS, REGRESSION, BROKEN, NO_DATA = 0, 1, 2, 3
CODE_NAMES = {PASS: "PASS", REGRESSION: "FAIL (regression)", BROKEN: "FAIL (broken)",
              NO_DATA: "FAIL (infrastructure or no data)"}


class InfraError(RuntimeError):
    """Something outside the benchmarks failed: git, the worktree, pytest itself."""


@dataclass
class Run:
    """One pytest run of the benchmarks."""

    label: str
    exit_code: int
    medians: dict[str, float] = field(default_factory=dict)  # node id -> median seconds
    extra: dict[str, dict] = field(default_factory=dict)  # node id -> extra_info
    failed: list[str] = field(default_factory=list)  # node ids that failed or errored
    skipped: dict[str, str] = field(default_factory=dict)  # node id -> reason
    saved: Path | None = None  # the file pytest-benchmark saved, if any
    json_path: Path | None = None


def _git(*args: str, cwd: Path = ROOT) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise InfraError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def _short(rev: str, cwd: Path = ROOT) -> str:
    return _git("rev-parse", "--short", rev, cwd=cwd)


def _pythonpath(src: Path) -> str:
    """src first, then whatever PYTHONPATH holds except this checkout's src (a base run must
    import the base's flash_attention, not the head's)."""
    head_src = str(ROOT / "src")
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and os.path.abspath(p) != head_src]
    return os.pathsep.join([str(src), *rest])


def _parse_junit(path: Path) -> tuple[list[str], dict[str, str]]:
    """Node ids (relative to the benchmark folder) that failed or errored, and skip reasons."""
    failed: list[str] = []
    skipped: dict[str, str] = {}
    if not path.exists():
        return failed, skipped
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        nodeid = f"{module}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(nodeid)
        elif (skip := case.find("skipped")) is not None:
            skipped[nodeid] = skip.get("message", "")
    return failed, skipped


def run_benchmarks(label: str, bench_dir: Path, src: Path, cwd: Path, storage: Path,
                   save: str | None, compare: Path | None = None, threshold: int | None = None,
                   select: list[str] | None = None, no_gpu: bool = False) -> Run:
    """Run pytest on bench_dir (or the selected node ids in it) importing flash_attention from
    src; return what it measured. cwd decides the commit pytest-benchmark records."""
    WORK.mkdir(parents=True, exist_ok=True)
    json_path = WORK / f"{label}.json"
    junit = WORK / f"{label}.xml"
    for path in (json_path, junit):
        path.unlink(missing_ok=True)
    targets = [str(bench_dir / nodeid) for nodeid in select] if select else [str(bench_dir)]
    cmd = [sys.executable, "-m", "pytest", *targets, f"--benchmark-storage=file://{storage}",
           f"--benchmark-json={json_path}", f"--junitxml={junit}"]
    if save:
        cmd.append(f"--benchmark-save={save}")
    if compare is not None:
        cmd += [f"--benchmark-compare={compare}", f"--benchmark-compare-fail=median:{threshold}%"]
    if no_gpu:
        cmd += ["-m", "not gpu"]
    env = {**os.environ, "PYTHONPATH": _pythonpath(src), "PYTHONHASHSEED": "0",
           "PYTHONUNBUFFERED": "1"}
    print(f"hostbench: {label}: {' '.join(cmd[1:])}  (PYTHONPATH={src})", flush=True)
    before = set(storage.rglob("*.json")) if storage.exists() else set()
    code = subprocess.run(cmd, cwd=cwd, env=env, check=False).returncode
    run = Run(label, code, json_path=json_path if json_path.exists() else None)
    run.failed, run.skipped = _parse_junit(junit)
    if run.json_path:
        data = json.loads(run.json_path.read_text())
        for bench in data.get("benchmarks", []):
            run.medians[bench["fullname"]] = bench["stats"]["median"]
            run.extra[bench["fullname"]] = bench.get("extra_info", {})
    if save and storage.exists():
        new = sorted(set(storage.rglob(f"*_{save}.json")) - before)
        run.saved = new[-1] if new else None
    return run


def _prepare_base_tree(rev: str) -> Path:
    """A worktree of rev at .gate/hostbench-base, replacing any earlier one."""
    if BASE_TREE.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(BASE_TREE)], cwd=ROOT,
                       capture_output=True, check=False)
        if BASE_TREE.exists():
            shutil.rmtree(BASE_TREE)
    _git("worktree", "prune")
    BASE_TREE.parent.mkdir(parents=True, exist_ok=True)
    _git("worktree", "add", "--detach", "--force", str(BASE_TREE), rev)
    return BASE_TREE


def _copy_head_benchmarks() -> Path:
    """This folder, copied, so that the base is timed by the head's benchmark code. The copy's
    pytest.ini makes it the rootdir, so its node ids equal the head's."""
    dest = WORK / "bench"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(HERE, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


# ---- verdicts and report ---------------------------------------------------------------------


def _fmt_time(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.2f} us"


def _gpu_ratio_line(run: Run) -> str | None:
    for nodeid, extra in run.extra.items():
        if "ratio_to_sdpa" in extra:
            return (f"{run.label}: attention() {run.medians[nodeid] * 1e6:.2f} us per call, SDPA "
                    f"{extra['sdpa_median_s'] * 1e6:.2f} us, ratio ours/SDPA "
                    f"{extra['ratio_to_sdpa']:.3f} (1 x 128 x 8 x 64 bf16, calls queued back to "
                    "back)")
    return None


def compare_attempts(attempts: list[tuple[Run, Run]], threshold: int) -> list[dict]:
    """One row per benchmark of the first head run. A benchmark is slower when head/base
    exceeded 1 + threshold in every attempt (each later attempt re-measures only what tripped
    before) and there were ATTEMPTS of them; the row shows the last pair it was measured in."""
    first_base, first_head = attempts[0]
    limit = 1 + threshold / 100
    rows = []
    for nodeid in sorted(set(first_head.medians) | set(first_head.failed)):
        ratios = []
        base_med = head_med = None
        for base, head in attempts:
            if nodeid in head.medians and nodeid in base.medians:
                base_med, head_med = base.medians[nodeid], head.medians[nodeid]
                ratios.append(head_med / base_med)
        if nodeid in first_head.failed:
            verdict = "error (head)"
        elif not ratios:
            head_med = first_head.medians.get(nodeid)
            reason = first_base.skipped.get(nodeid)
            verdict = ("head only (base " + ("failed" if nodeid in first_base.failed
                                              else f"skipped: {reason}" if reason
                                              else "did not run it") + ")")
        elif all(r > limit for r in ratios) and len(ratios) >= ATTEMPTS:
            verdict = "slower"
        elif ratios[-1] < 1 / limit:
            verdict = "faster"
        elif len(ratios) > 1:
            verdict = "same (a trip not reproduced)"
        else:
            verdict = "same"
        rows.append({"benchmark": nodeid, "base_median_s": base_med, "head_median_s": head_med,
                     "ratio": ratios[-1] if ratios else None, "attempt_ratios": ratios,
                     "threshold_ratio": limit, "verdict": verdict})
    return rows


def decide(rows: list[dict], head: Run, compared: bool) -> int:
    # pytest exits 1 when a benchmark fails (junit names it) and also when pytest-benchmark's
    # --benchmark-compare-fail trips (it raises at the end, after writing the results); 2 is a
    # collection error, 4 a usage error (a missing plugin), 5 no benchmark collected.
    if head.failed or head.exit_code == 2:
        return BROKEN
    if head.exit_code not in (0, 1) or not head.medians:
        return NO_DATA
    if compared:
        if not any(r["attempt_ratios"] for r in rows):
            return NO_DATA
        if any(r["verdict"] == "slower" for r in rows):
            return REGRESSION
    return PASS


def write_report(out: Path, code: int, rows: list[dict], summary: dict, notes: list[str],
                 runs: list[Run]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    compared = summary["mode"] == "compare"
    status = CODE_NAMES[code]
    if code == PASS and not compared:
        status = "PASS (recorded, no base to compare)"
    slower = [r["benchmark"] for r in rows if r["verdict"] == "slower"]
    errors = [r["benchmark"] for r in rows if r["verdict"].startswith("error")]
    headline = f"### Host-side costs (pytest-benchmark): {status}"
    if slower:
        headline += f": {len(slower)} slower ({', '.join(slower)})"
    if errors:
        headline += f": {len(errors)} errored ({', '.join(errors)})"
    lines = [headline, ""]
    if compared and summary["base"] is None:
        lines.append(f"Head {summary['head']} against {summary['base_ref'] or summary['base_what']}"
                     ": nothing compared.")
    elif compared:
        lines.append(f"Head {summary['head']} against base {summary['base']} "
                     f"({summary['base_what']}); a benchmark fails when its median exceeds the "
                     f"base's by more than {summary['threshold_pct']}% "
                     f"(`--benchmark-compare-fail=median:{summary['threshold_pct']}%`) in each "
                     f"of {ATTEMPTS} pairs of runs (a trip is re-measured, base and head).")
    else:
        lines.append(f"Head {summary['head']} recorded in {summary['storage']} "
                     f"(`--benchmark-save={summary['head']}`); no base given, nothing compared.")
    lines += [f"- {note}" for note in notes]
    lines += [f"- {line}" for run in runs if (line := _gpu_ratio_line(run))]
    if rows:
        lines += ["", "| benchmark | base median | head median | ratio | threshold | verdict |",
                  "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        if len(r["attempt_ratios"]) > 1:
            ratio += " (" + ", ".join(f"{x:.2f}" for x in r["attempt_ratios"]) + ")"
        threshold = f"{r['threshold_ratio']:.2f}" if compared else "-"
        lines.append(f"| `{r['benchmark']}` | {_fmt_time(r['base_median_s'])} | "
                     f"{_fmt_time(r['head_median_s'])} | {ratio} | {threshold} | "
                     f"{r['verdict']} |")
    (out / "hostbench.md").write_text("\n".join(lines) + "\n")
    payload = {"code": code, "status": status, **summary, "notes": notes,
               "slower": slower, "errored": errors, "benchmarks": rows}
    (out / "hostbench.json").write_text(json.dumps(payload, indent=2) + "\n")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="compare with the merge-base of this ref and HEAD")
    parser.add_argument("--base-dir", type=Path,
                        help="an already built tree to time as the base (GPU benchmarks too)")
    parser.add_argument("--threshold", type=int, default=THRESHOLD_PCT,
                        help=f"percent a median may grow (default {THRESHOLD_PCT})")
    parser.add_argument("--out", type=Path, default=ROOT / "gate-report")
    parser.add_argument("--storage", type=Path,
                        default=Path(os.environ.get("HOSTBENCH_STORAGE", DEFAULT_STORAGE)))
    args = parser.parse_args(argv)
    storage = args.storage.resolve()
    mode = "record" if args.base is None and args.base_dir is None else "compare"
    summary: dict = {"mode": mode, "head": None, "base": None, "base_ref": args.base,
                     "base_what": str(args.base_dir) if args.base_dir else None,
                     "threshold_pct": args.threshold, "storage": str(storage), "attempts": 0}
    notes: list[str] = []
    rows: list[dict] = []
    runs: list[Run] = []
    try:
        try:
            head_sha = _short("HEAD")
        except InfraError:
            head_sha = os.environ.get("FA_COMMIT", "")[:7] or "unknown"
        summary["head"] = head_sha
        if mode == "record":
            head = run_benchmarks("head", HERE, ROOT / "src", ROOT, storage, save=head_sha)
            runs = [head]
            rows = [{"benchmark": n, "base_median_s": None, "head_median_s": m, "ratio": None,
                     "attempt_ratios": [], "threshold_ratio": None, "verdict": "recorded"}
                    for n, m in sorted(head.medians.items())]
            rows += [{"benchmark": n, "base_median_s": None, "head_median_s": None,
                      "ratio": None, "attempt_ratios": [], "threshold_ratio": None,
                      "verdict": "error (head)"} for n in head.failed]
            notes += [f"skipped `{n}`: {why}" for n, why in sorted(head.skipped.items())]
            code = decide(rows, head, compared=False)
        else:
            if args.base_dir is not None:
                tree = args.base_dir.resolve()
                if not (tree / "src" / "flash_attention").is_dir():
                    raise InfraError(f"--base-dir {tree} has no src/flash_attention")
                try:
                    base_sha = _short("HEAD", cwd=tree)
                except InfraError:  # a copied tree without git
                    base_sha = tree.name
                if args.base:
                    merge_base = _short(_git("merge-base", args.base, "HEAD"))
                    if merge_base != base_sha:
                        notes.append(f"the base tree {tree} is at {base_sha}, the merge-base of "
                                     f"{args.base} is {merge_base}: timed what the tree holds")
                summary["base_what"] = f"the built tree {tree}"
                no_gpu = False
            else:
                merge_base = _git("merge-base", args.base, "HEAD")
                base_sha = _short(merge_base)
                tree = _prepare_base_tree(merge_base)
                summary["base_what"] = f"merge-base of {args.base}, worktree {tree}"
                no_gpu = True
                notes.append("CPU benchmarks only: the base worktree has no built extension, so "
                             "its GPU benchmarks are not run (give --base-dir DIR, a built tree "
                             "of the base, to compare them)")
            summary["base"] = base_sha
            bench_copy = _copy_head_benchmarks()
            attempts: list[tuple[Run, Run]] = []
            select: list[str] | None = None
            for attempt in range(1, ATTEMPTS + 1):
                first = attempt == 1
                base = run_benchmarks(f"base{attempt}", bench_copy, tree / "src", tree, storage,
                                      save=f"base-{base_sha}-for-{head_sha}" if first else None,
                                      select=select, no_gpu=no_gpu)
                if base.exit_code in (2, 3, 4) or not base.medians:
                    raise InfraError(f"the base run produced no timings (pytest exit "
                                     f"{base.exit_code}); see its output above")
                compare = base.saved or base.json_path
                head = run_benchmarks(f"head{attempt}", HERE, ROOT / "src", ROOT, storage,
                                      save=head_sha if first else None, compare=compare,
                                      threshold=args.threshold, select=select)
                attempts.append((base, head))
                runs += [base, head]
                if head.failed or not head.medians:
                    break
                limit = 1 + args.threshold / 100
                tripped = [n for n, m in head.medians.items()
                           if n in base.medians and m / base.medians[n] > limit]
                if not tripped:
                    break
                select = tripped
                if attempt < ATTEMPTS:
                    print(f"hostbench: over the threshold in attempt {attempt}: "
                          f"{', '.join(tripped)}; measuring them again", flush=True)
            summary["attempts"] = len(attempts)
            rows = compare_attempts(attempts, args.threshold)
            code = decide(rows, attempts[0][1], compared=True)
            if code == PASS and any(h.failed for _, h in attempts[1:]):
                code = BROKEN
            notes += [f"skipped `{n}` on the head: {why}"
                      for n, why in sorted(attempts[0][1].skipped.items())]
    except InfraError as exc:
        code = NO_DATA
        notes.append(f"infrastructure: {exc}")
    write_report(args.out, code, rows, summary, notes, runs)
    return code


if __name__ == "__main__":
    sys.exit(main())
