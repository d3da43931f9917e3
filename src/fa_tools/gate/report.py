"""The combined report of a gate run: one markdown (report.md, also appended to the GitHub job
summary) and report.json with the overall exit code, from the parts the steps wrote into the
report directory: build.json (only when the head does not build), static.json, tests.xml (or
tests.json when the test run itself broke), perf.json, hostbench.json."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

from . import BROKEN, INFRA, PASS, VERDICT, overall

PARTS = ("build", "static", "tests", "perf", "hostbench")


def tests_summary(junit: Path) -> dict:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites)
             for k in ("tests", "failures", "errors", "skipped")}
    total["code"] = BROKEN if total["failures"] or total["errors"] else PASS
    return total


def _detail(name: str, doc: dict) -> str:
    if doc.get("error"):
        return doc["error"].strip().splitlines()[0]
    if name == "static":
        fs = doc.get("findings", [])
        return (f"{sum(f['status'] == 'worse' for f in fs)} worse, "
                f"{sum(f['status'] in ('improved', 'unpinned', 'missing') for f in fs)} "
                f"to re-pin, {len(fs)} checked")
    if name == "perf":
        rs = doc.get("results", [])
        if not rs:
            return (doc.get("meta", {}).get("error", "").strip().splitlines() or [""])[0]
        counts = {v: sum(r["verdict"] == v for r in rs)
                  for v in ("slower", "inconclusive", "accepted", "faster", "same", "new")}
        return ", ".join(f"{n} {v}" for v, n in counts.items()) + f" of {len(rs)} cases"
    return doc.get("summary", "")


def run(out: Path) -> int:
    parts, codes, summary = [], [], []
    for name in PARTS:
        junit = out / "tests.xml"
        if name == "tests" and junit.exists() and not (out / "tests.json").exists():
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
        md = out / f"{name}.md"
        if md.exists():
            parts.append(md.read_text())
        summary.append(f"| {name} | {VERDICT[doc['code']]} | {_detail(name, doc)} |")
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
