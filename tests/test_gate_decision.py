"""The required check's decision (ci/gate_decision.py) for every combination of CPU result,
GPU result, fork or not, and maintainer approval (none, for the head, for an older commit),
against the rule table below; the CLI's exit codes and messages; and how the approval is read
from the gpu-gate workflow's runs. CPU only, standard library only."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .script_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "ci" / "gate_decision.py"
gd = load_script("ci/gate_decision.py")

HEAD = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"
APPROVED_SHA = {"none": "", "head": HEAD, "older": OLD}

RESULTS = ("success", "failure", "cancelled", "skipped")
FORKS = (False, True)
APPROVALS = ("none", "head", "older")

# ---- the rule table -------------------------------------------------------------------------
# CPU part: rule C1 passes only on success.
CPU_OK = {"success": True, "failure": False, "cancelled": False, "skipped": False}

# GPU part, every (fork, approval, GPU result) written out: (passes, rule that decides).
# Same-repository PRs ignore approval; fork PRs need a maintainer run on exactly the head.
GPU_TABLE = {
    # fork   approval  gpu           passes rule
    (False, "none",  "success"):   (True,  "G1"),
    (False, "none",  "failure"):   (False, "G2"),
    (False, "none",  "cancelled"): (False, "G2"),
    (False, "none",  "skipped"):   (False, "G2"),
    (False, "head",  "success"):   (True,  "G1"),
    (False, "head",  "failure"):   (False, "G2"),
    (False, "head",  "cancelled"): (False, "G2"),
    (False, "head",  "skipped"):   (False, "G2"),
    (False, "older", "success"):   (True,  "G1"),
    (False, "older", "failure"):   (False, "G2"),
    (False, "older", "cancelled"): (False, "G2"),
    (False, "older", "skipped"):   (False, "G2"),
    (True,  "none",  "success"):   (False, "G3"),  # a GPU success nobody approved: not trusted
    (True,  "none",  "failure"):   (False, "G3"),
    (True,  "none",  "cancelled"): (False, "G3"),
    (True,  "none",  "skipped"):   (False, "G3"),  # today's hole: skipped GPU on a fork
    (True,  "head",  "success"):   (True,  "G5"),  # the only way a fork PR passes
    (True,  "head",  "failure"):   (False, "G6"),
    (True,  "head",  "cancelled"): (False, "G6"),
    (True,  "head",  "skipped"):   (False, "G6"),
    (True,  "older", "success"):   (False, "G4"),  # approved, then pushed: approval dropped
    (True,  "older", "failure"):   (False, "G4"),
    (True,  "older", "cancelled"): (False, "G4"),
    (True,  "older", "skipped"):   (False, "G4"),
}

COMBINATIONS = list(itertools.product(RESULTS, RESULTS, FORKS, APPROVALS))


def expected(cpu: str, gpu: str, fork: bool, approval: str) -> tuple[bool, tuple[str, ...]]:
    """Gate passes iff both parts pass; the rules reported are the failing ones, else both
    passing ones (C1 first)."""
    gpu_ok, gpu_rule = GPU_TABLE[(fork, approval, gpu)]
    if CPU_OK[cpu] and gpu_ok:
        return True, ("C1", gpu_rule)
    return False, (("C1",) if not CPU_OK[cpu] else ()) + (() if gpu_ok else (gpu_rule,))


def _id(combo) -> str:
    cpu, gpu, fork, approval = combo
    return f"cpu={cpu}-gpu={gpu}-{'fork' if fork else 'same'}-approval={approval}"


def test_the_table_covers_every_combination_once():
    assert set(GPU_TABLE) == set(itertools.product(FORKS, APPROVALS, RESULTS))
    assert set(CPU_OK) == set(RESULTS)
    assert len(COMBINATIONS) == 4 * 4 * 2 * 3 == 96
    # 2 x 3 same-repo rows pass with a GPU success (approval is irrelevant), 1 fork row passes.
    assert sum(ok for ok, _ in GPU_TABLE.values()) == 3 + 1


@pytest.mark.parametrize("combo", COMBINATIONS, ids=_id)
def test_decision_matches_the_rule_table(combo):
    cpu, gpu, fork, approval = combo
    d = gd.decide(cpu, gpu, fork, HEAD, APPROVED_SHA[approval], "12")
    passed, rules = expected(cpu, gpu, fork, approval)
    assert (d.passed, d.rules) == (passed, rules)
    # an independent statement of the same policy
    assert d.passed == (cpu == "success" and gpu == "success"
                        and (not fork or approval == "head"))
    assert d.line().startswith("PASS: " if passed else "FAIL: ")
    assert "\n" not in d.line()


@pytest.mark.parametrize("combo", COMBINATIONS, ids=_id)
def test_cli_exit_code_and_one_line_message(combo, capsys):
    cpu, gpu, fork, approval = combo
    rc = gd.main(["decide", "--cpu", cpu, "--gpu", gpu, "--fork", str(fork).lower(),
                  "--head-sha", HEAD, "--approved-sha", APPROVED_SHA[approval], "--pr", "12"])
    passed, _ = expected(cpu, gpu, fork, approval)
    out = capsys.readouterr().out
    assert rc == (0 if passed else 1)
    assert out.count("\n") == 1 and out.startswith("PASS: " if passed else "FAIL: ")


def test_messages_name_the_problem_and_the_next_step():
    # CPU failure and a fork without approval: both reasons, in one line
    d = gd.decide("failure", "skipped", True, HEAD, "", "12")
    assert d.rules == ("C1", "G3")
    assert "CPU gate did not pass (failure)" in d.reason
    assert f"gh workflow run gpu-gate.yml -f pr=12 -f sha={HEAD}" in d.reason
    # approval for an older commit: both commits named, and what to do
    d = gd.decide("success", "success", True, HEAD, OLD, "12")
    assert OLD[:12] in d.reason and HEAD[:12] in d.reason and "pushed after approval" in d.reason
    # a maintainer run that failed on the head
    d = gd.decide("success", "failure", True, HEAD, HEAD)
    assert d.line() == (
        f"FAIL: fork PR: maintainer-run GPU gate on {HEAD[:12]} did not pass (failure)")
    assert gd.decide("success", "success", True, HEAD, HEAD).line() == (
        f"PASS: CPU gate passed; fork PR: maintainer-run GPU gate passed on {HEAD[:12]}")
    assert gd.decide("success", "success", False).line() == "PASS: CPU gate passed; GPU gate passed"
    assert gd.decide("success", "cancelled", False).line() == (
        "FAIL: GPU gate did not pass (cancelled)")


@pytest.mark.parametrize("gpu", ["pending", "timed_out", "action_required", "neutral", "", None])
def test_anything_but_success_fails(gpu):
    assert not gd.decide("success", gpu, False).passed
    assert not gd.decide("success", gpu, True, HEAD, HEAD).passed
    assert not gd.decide(gpu, "success", False).passed


def test_sha_comparison_is_exact_and_fails_closed():
    assert gd.decide("success", "success", True, HEAD.upper(), HEAD).passed  # case only
    assert gd.approval_state(HEAD, HEAD[:12]) == gd.MALFORMED  # abbreviated: no match
    d = gd.decide("success", "success", True, HEAD, HEAD[:12])
    assert not d.passed and d.rules == ("G4",)
    assert not gd.decide("success", "success", True, "", HEAD).passed  # head unknown
    assert not gd.decide("success", "success", True, "not-a-sha", "not-a-sha").passed
    assert gd.approval_state(HEAD, "") == gd.NONE
    assert gd.approval_state(HEAD, OLD) == gd.OLDER


@pytest.mark.parametrize("value, fork", [("false", False), ("False", False), ("0", False),
                                         ("no", False), ("true", True), ("", True),
                                         ("flase", True), (None, True)])
def test_only_an_explicit_false_means_same_repository(value, fork):
    assert gd.is_fork(value) is fork


def test_cli_reads_environment_variables(monkeypatch, capsys):
    monkeypatch.setenv("GATE_CPU", "success")
    monkeypatch.setenv("GATE_GPU", "success")
    monkeypatch.setenv("GATE_FORK", "true")
    monkeypatch.setenv("GATE_HEAD_SHA", HEAD)
    monkeypatch.setenv("GATE_APPROVED_SHA", HEAD)
    assert gd.main(["decide"]) == 0
    assert capsys.readouterr().out.startswith("PASS: ")
    monkeypatch.setenv("GATE_APPROVED_SHA", OLD)
    assert gd.main(["decide"]) == 1
    monkeypatch.delenv("GATE_FORK")  # unset: treated as a fork, and this approval is stale
    assert gd.main(["decide"]) == 1
    assert "fork PR" in capsys.readouterr().out


def test_script_runs_standalone_with_exit_codes():
    """As the workflow calls it: python3 ci/gate_decision.py, no package, no PYTHONPATH."""
    def run(*args):
        return subprocess.run([sys.executable, str(SCRIPT), "decide", *args],
                              capture_output=True, text=True, cwd="/", check=False)

    ok = run("--cpu", "success", "--gpu", "success", "--fork", "false")
    assert (ok.returncode, ok.stdout) == (0, "PASS: CPU gate passed; GPU gate passed\n")
    hole = run("--cpu", "success", "--gpu", "skipped", "--fork", "true", "--head-sha", HEAD)
    assert hole.returncode == 1 and hole.stdout.startswith("FAIL: fork PR: no maintainer")


# ---- the approval record: gpu-gate's workflow_dispatch runs ---------------------------------

def _run(run_id, pr, sha, *, status="completed", conclusion="success",
         event="workflow_dispatch", branch="main", created="2026-11-22T10:00:00Z"):
    return {"id": run_id, "display_title": f"gpu-gate PR #{pr} @ {sha}", "event": event,
            "head_branch": branch, "status": status, "conclusion": conclusion,
            "created_at": created, "html_url": f"https://example.invalid/runs/{run_id}"}


def test_no_runs_means_no_approval():
    assert gd.approval_from_runs([], 12, HEAD) == gd.Approval("", "skipped", "")
    assert gd.approval_from_runs([_run(1, 13, HEAD)], 12, HEAD).sha == ""


def test_head_run_wins_over_later_runs_for_other_commits():
    runs = [_run(1, 12, HEAD, created="2026-11-22T10:00:00Z"),
            _run(2, 12, OLD, conclusion="failure", created="2026-11-22T11:00:00Z")]
    ap = gd.approval_from_runs(runs, 12, HEAD)
    assert (ap.sha, ap.gpu, ap.run_url) == (HEAD, "success", "https://example.invalid/runs/1")


def test_latest_run_for_the_head_counts_and_unfinished_is_pending():
    runs = [_run(1, 12, HEAD, conclusion="failure", created="2026-11-22T10:00:00Z"),
            _run(2, 12, HEAD, status="in_progress", conclusion=None,
                 created="2026-11-22T11:00:00Z")]
    assert gd.approval_from_runs(runs, 12, HEAD).gpu == "pending"
    runs.append(_run(3, 12, HEAD, created="2026-11-22T12:00:00Z"))
    assert gd.approval_from_runs(runs, 12, HEAD).gpu == "success"


def test_older_approval_is_reported_as_such():
    runs = [_run(1, 12, OLD)]
    ap = gd.approval_from_runs(runs, 12, HEAD)
    assert ap.sha == OLD
    assert not gd.decide("success", ap.gpu, True, HEAD, ap.sha).passed


def test_runs_that_are_not_maintainer_dispatches_on_main_are_ignored():
    # a fork can name its own workflow "gpu-gate" and title a pull_request run like ours
    runs = [_run(1, 12, HEAD, event="pull_request"),
            _run(2, 12, HEAD, branch="feature"),
            {**_run(3, 12, HEAD), "display_title": f"gpu-gate PR #12 @ {HEAD} "},
            {**_run(4, 12, HEAD), "display_title": f"gpu-gate PR #123 @ {HEAD}"},
            {**_run(5, 12, HEAD), "display_title": f"gpu-gate PR #12 @ {HEAD[:12]}"}]
    assert gd.approval_from_runs(runs, 12, HEAD).sha == ""


def test_approval_cli_writes_github_output_lines(tmp_path, capsys):
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps({"total_count": 1, "workflow_runs": [_run(7, 12, HEAD)]}))
    assert gd.main(["approval", "--runs", str(runs), "--pr", "12", "--head-sha", HEAD]) == 0
    assert capsys.readouterr().out == (
        f"approved_sha={HEAD}\ngpu=success\nrun_url=https://example.invalid/runs/7\n")


def test_run_title_pattern_matches_the_workflow_run_name():
    """RUN_TITLE_RE must parse the run-name that .github/workflows/gpu-gate.yml renders."""
    text = (ROOT / ".github" / "workflows" / "gpu-gate.yml").read_text()
    m = re.search(r"^run-name:\s*(.+)$", text, re.M)
    assert m, "gpu-gate.yml has no run-name"
    rendered = (m.group(1).strip().strip("'\"")
                .replace("${{ inputs.pr }}", "12").replace("${{ inputs.sha }}", HEAD))
    assert gd.RUN_TITLE_RE.match(rendered)
    # gate-report.yml parses the same title in bash: its pattern must agree
    report = (ROOT / ".github" / "workflows" / "gate-report.yml").read_text()
    bash_re = re.search(r"re='(\^gpu-gate[^']+)'", report)
    assert bash_re and re.match(bash_re.group(1), rendered)
    assert bash_re.group(1) == gd.RUN_TITLE_RE.pattern.replace(r"\d", "[0-9]")
    assert f"-f pr=12 -f sha={HEAD}" in gd.decide("success", "skipped", True, HEAD, "", "12").reason
    assert "workflow_dispatch" in text and gd.WORKFLOW_FILE == "gpu-gate.yml"
