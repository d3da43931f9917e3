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
import logging
import statistics
import time
from pathlib import Path

from ..gpu.perfcases import GATE_CASES, Case, planted_keys
from . import PASS, write_part
from .abtest import Policy, compare
from .perf import workers

log = logging.getLogger(__name__)


def _row(case: Case, size_pct: float, verdicts: list[str], ratios: list[float],
         rounds: list[int], seconds: list[float]) -> dict:
    n = len(verdicts)
    added = planted_keys(case, size_pct / 100)
    work_pct = 100 * added / case.seqlen
    realised = statistics.median(ratios) - 1 >= work_pct / 200  # at least half the plant
    return {"planted": f"{size_pct:g}%", "added": f"+{added} of {case.seqlen} keys",
            "work_pct": work_pct, "realised": realised, "runs": n,
            "slower": verdicts.count("slower"), "inconclusive": verdicts.count("inconclusive"),
            "same": verdicts.count("same"), "faster": verdicts.count("faster"),
            "detection_rate": verdicts.count("slower") / n if n else 0.0,
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "rounds_median": statistics.median(rounds),
            "seconds_median": statistics.median(seconds)}


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
    power: list[dict] = []
    aa = None
    runs: list[dict] = []  # every comparison made, with its per-round samples (calibrate.json)

    def save() -> None:  # after every block, so a study cut short still leaves its tables
        write_part(out, "calibrate", {"code": PASS, "meta": meta, "power": power, "aa": aa,
                                      "runs": runs},
                   markdown(meta, power, aa))

    with workers(args, perf, meta) as (base_w, head_w):
        for name in args.case:
            for size in args.sizes:
                verdicts, ratios, rounds, seconds = [], [], [], []
                for i in range(args.runs):
                    t0 = time.monotonic()
                    (r,) = compare(base_w, head_w, [by_name[name]], policy, n_family,
                                   {name: size / 100})
                    seconds.append(time.monotonic() - t0)
                    verdicts.append(r.verdict)
                    runs.append({"planted_pct": size, **r.as_dict()})
                    ratios.append(r.ratio)
                    rounds.append(r.rounds)
                    log.info("%s +%g%%: run %d/%d: %s, ratio %.4f, %d rounds", name, size,
                             i + 1, args.runs, r.verdict, r.ratio, r.rounds)
                power.append({"case": name, **_row(by_name[name], size, verdicts, ratios,
                                                   rounds, seconds)})
                save()
        if args.aa_runs:
            per_case: dict[str, dict[str, list]] = {c.name: {"v": [], "r": [], "n": []}
                                                    for c in GATE_CASES}
            slower_runs = inconclusive_runs = 0
            for i in range(args.aa_runs):
                t0 = time.monotonic()
                results = compare(base_w, head_w, list(GATE_CASES), policy, n_family)
                verdicts = [r.verdict for r in results]
                slower_runs += "slower" in verdicts
                inconclusive_runs += "inconclusive" in verdicts
                for r in results:
                    runs.append({"aa_run": i + 1, **r.as_dict()})
                    per_case[r.case]["v"].append(r.verdict)
                    per_case[r.case]["r"].append(r.ratio)
                    per_case[r.case]["n"].append(r.rounds)
                log.info("A/A run %d/%d (%.0f s): %s", i + 1, args.aa_runs,
                         time.monotonic() - t0,
                         ", ".join(f"{r.case} {r.verdict} {r.ratio:.4f}" for r in results))
                aa = _aa_summary(i + 1, n_family, slower_runs, inconclusive_runs, per_case)
                save()
    save()
    return PASS


def _aa_summary(runs: int, n_family: int, slower_runs: int, inconclusive_runs: int,
                per_case: dict[str, dict[str, list]]) -> dict:
    return {"runs": runs, "cases": n_family, "runs_with_slower": slower_runs,
            "runs_with_inconclusive": inconclusive_runs, "fp_rate": slower_runs / runs,
            "per_case": [{"case": name, "same": d["v"].count("same"),
                          "inconclusive": d["v"].count("inconclusive"),
                          "slower": d["v"].count("slower"), "faster": d["v"].count("faster"),
                          "ratio_median": statistics.median(d["r"]),
                          "ratio_min": min(d["r"]), "ratio_max": max(d["r"]),
                          "rounds_median": statistics.median(d["n"])}
                         for name, d in per_case.items()]}
