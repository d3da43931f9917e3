"""The gate: the static resource ratchet (static), the sequential A/B performance comparison
(perf), its power study (calibrate), re-pinning baselines, and the combined report (report).

Exit codes, of every subcommand and of the combined report:
  0 pass
  1 regression: a case is significantly slower beyond the threshold, or a pin got worse
  2 broken: a build, test or benchmark of the head failed, crashed or ran past its time limit,
    or the head's perf accept file is broken (an entry malformed or naming no case)
  3 infrastructure or no data: no GPU, the base does not build, tools or baselines missing
  4 inconclusive: after the most rounds the policy allows, a case could be neither cleared nor
    convicted (its interval still straddles the threshold); re-run the gate on a quiet GPU
A broken benchmark is never reported as slower, and never as a pass.
"""

from __future__ import annotations

import json
from pathlib import Path

PASS, REGRESSION, BROKEN, INFRA, INCONCLUSIVE = 0, 1, 2, 3, 4
VERDICT = {PASS: "PASS", REGRESSION: "FAIL: regression", BROKEN: "FAIL: broken",
           INFRA: "ERROR: infrastructure / no data", INCONCLUSIVE: "FAIL: inconclusive"}


def overall(codes: list[int]) -> int:
    """Broken beats regression beats inconclusive beats infrastructure beats pass."""
    for code in (BROKEN, REGRESSION, INCONCLUSIVE, INFRA):
        if code in codes:
            return code
    return PASS


def write_part(out: Path, name: str, doc: dict, md: str) -> None:
    """One part of the report: out/<name>.json (with its exit code) and out/<name>.md."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{name}.md").write_text(md)
