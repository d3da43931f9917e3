"""The gate's power study (fa-tools gate calibrate): how often the A/B gate catches a slowdown
of known size, and how often it cries wolf.

Both workers run the head's build (A/A). For each planted size the head worker runs
attention() on one chosen case with that fraction more keys per sequence (the same kernel and
grid, every tile doing that much more work: gpu/perfcases.planted_attention; only this command
turns it on) and the gate's sequential comparison runs on that case with the alpha split of a
whole gate run, `runs` times: the detection rate is the share of 'slower' verdicts. The keys
added and the head/base ratio measured are reported beside the planted size, and a plant that
did not take effect (measured under half the work added) is flagged, so a detection rate is
never read off a slowdown that was not there. Then `aa_runs` whole gate runs (every case, no
planted slowdown) give the false-positive rate per gate run."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

from ..gpu.perfcases import GATE_CASES, Case, planted_keys
from . import PASS, write_part
from .abtest import Policy, compare
from .perf import workers

log = logging.getLogger(__name__)


def _row(case: Case, size_pct: float, runs: list[dict]) -> dict:
    """One line of the power table from the comparisons made at one planted size."""
    n = len(runs)
    verdicts = [r["verdict"] for r in runs]
    ratios = [r["ratio"] for r in runs]
    added = planted_keys(case, size_pct / 100)
    work_pct = 100 * added / case.keys
    realised = statistics.median(ratios) - 1 >= work_pct / 200  # at least half the plant
    return {"case": case.name, "planted": f"{size_pct:g}%",
            "added": f"+{added} of {case.keys} keys",
            "work_pct": work_pct, "realised": realised, "runs": n,
            "slower": verdicts.count("slower"), "inconclusive": verdicts.count("inconclusive"),
            "same": verdicts.count("same"), "faster": verdicts.count("faster"),
            "detection_rate": verdicts.count("slower") / n if n else 0.0,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "rounds_median": statistics.median(r["rounds"] for r in runs),
            "seconds_median": statistics.median(r["seconds"] for r in runs)}


def tables(runs: list[dict]) -> tuple[list[dict], dict | None]:
    """The power table (one row per case and planted size, in the order first run) and the A/A
    summary, both from the list of comparisons made: the one source of every figure."""
    by_name = {c.name: c for c in GATE_CASES}
    planted: dict[tuple[str, float], list[dict]] = {}
    aa_runs: dict[int, list[dict]] = {}
    for r in runs:
        if "aa_run" in r:
            aa_runs.setdefault(r["aa_run"], []).append(r)
        else:
            planted.setdefault((r["case"], r["planted_pct"]), []).append(r)
    power = [_row(by_name[name], size, rs) for (name, size), rs in planted.items()]
    if not aa_runs:
        return power, None
    per_case: dict[str, list[dict]] = {}
    for rs in aa_runs.values():
        for r in rs:
            per_case.setdefault(r["case"], []).append(r)
    verdicts = [{r["verdict"] for r in rs} for rs in aa_runs.values()]
    n = len(aa_runs)
    return power, {
        "runs": n, "cases": len(per_case),
        "runs_with_slower": sum("slower" in v for v in verdicts),
        "runs_with_inconclusive": sum("inconclusive" in v for v in verdicts),
        "fp_rate": sum("slower" in v for v in verdicts) / n,
        "per_case": [{"case": name, **{k: [r["verdict"] for r in rs].count(k)
                                       for k in ("same", "inconclusive", "slower", "faster")},
                      "ratio_median": statistics.median(r["ratio"] for r in rs),
                      "ratio_min": min(r["ratio"] for r in rs),
                      "ratio_max": max(r["ratio"] for r in rs),
                      "rounds_median": statistics.median(r["rounds"] for r in rs)}
                     for name, rs in per_case.items()]}


def markdown(meta: dict, power: list[dict], aa: dict | None) -> str:
    lines = [f"### Gate power study on {meta['gpu']}", "",
             f"Policy: slower beyond {meta['threshold_pct']}%, cleared below "
             f"{meta['clear_pct']}%, family-wise alpha {meta['fwer']} over "
             f"{meta['n_family']} cases, {meta['rounds']} rounds first, +{meta['step']} up to "
             f"{meta['max_rounds']}, comparing {meta.get('metric', 'time')} per call.", ""]
    if power:
        lines += ["| case | planted slowdown | work added | runs | slower | inconclusive | same "
                  "| detection | measured head/base median [min, max] | rounds (median) "
                  "| s per run |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in power:
            planted = r["planted"] + ("" if r["realised"] else " (not realised)")
            lines.append(
                f"| {r['case']} | {planted} | {r['added']}: {r['work_pct']:.2f}% | "
                f"{r['runs']} | {r['slower']} | "
                f"{r['inconclusive']} | {r['same']} | {r['detection_rate']:.0%} | "
                f"{r['ratio_median']:.4f} [{r['ratio_min']:.4f}, {r['ratio_max']:.4f}] | "
                f"{r['rounds_median']:g} | {r['seconds_median']:.1f} |")
    if aa:
        lines += ["", f"A/A: {aa['runs']} whole gate runs x {aa['cases']} cases: "
                  f"{aa['runs_with_slower']} runs with a 'slower' verdict "
                  f"(false-positive rate per gate run {aa['fp_rate']:.1%}), "
                  f"{aa['runs_with_inconclusive']} with an 'inconclusive' one.", "",
                  "| case | same | inconclusive | slower | faster | head/base median [min, max] "
                  "| rounds (median) |", "|---|---|---|---|---|---|---|"]
        for c in aa["per_case"]:
            lines.append(f"| {c['case']} | {c['same']} | {c['inconclusive']} | {c['slower']} | "
                         f"{c['faster']} | {c['ratio_median']:.4f} [{c['ratio_min']:.4f}, "
                         f"{c['ratio_max']:.4f}] | {c['rounds_median']:g} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, policy_doc: dict, out: Path) -> int:
    perf = dict(policy_doc["perf"])
    policy = Policy.from_dict({k: v for k, v in perf.items() if k != "build_timeout_s"})
    by_name = {c.name: c for c in GATE_CASES}
    unknown = [n for n in args.case if n not in by_name]
    if unknown:
        raise SystemExit(f"fa-tools gate calibrate: unknown case(s) {', '.join(unknown)}; "
                         f"the gate's cases: {', '.join(by_name)}")
    n_family = len(GATE_CASES)
    meta = {"threshold_pct": policy.threshold_pct, "clear_pct": policy.clear_pct,
            "fwer": policy.fwer, "n_family": n_family,
            "rounds": policy.rounds, "step": policy.step, "max_rounds": policy.max_rounds,
            "metric": policy.metric}
    args.aa = True
    # Every comparison made, with its per-round samples (calibrate.json), saved after each so
    # that a study cut short keeps what it measured.
    runs: list[dict] = []

    with workers(args, perf, meta) as (base_w, head_w):
        for name in args.case:
            for size in args.sizes:
                for i in range(args.runs):
                    t0 = time.monotonic()
                    (r,) = compare(base_w, head_w, [by_name[name]], policy, n_family,
                                   {name: size / 100})
                    runs.append({"planted_pct": size, "seconds": time.monotonic() - t0,
                                 **r.as_dict()})
                    log.info("%s +%g%%: run %d/%d: %s, ratio %.4f, %d rounds", name, size,
                             i + 1, args.runs, r.verdict, r.ratio, r.rounds)
                    _save(out, meta, runs)
        for i in range(args.aa_runs):
            t0 = time.monotonic()
            results = compare(base_w, head_w, list(GATE_CASES), policy, n_family)
            seconds = time.monotonic() - t0
            runs += [{"aa_run": i + 1, "seconds": seconds, **r.as_dict()} for r in results]
            log.info("A/A run %d/%d (%.0f s): %s", i + 1, args.aa_runs, seconds,
                     ", ".join(f"{r.case} {r.verdict} {r.ratio:.4f}" for r in results))
            _save(out, meta, runs)
    _save(out, meta, runs)
    return PASS


def _save(out: Path, meta: dict, runs: list[dict]) -> None:
    power, aa = tables(runs)
    write_part(out, "calibrate", {"code": PASS, "meta": meta, "power": power, "aa": aa,
                                  "runs": runs}, markdown(meta, power, aa))


def merge(paths: list[Path], out: Path) -> int:
    """One study from several (calibrate.json files made with the same policy on the same GPU,
    say by device calls of limited length): the runs concatenated, A/A runs renumbered, the
    tables recomputed from them."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    keys = ("gpu", "threshold_pct", "clear_pct", "fwer", "n_family", "rounds", "step",
            "max_rounds", "metric")
    meta = docs[0]["meta"]
    for p, d in zip(paths, docs):
        differ = [k for k in keys if d["meta"].get(k) != meta.get(k)]
        if differ:
            raise SystemExit(f"fa-tools gate calibrate --merge: {p} differs from {paths[0]} in "
                             f"{', '.join(differ)}; only studies of one policy on one GPU merge")
    runs: list[dict] = []
    for d in docs:
        offset = max((r["aa_run"] for r in runs if "aa_run" in r), default=0)
        runs += [{**r, "aa_run": r["aa_run"] + offset} if "aa_run" in r else r
                 for r in d["runs"]]
    _save(out, {**meta, "merged_from": [str(p) for p in paths]}, runs)
    return PASS
