#!/usr/bin/env python3
"""The pull-request gate's decision: does the required check `gate` pass?

Pure logic, standard library only, so the workflow can run it from the base branch with the
runner's python3 and nothing installed. Two commands:

  decide    the decision from the job results; prints one line ("PASS: ..." / "FAIL: ...")
            and exits 0 (pass) or 1 (fail). Inputs as options or environment variables:
              --cpu          GATE_CPU           result of the CPU job
              --gpu          GATE_GPU           result of the GPU gate on the head's code: the
                                                GPU job of this run for a same-repository PR,
                                                the maintainer's gpu-gate run for a fork PR
              --fork         GATE_FORK          true / false: the head lives in another
                                                repository (anything but false counts as true)
              --head-sha     GATE_HEAD_SHA      the PR's head commit (40 hex)
              --approved-sha GATE_APPROVED_SHA  the commit a maintainer ran the GPU gate on
                                                (empty: none)
              --pr           GATE_PR            the PR number (only used in the message)
  approval  reads the gpu-gate workflow_dispatch runs (the JSON of
            GET /repos/{repo}/actions/workflows/gpu-gate.yml/runs) and prints, in the
            $GITHUB_OUTPUT format, approved_sha=, gpu= and run_url= for one PR and head.

Results are GitHub's job results (success, failure, cancelled, skipped) or run conclusions
(also timed_out, action_required, ...); "pending" is a maintainer run not finished yet. Only
"success" counts as passed. The rules, in docs/security.md and tests/test_gate_decision.py:

  C1  CPU job succeeded ........................................ else FAIL
  G1  same-repository PR: the GPU job succeeded ................ PASS part
  G2  same-repository PR: the GPU job did not succeed .......... FAIL
  G3  fork PR, no maintainer run ............................... FAIL (whatever the GPU result)
  G4  fork PR, maintainer run on another commit than the head .. FAIL (a push drops approval)
  G5  fork PR, maintainer run on the head, it succeeded ........ PASS part
  G6  fork PR, maintainer run on the head, it did not succeed .. FAIL

The gate passes when C1 holds and the GPU part is G1 or G5. A fork PR's GPU result is never
trusted without an approval for exactly its head commit: a malformed SHA counts as no match.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SUCCESS = "success"
SHA_RE = re.compile(r"^[0-9a-f]{40}$")
# run-name of .github/workflows/gpu-gate.yml; keep the two in step.
RUN_TITLE_RE = re.compile(r"^gpu-gate PR #(\d+) @ ([0-9a-f]{40})$")
WORKFLOW_FILE = "gpu-gate.yml"

NONE, HEAD, OLDER, MALFORMED = "none", "head", "older", "malformed"


@dataclass(frozen=True)
class Decision:
    passed: bool
    rules: tuple[str, ...]  # the rules that decided: failing ones, or the passing ones
    reason: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}: {self.reason}"


@dataclass(frozen=True)
class Approval:
    sha: str  # commit the latest relevant maintainer run was for; "" if none
    gpu: str  # that run's conclusion, "pending" while it runs, "skipped" if none
    run_url: str


def _norm(result: str | None) -> str:
    return (result or "").strip().lower() or "missing"


def _norm_sha(sha: str | None) -> str:
    return (sha or "").strip().lower()


def approval_state(head_sha: str, approved_sha: str) -> str:
    """none / head / older / malformed, comparing full 40-hex SHAs only."""
    head, approved = _norm_sha(head_sha), _norm_sha(approved_sha)
    if not approved:
        return NONE
    if not SHA_RE.match(approved) or not SHA_RE.match(head):
        return MALFORMED
    return HEAD if approved == head else OLDER


def _fork_command(pr: str, head_sha: str) -> str:
    pr_arg = pr if pr.isdigit() else "<PR>"
    sha_arg = head_sha if SHA_RE.match(head_sha) else "<head SHA>"
    return f"gh workflow run {WORKFLOW_FILE} -f pr={pr_arg} -f sha={sha_arg}"


def decide(cpu: str | None, gpu: str | None, fork: bool, head_sha: str = "",
           approved_sha: str = "", pr: str = "") -> Decision:
    """The gate's decision (rules C1, G1-G6 in the module docstring)."""
    cpu, gpu = _norm(cpu), _norm(gpu)
    head = _norm_sha(head_sha)
    fails: list[tuple[str, str]] = []
    passes: list[tuple[str, str]] = []

    if cpu == SUCCESS:
        passes.append(("C1", "CPU gate passed"))
    else:
        fails.append(("C1", f"CPU gate did not pass ({cpu})"))

    if not fork:
        if gpu == SUCCESS:
            passes.append(("G1", "GPU gate passed"))
        else:
            fails.append(("G2", f"GPU gate did not pass ({gpu})"))
    else:
        state = approval_state(head, approved_sha)
        short = head[:12] or "?"
        if state == NONE:
            fails.append(("G3", f"fork PR: no maintainer has run the GPU gate on {short}; after "
                                f"review a maintainer runs `{_fork_command(pr, head)}`"))
        elif state == MALFORMED:
            fails.append(("G4", f"fork PR: the approval record ({approved_sha!r}) does not name "
                                f"the head {short} as a full SHA; a maintainer reruns "
                                f"`{_fork_command(pr, head)}`"))
        elif state == OLDER:
            fails.append(("G4", f"fork PR: the maintainer's GPU run was for "
                                f"{_norm_sha(approved_sha)[:12]}, the head is now {short} (pushed "
                                f"after approval); review the new commits, then "
                                f"`{_fork_command(pr, head)}`"))
        elif gpu == SUCCESS:
            passes.append(("G5", f"fork PR: maintainer-run GPU gate passed on {short}"))
        else:
            fails.append(("G6", f"fork PR: maintainer-run GPU gate on {short} did not pass "
                                f"({gpu})"))

    if fails:
        return Decision(False, tuple(r for r, _ in fails), "; ".join(m for _, m in fails))
    return Decision(True, tuple(r for r, _ in passes), "; ".join(m for _, m in passes))


def approval_from_runs(runs: Iterable[Mapping[str, object]], pr: int, head_sha: str,
                       branch: str = "main") -> Approval:
    """The maintainer approval of one PR from gpu-gate's runs: workflow_dispatch runs of the
    definition on `branch` whose title names this PR. The latest run for the head commit wins;
    if there is none, the latest run for any commit of the PR (an older approval)."""
    head = _norm_sha(head_sha)
    mine: list[tuple[str, int, str, Mapping[str, object]]] = []
    for run in runs:
        if run.get("event") != "workflow_dispatch" or run.get("head_branch") != branch:
            continue
        m = RUN_TITLE_RE.match(str(run.get("display_title", "")))
        if not m or int(m.group(1)) != pr:
            continue
        created = str(run.get("created_at", ""))
        run_id = run.get("id")
        mine.append((created, run_id if isinstance(run_id, int) else 0, m.group(2), run))
    if not mine:
        return Approval("", "skipped", "")
    on_head = [r for r in mine if r[2] == head]
    _created, _id, sha, run = max(on_head or mine, key=lambda r: (r[0], r[1]))
    finished = run.get("status") == "completed"
    gpu = _norm(str(run.get("conclusion") or "")) if finished else "pending"
    return Approval(sha, gpu, str(run.get("html_url", "")))


def is_fork(value: str | None) -> bool:
    """Only an explicit false marks a same-repository PR; anything else (empty, a typo) is
    treated as a fork, the stricter case."""
    return (value or "").strip().lower() not in {"false", "0", "no"}


def main(argv: Sequence[str] | None = None) -> int:
    env = os.environ
    parser = argparse.ArgumentParser(prog="gate_decision.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("decide", help="the gate's decision: one line, exit 0 pass / 1 fail")
    d.add_argument("--cpu", default=env.get("GATE_CPU", ""))
    d.add_argument("--gpu", default=env.get("GATE_GPU", ""))
    d.add_argument("--fork", default=env.get("GATE_FORK", ""), help="true / false")
    d.add_argument("--head-sha", default=env.get("GATE_HEAD_SHA", ""))
    d.add_argument("--approved-sha", default=env.get("GATE_APPROVED_SHA", ""))
    d.add_argument("--pr", default=env.get("GATE_PR", ""))
    a = sub.add_parser("approval", help="approved_sha/gpu/run_url of one PR from gpu-gate runs")
    a.add_argument("--runs", type=Path, required=True, help="JSON of the workflow runs list")
    a.add_argument("--pr", type=int, required=True)
    a.add_argument("--head-sha", required=True)
    a.add_argument("--branch", default="main", help="branch of the trusted definition")
    args = parser.parse_args(argv)

    if args.command == "approval":
        doc = json.loads(args.runs.read_text())
        runs = doc.get("workflow_runs", []) if isinstance(doc, dict) else doc
        ap = approval_from_runs(runs, args.pr, args.head_sha, args.branch)
        print(f"approved_sha={ap.sha}\ngpu={ap.gpu}\nrun_url={ap.run_url}")
        return 0

    decision = decide(args.cpu, args.gpu, is_fork(args.fork), args.head_sha,
                      args.approved_sha, args.pr)
    print(decision.line())
    return 0 if decision.passed else 1


if __name__ == "__main__":
    sys.exit(main())
