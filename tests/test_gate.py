"""The gate's logic on CPU: statistics, verdicts, the static ratchet's rules, exit codes and
the combined report."""

from __future__ import annotations

import json
import random

import pytest

from fa_tools import abtest, gate, ratchet
from fa_tools.stats import bootstrap_ratio_ci, mann_whitney_greater

# ---- statistics (reference values from scipy.stats.mannwhitneyu, alternative="greater",
# exact up to 20 values a side, asymptotic above) --------------------------------------------


@pytest.mark.parametrize(
    "n, m, expected",
    [(6, 6, 0.0010822510822510823), (8, 8, 0.0003108003108003108),
     (6, 7, 0.0005827505827505828), (25, 30, 2.0692527515760454e-07)],
)
def test_mann_whitney_matches_scipy(n, m, expected):
    r = random.Random(1)
    x = [r.gauss(1.05, 0.03) for _ in range(n)]
    y = [r.gauss(1, 0.03) for _ in range(m)]
    assert mann_whitney_greater(x, y) == pytest.approx(expected, rel=1e-6)


def test_mann_whitney_ties_and_extremes():
    # scipy asymptotic with tie correction: 0.06936985521514459
    assert mann_whitney_greater([1, 2, 2, 3, 4, 5], [0, 1, 1, 2, 2, 3]) == pytest.approx(
        0.0693698552151446, rel=1e-9)
    x, y = [2, 3, 4, 5, 6, 7], [1, 1.1, 1.2, 1.3, 1.4, 1.5]
    assert mann_whitney_greater(x, y) == pytest.approx(1 / 924)  # the smallest p for 6 vs 6
    assert mann_whitney_greater(y, x) == pytest.approx(1.0)


def test_bootstrap_interval_brackets_the_ratio():
    lo, hi = bootstrap_ratio_ci([1.05, 1.06, 1.04, 1.05, 1.07, 1.05], [1, 1.01, 0.99, 1, 1.02, 1])
    assert lo < 1.05 < hi and lo > 1.0


# ---- verdicts ----------------------------------------------------------------------------------


def _samples(center, spread=0.005, n=8, seed=0):
    r = random.Random(seed)
    return [center * (1 + r.uniform(-spread, spread)) for _ in range(n)]


def test_analyse_verdicts():
    peer = _samples(1.0, seed=9)
    base = _samples(1.0, seed=1)
    slow = abtest.analyse("c", base, _samples(1.10, seed=2), peer, peer, 3.0, 0.002)
    same = abtest.analyse("c", base, _samples(1.0, seed=3), peer, peer, 3.0, 0.002)
    small = abtest.analyse("c", base, _samples(1.02, seed=4), peer, peer, 3.0, 0.002)
    fast = abtest.analyse("c", base, _samples(0.90, seed=5), peer, peer, 3.0, 0.002)
    assert slow.verdict == "slower" and slow.ratio == pytest.approx(1.10, rel=0.01)
    assert same.verdict == "same"
    assert small.verdict == "same", "significant but under the threshold must pass"
    assert fast.verdict == "faster"


def test_machine_drift_alone_is_not_a_regression():
    """Head rounds 10% slower together with the SDPA peer measured in the same rounds: the
    normalised comparison shows no change, so the verdict is not 'slower'."""
    base, base_peer = _samples(1.0, seed=1), _samples(2.0, seed=2)
    head, head_peer = [x * 1.1 for x in base], [x * 1.1 for x in base_peer]
    r = abtest.analyse("c", base, head, base_peer, head_peer, 3.0, 0.002)
    assert r.ratio == pytest.approx(1.1) and r.norm_ratio == pytest.approx(1.0)
    assert r.verdict == "same"


# ---- static ratchet ----------------------------------------------------------------------------

POLICY = {"static": {"kernels": "ci", "archs": ["90"], "zero_spills_for": "default",
                     "fail_on_unpinned_improvement": True,
                     "metrics": {"registers": {"max_increase": 0},
                                 "spill_bytes": {"max_increase": 0},
                                 "sass_total": {"max_increase_pct": 2.0}}}}
K = "bf16_d128_r128_c64_w4_fseqkvbor"  # a default-set kernel


def _metrics(**kw):
    base = {"registers": 200, "spill_bytes": 0, "sass_total": 1000}
    return {K: {"90": {**base, **kw}}}


@pytest.mark.parametrize(
    "current, status",
    [(_metrics(), None), (_metrics(registers=201), "worse"), (_metrics(registers=199), "improved"),
     (_metrics(sass_total=1019), None), (_metrics(sass_total=1021), "worse"),
     (_metrics(spill_bytes=8), "worse")],
)
def test_ratchet_rules(current, status):
    findings = ratchet.compare({"kernels": _metrics()}, current, POLICY)
    failed = [f for f in findings if f.failed]
    if status is None:
        assert not failed
    else:
        assert [f.status for f in failed] == [status]


def test_ratchet_zero_spill_rule_beats_the_pin():
    pinned = {"kernels": _metrics(spill_bytes=8)}
    findings = ratchet.compare(pinned, _metrics(spill_bytes=8), POLICY)
    (f,) = [f for f in findings if f.failed]
    assert f.metric == "spill_bytes" and "must stay 0" in f.rule


def test_ratchet_new_and_missing_kernels():
    other = "fp16_d64_r64_c32_w4_fqkv"
    findings = ratchet.compare({"kernels": _metrics()}, {other: _metrics()[K]}, POLICY)
    assert {(f.kernel, f.status) for f in findings if f.failed} == {(K, "missing"),
                                                                   (other, "unpinned")}


def test_rebaseline_requires_reason_and_records_history(tmp_path):
    path = tmp_path / "static.yaml"
    with pytest.raises(ValueError, match="needs a reason"):
        ratchet.rebaseline(path, _metrics(), {"nvcc": "13.0"}, "  ")
    ratchet.rebaseline(path, _metrics(), {"nvcc": "13.0"}, "first")
    doc = ratchet.rebaseline(path, _metrics(registers=190), {"nvcc": "13.0"}, "second")
    assert [h["reason"] for h in doc["history"]] == ["first", "second"]
    assert ratchet.load_yaml(path)["kernels"][K]["90"]["registers"] == 190


def test_toolchain_change_is_detected():
    assert ratchet.check_toolchain({"toolchain": {"nvdisasm": "13.5.37"}},
                                   {"nvdisasm": "13.5.37"}) is None
    assert "differs" in ratchet.check_toolchain({"toolchain": {"nvdisasm": "13.5.37"}},
                                                {"nvdisasm": "13.0.88"})


# ---- exit codes and report ---------------------------------------------------------------------


def test_overall_precedence():
    assert gate.overall([]) == gate.PASS
    assert gate.overall([0, 0]) == gate.PASS
    assert gate.overall([0, 3]) == gate.INFRA
    assert gate.overall([3, 1]) == gate.REGRESSION
    assert gate.overall([1, 2, 3]) == gate.BROKEN


def _write(out, name, doc, md="x\n"):
    (out / f"{name}.json").write_text(json.dumps(doc))
    (out / f"{name}.md").write_text(md)


def test_report_combines_parts(tmp_path, capsys):
    _write(tmp_path, "static", {"code": 0, "findings": [{"status": "ok"}]})
    row = {"verdict": "slower", "case": "c"}
    _write(tmp_path, "perf", {"code": 1, "meta": {}, "results": [row]})
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite tests="5" failures="0" errors="0" skipped="1"/></testsuites>')
    assert gate.run_report(tmp_path) == gate.REGRESSION
    md = (tmp_path / "report.md").read_text()
    assert "Gate: FAIL: regression (exit 1)" in md and "1 slower" in md and "5 run" in md
    assert json.loads((tmp_path / "report.json").read_text())["code"] == 1


def test_report_failed_tests_are_broken_and_nothing_is_infra(tmp_path):
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="0"/></testsuites>')
    _write(tmp_path, "perf", {"code": 1, "meta": {}, "results": [{"verdict": "slower"}]})
    assert gate.run_report(tmp_path) == gate.BROKEN
    empty = tmp_path / "empty"
    empty.mkdir()
    assert gate.run_report(empty) == gate.INFRA


def test_perf_without_gpu_is_infra(tmp_path, monkeypatch):
    import argparse

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = argparse.Namespace(rounds=None, reps=None, aa=True, base=None, base_dir=None,
                              repeat=1, rebuild=False, kernels="ci", archs=None)
    policy = {"perf": {"rounds": 6, "reps": 5, "threshold_pct": 3.0, "alpha": 0.002}}
    assert gate.run_perf(args, policy, tmp_path) == gate.INFRA
    assert "no CUDA GPU" in (tmp_path / "perf.md").read_text()


def test_broken_head_worker_is_exit_2(tmp_path):
    """A head whose flash_attention cannot even be imported is 'broken', never 'slower'."""
    src = tmp_path / "src" / "flash_attention"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("raise ImportError('planted: the head does not import')\n")
    with pytest.raises(abtest.WorkerError) as info:
        abtest.Worker("head", tmp_path / "src")
    assert info.value.kind == "broken" and "planted" in str(info.value)
