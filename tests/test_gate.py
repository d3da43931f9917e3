"""The gate's logic on CPU: statistics, verdicts, the static ratchet's rules, exit codes and
the combined report."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fa_tools import gate, paths
from fa_tools.gate import abtest, perf, ratchet, report
from fa_tools.gate.stats import hodges_lehmann, signed_rank_greater
from fa_tools.gpu.perfcases import Case

ROOT = Path(__file__).resolve().parents[1]
POLICY_FILE = ROOT / "ci" / "gate_policy.yaml"

# ---- statistics (reference values from scipy.stats.wilcoxon, alternative="greater": exact up
# to 50 pairs, normal approximation with continuity correction above and with ties) ----------


def _diffs(n, mu, seed=1):
    r = random.Random(seed)
    return [r.gauss(mu, 0.01) for _ in range(n)]


@pytest.mark.parametrize(
    "n, mu, expected",
    [(12, 0.01, 0.008056640625), (20, 0.002, 0.0031948089599609375),
     (30, 0.0, 0.27805663738399744), (60, 0.003, 0.1955492997006671)],
)
def test_signed_rank_matches_scipy(n, mu, expected):
    r = random.Random(1)
    for m, spread in ((12, 0.01), (20, 0.002), (30, 0.0), (60, 0.003)):
        d = [r.gauss(spread, 0.01) for _ in range(m)]
        if m == n:
            break
    assert signed_rank_greater(d) == pytest.approx(expected, rel=1e-9)


def test_signed_rank_ties_zeros_and_extremes():
    # scipy, zero_method="wilcox", correction=True, method="approx": 0.045444392622863546
    assert signed_rank_greater([1, 2, 2, 3, -1, 4, -2, 5, 0]) == pytest.approx(
        0.04544439262286354, rel=1e-9)
    assert signed_rank_greater([0.01 * (i + 1) for i in range(12)]) == pytest.approx(2**-12)
    assert signed_rank_greater([-0.01 * (i + 1) for i in range(12)]) == pytest.approx(1.0)
    assert signed_rank_greater([0.0, 0.0]) == 1.0


def test_hodges_lehmann_interval():
    # 1..10: 55 Walsh averages; P(W+ <= 8) = 25/1024 <= 0.025 < P(W+ <= 9), so the 95%
    # interval runs from the 10th smallest to the 10th largest average: [3.5, 7.5]
    assert hodges_lehmann([float(i) for i in range(1, 11)]) == (5.5, 3.5, 7.5)
    # n = 6: P(W+ <= 0) = 1/64: the 2nd smallest to the 2nd largest (96.9% coverage)
    assert hodges_lehmann([1.0, 2, 3, 4, 5, 6]) == (3.5, 1.5, 5.5)
    est, lo, hi = hodges_lehmann(_diffs(60, 0.01))  # normal approximation above 50
    assert lo < est < hi and lo > 0.0


# ---- verdicts ----------------------------------------------------------------------------------


def _samples(center, spread=0.005, n=12, seed=0):
    r = random.Random(seed)
    return [center * (1 + r.uniform(-spread, spread)) for _ in range(n)]


POL = abtest.Policy()
ALPHA = POL.alpha_per_look(7)


def test_policy_splits_alpha_over_cases_and_looks():
    assert POL.looks == 1 + 3  # after 12, 24, 36 and 48 rounds
    assert pytest.approx(0.01 / (7 * 4)) == ALPHA
    assert 2.0**-POL.rounds < ALPHA, "the first look must be able to reach significance"
    with pytest.raises(ValueError, match="unknown perf policy keys: alpah"):
        abtest.Policy.from_dict({"alpah": 0.1})


def test_analyse_verdicts():
    peer = _samples(1.0, seed=9)
    base = _samples(1.0, seed=1)
    slow = abtest.analyse("c", base, _samples(1.10, seed=2), peer, peer, POL, ALPHA)
    same = abtest.analyse("c", base, _samples(1.0, seed=3), peer, peer, POL, ALPHA)
    small = abtest.analyse("c", base, [b * 1.004 for b in base], peer, peer, POL, ALPHA)
    fast = abtest.analyse("c", base, _samples(0.90, seed=5), peer, peer, POL, ALPHA)
    assert slow.verdict == "slower" and slow.ratio == pytest.approx(1.10, rel=0.01)
    assert same.verdict == "same"
    assert small.verdict == "same", "significant but under the threshold must pass"
    assert fast.verdict == "faster"


def test_too_few_rounds_or_too_much_noise_is_undecided():
    peer = _samples(1.0, seed=9, n=6)
    six = abtest.analyse("c", _samples(1.0, n=6, seed=1), _samples(1.10, n=6, seed=2), peer,
                         peer, POL, ALPHA)
    assert six.verdict == "undecided", "2^-6 cannot reach the per-look alpha"
    noisy_peer = _samples(1.0, seed=9)
    noisy = abtest.analyse("c", _samples(1.0, 0.08, seed=1), _samples(1.02, 0.08, seed=2),
                           noisy_peer, noisy_peer, POL, ALPHA)
    assert noisy.verdict == "undecided" and noisy.ci_low < 1.015 < noisy.ci_high


def test_machine_drift_alone_is_not_a_regression():
    """Head rounds 10% slower together with the SDPA peer measured in the same rounds: the
    normalised comparison shows no change, so the verdict is not 'slower'."""
    base, base_peer = _samples(1.0, seed=1), _samples(2.0, seed=2)
    head, head_peer = [x * 1.1 for x in base], [x * 1.1 for x in base_peer]
    r = abtest.analyse("c", base, head, base_peer, head_peer, POL, ALPHA)
    assert r.ratio == pytest.approx(1.1) and r.norm_ratio == pytest.approx(1.0)
    assert r.verdict != "slower"


def test_noisy_peer_does_not_hide_a_slowdown():
    """The peer's noise enters only the normalised ratios, which are not tested for
    significance: a clear 4% slowdown of ours is 'slower' even when the peer jitters by 6%."""
    base, head = _samples(1.0, 0.002, seed=1), _samples(1.04, 0.002, seed=2)
    base_peer, head_peer = _samples(2.0, 0.06, seed=3), _samples(2.0, 0.06, seed=4)
    r = abtest.analyse("c", base, head, base_peer, head_peer, POL, ALPHA)
    assert r.norm_p_slower > ALPHA, "the normalised test alone would not convict"
    assert r.verdict == "slower" and r.ratio == pytest.approx(1.04, rel=0.005)


def test_slowdown_masked_by_the_machine_is_not_cleared():
    """Raw times unchanged while the peer got 5% faster in the head's rounds: ours is 5% slower
    relative to the machine, so the case is not 'same'."""
    base, base_peer = _samples(1.0, seed=1), _samples(2.0, seed=2)
    head, head_peer = list(base), [x / 1.05 for x in base_peer]
    r = abtest.analyse("c", base, head, base_peer, head_peer, POL, ALPHA)
    assert r.ci_high < 1.03 and r.norm_ratio == pytest.approx(1.05)
    assert r.verdict == "undecided"


# ---- the sequential comparison, with simulated workers ----------------------------------------


class FakeWorker:
    """Answers like a worker: per case a time factor, noise, and the planted slowdown."""

    configs: list[str] = []  # the kernels of its build (none: the dispatch table is empty)
    bwd_configs: list[str] = []  # ... and its backward kernels
    src_dir = "simulated"  # one build for both sides: the SASS diff is not run
    energy = {"supported": False, "reason": "simulated"}

    def __init__(self, factors, noise, seed):
        self.factors, self.noise = factors, noise
        self.rng = random.Random(seed)
        self.calls: list[tuple[str, int, float, float]] = []
        self.warm_ms: set[float] = set()

    def measure(self, case, reps, timeout_s, slowdown=0.0, warm_ms=0.0):
        self.calls.append((case.name, reps, timeout_s, slowdown))
        self.warm_ms.add(warm_ms)
        base = 1.0 + case.seqlen / 1000
        jitter = 1 + self.rng.gauss(0, self.noise.get(case.name, 0.002))
        ours = base * self.factors.get(case.name, 1.0) * (1 + slowdown) * jitter
        peer = 2.0 * (1 + self.rng.gauss(0, 0.002))
        # cycles at 1.5 GHz, and a clock step on the times alone that the verdict must ignore
        step = 1 + 0.05 * self.rng.choice((0, 1))
        return {"ours": ours * step, "sdpa_fa2": peer * step, "ours_mcycles": 1.5 * ours,
                "sdpa_fa2_mcycles": 1.5 * peer}


CASES = [Case("bf16", 128, 16, 1024), Case("bf16", 128, 16, 4096), Case("fp16", 128, 16, 4096)]
CASE_1024 = "fp16_d128_b16_s1024"  # a gate case of 1024 keys (the power study tests)


def test_sequential_compare_stops_early_extends_undecided_and_plants_only_on_head():
    slow, clean, noisy = (c.name for c in CASES)
    base = FakeWorker({}, {noisy: 0.12}, seed=1)
    head = FakeWorker({slow: 1.05}, {noisy: 0.12}, seed=2)
    results = {r.case: r for r in abtest.compare(base, head, CASES, POL, 7)}
    assert results[slow].verdict == "slower" and results[slow].rounds == POL.rounds
    assert base.warm_ms == head.warm_ms == {POL.warm_ms}, "every request: steady-state timing"
    assert results[clean].verdict == "same" and results[clean].rounds == POL.rounds
    assert results[noisy].rounds > POL.rounds, "an undecided case gets more rounds"
    assert results[noisy].verdict in ("same", "inconclusive")
    # planted slowdowns reach the head only
    base, head = FakeWorker({}, {}, seed=3), FakeWorker({}, {}, seed=4)
    (r,) = abtest.compare(base, head, CASES[:1], POL, 7, {slow: 0.05})
    assert r.verdict == "slower" and r.ratio == pytest.approx(1.05, rel=0.01)
    assert all(s == 0.0 for *_, s in base.calls) and all(s == 0.05 for *_, s in head.calls)


def test_sequential_compare_gives_up_as_inconclusive():
    policy = abtest.Policy(rounds=12, step=6, max_rounds=18)
    c = CASES[0]
    base, head = FakeWorker({}, {c.name: 0.08}, 1), FakeWorker({c.name: 1.02}, {c.name: 0.08}, 2)
    (r,) = abtest.compare(base, head, [c], policy, 7)
    assert r.rounds == 18 and r.verdict == "inconclusive"
    assert perf.verdict_code([r]) == gate.INCONCLUSIVE


def test_time_limits_come_from_the_base_timings():
    c = CASES[1]
    base, head = FakeWorker({}, {}, 1), FakeWorker({}, {}, 2)
    plan = abtest.warm_up(base, head, [c], POL, {})
    assert POL.min_reps <= plan.reps[c.name] <= POL.max_reps
    assert plan.timeout_s[c.name] >= POL.min_timeout_s
    assert base.calls[0][2] == POL.first_call_timeout_s, "the base's first call: policy limit"


def test_hung_worker_is_killed_within_its_limit(tmp_path):
    """A head that never answers (here: its import sleeps) is killed at the deadline and
    reported as broken, naming what it was doing."""
    src = tmp_path / "src" / "flash_attention"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("import time\ntime.sleep(3600)\n")
    t0 = time.monotonic()
    with pytest.raises(abtest.WorkerError) as info:
        abtest.Worker("head", tmp_path / "src", start_timeout_s=3)
    assert time.monotonic() - t0 < 60
    assert info.value.kind == "broken" and "did not finish within 3 s" in str(info.value)
    assert "killed" in str(info.value)


# ---- static ratchet ----------------------------------------------------------------------------

POLICY = {"static": {"kernels": "fwd:ci", "archs": ["90"], "zero_spills_for": "fwd:default",
                     "fail_on_unpinned_improvement": True,
                     "metrics": {"registers": {"max_increase": 0},
                                 "spill_bytes": {"max_increase": 0},
                                 "sass_total": {"max_increase_pct": 2.0},
                                 "sass_ex2_overlapped": {"max_decrease": 0}}}}
K = "fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor"  # a default-set kernel


def _metrics(**kw):
    base = {"registers": 200, "spill_bytes": 0, "sass_total": 1000, "sass_ex2_overlapped": 66}
    return {K: {"90": {**base, **kw}}}


@pytest.mark.parametrize(
    "current, status",
    [(_metrics(), None), (_metrics(registers=201), "worse"), (_metrics(registers=199), "improved"),
     (_metrics(sass_total=1019), None), (_metrics(sass_total=1021), "worse"),
     (_metrics(spill_bytes=8), "worse"),
     # more is better: the softmax leaving the GEMM's shadow fails, more of it is re-pinned
     (_metrics(sass_ex2_overlapped=0), "worse"), (_metrics(sass_ex2_overlapped=70), "improved")],
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


def test_ratchet_fails_serialized_wgmma_whatever_the_pin():
    """ptxas serializing a Hopper kernel's wgmma (C75xx) halved its speed here with no other
    sign in the resources; the ratchet fails it even when the pin says 1 too."""
    policy = {"static": {**POLICY["static"], "metrics": {
        **POLICY["static"]["metrics"], "wgmma_serialized": {"max_increase": 0}}}}
    ok = ratchet.compare({"kernels": _metrics(wgmma_serialized=0)},
                         _metrics(wgmma_serialized=0), policy)
    assert not [f for f in ok if f.failed]
    for pin in (0, 1):
        findings = ratchet.compare({"kernels": _metrics(wgmma_serialized=pin)},
                                   _metrics(wgmma_serialized=1), policy)
        (f,) = [f for f in findings if f.failed]
        assert f.metric == "wgmma_serialized" and f.status == "worse"
        assert "serialized" in f.rule and "must stay 0" in f.rule
    # a new kernel is reported unpinned, and serialized if it is
    findings = ratchet.compare({"kernels": {}}, _metrics(wgmma_serialized=1), policy)
    assert {(f.metric, f.status) for f in findings if f.failed} == {
        ("*", "unpinned"), ("wgmma_serialized", "worse")}


def test_ratchet_scope_and_zero_spill_rule_cover_the_backward():
    """The backward kernels of the policy's selection are pinned with the helpers of their
    dtypes (the preprocess, and the dQ conversion of each kind: rows for the sm80 one, tiles for
    the Hopper one), and zero_spills_for makes any spill of the kernels of its selection (and
    their helpers) fail whatever the pin."""
    from flash_attention.kernels import resolve

    policy = {"static": {**POLICY["static"], "kernels": "fwd:ci,bwd:default",
                         "zero_spills_for": "default"}}
    scope = ratchet.scope_kernels(policy)
    assert "bwd_sm80_bf16_d128_r64_c128_w8_fht" in scope and K in scope
    assert {f"bwd_{kind}_{dtype}" for kind in ("sm80_preprocess", "sm80_convert_dq",
                                               "sm90_convert_dq")
            for dtype in ("fp16", "bf16")} <= set(scope)
    assert len([k for k in scope if k.startswith("bwd_")]) == 12 + 24 + 10  # sm80, Hopper, helpers
    bwd = "bwd_sm80_fp16_d256_r64_c64_w8_ft"
    pinned = {"kernels": {bwd: _metrics(spill_bytes=8)[K]}}
    (f,) = [f for f in ratchet.compare(pinned, {bwd: _metrics(spill_bytes=8)[K]}, policy)
            if f.failed]
    assert f.kernel == bwd and f.metric == "spill_bytes" and "must stay 0" in f.rule
    assert ratchet.zero_spill_kernels(policy) >= {bwd, "bwd_sm90_convert_dq_bf16", K}
    assert ratchet.scope_kernels(POLICY) == [c.name for c in resolve("fwd:ci")]
    # a selection of every kind: its kernels in kind order, then the helpers of the backward
    # and decode ones
    every = ratchet.scope_kernels({"static": {**POLICY["static"], "kernels": "ci"}})
    assert every[:len(resolve("ci"))] == [c.name for c in resolve("ci")]
    assert every[len(resolve("ci")):] == [
        "bwd_sm80_preprocess_fp16", "bwd_sm80_convert_dq_fp16", "bwd_sm80_preprocess_bf16",
        "bwd_sm80_convert_dq_bf16", "bwd_sm90_convert_dq_bf16", "bwd_sm90_preprocess_varlen_bf16",
        "bwd_sm90_convert_dq_varlen_bf16", "dec_sm80_combine_bf16"]


def test_ratchet_measures_hopper_backward_kernels_as_hopper_ones(monkeypatch):
    """A Hopper backward kernel is measured under 90a alone, with the Hopper figures (TMA,
    setmaxnreg, EX2 under a running wgmma, wgmma serialization); a helper under 90a too only
    when a Hopper backward kernel of its dtype is pinned (a build holding `bwd_sm90:default`
    beside a policy that pins `bwd_sm80:default` alone measures what it measured before); the Hopper
    dQ conversion under 90a alone, where a Hopper backward kernel of its dtype is pinned."""
    from types import SimpleNamespace

    from fa_tools.analysis import cubins, ptxas_report, sass
    from flash_attention.kernels import HelperKernel, bwd_sm90

    hopper, sm80 = "bwd_sm90_bf16_d128_r64_c128_f", "bwd_sm80_bf16_d128_r64_c128_w8_fh"
    pre, tiles = "bwd_sm80_preprocess_bf16", "bwd_sm90_convert_dq_bf16"

    def rec(kernel, arch, serialized=""):
        return SimpleNamespace(kernel=kernel, arch=arch, registers=168, spill_stores=0,
                               spill_loads=0, stack_frame=0, static_smem=0, dynamic_smem=1024,
                               wgmma_serialized=serialized)

    records = [rec(sm80, "80"), rec(sm80, "90"), rec(hopper, "90a", "C7512"), rec(pre, "80"),
               rec(pre, "90"), rec(pre, "90a"), rec(tiles, "90a")]
    ops = ["HGMMA", "HGMMA", "MUFU.EX2", "WARPGROUP.DEPBAR.LE", "UTMALDG", "UTMASTG",
           "USETMAXREG", "SYNCS.ARRIVE", "EXIT"]
    instrs = [SimpleNamespace(base=o.split(".")[0], opcode=o, operands=" gsb0, 0x0",
                              predicate="") for o in ops]
    monkeypatch.setattr(ptxas_report, "load", lambda log: records)
    monkeypatch.setattr(cubins, "extracted_dir", lambda binary: None)
    monkeypatch.setattr(sass, "instructions", lambda binary, kernel, arch, **kw: instrs)

    got = ratchet.current_metrics([sm80, hopper, pre, tiles], ["80", "90"], "x", "log")
    assert {k: sorted(v) for k, v in got.items()} == {
        sm80: ["80", "90"], hopper: ["90a"], pre: ["80", "90", "90a"], tiles: ["90a"]}
    h = got[hopper]["90a"]
    assert (h["sass_tensor_mma"], h["sass_tma"], h["sass_setmaxnreg"]) == (2, 2, 1)
    assert (h["sass_ex2_overlapped"], h["wgmma_serialized"]) == (1, 1)
    assert "sass_tma" not in got[sm80]["90"]
    got = ratchet.current_metrics([sm80, pre, tiles], ["80", "90"], "x", "log")
    assert sorted(got[pre]) == ["80", "90"] and tiles not in got
    scope = ratchet.scope_kernels({"static": {**POLICY["static"],
                                              "kernels": "fwd:ci,bwd_sm90:default"}})
    assert [k for k in scope if k.startswith("bwd_sm90_") and not HelperKernel.matches(k)] == [
        c.name for c in bwd_sm90.DEFAULT]
    assert {"bwd_sm80_preprocess_fp16", "bwd_sm90_convert_dq_bf16"} <= set(scope)
    assert not {"bwd_sm80_convert_dq_fp16", "bwd_sm80_convert_dq_bf16"} & set(scope)  # sm80's


def test_ratchet_new_and_missing_kernels():
    other = "fwd_sm80_fp16_d64_r64_c32_w4_fqkv"
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


def test_toolchain_change_is_refused_not_compared():
    assert ratchet.check_toolchain({"toolchain": {"nvdisasm": "13.5.37"}},
                                   {"nvdisasm": "13.5.37"}) is None
    msg = ratchet.check_toolchain({"toolchain": {"nvdisasm": "13.5.37"}}, {"nvdisasm": "13.0.88"})
    assert "not comparable" in msg and "13.0.88" in msg and "rebaseline" in msg


# ---- exit codes and report ---------------------------------------------------------------------


def test_overall_precedence():
    assert gate.overall([]) == gate.PASS
    assert gate.overall([0, 0]) == gate.PASS
    assert gate.overall([0, 3]) == gate.INFRA
    assert gate.overall([3, 4]) == gate.INCONCLUSIVE
    assert gate.overall([4, 1]) == gate.REGRESSION
    assert gate.overall([1, 2, 3]) == gate.BROKEN


def _write(out, name, doc, md="x\n"):
    (out / f"{name}.json").write_text(json.dumps(doc))
    (out / f"{name}.md").write_text(md)


def test_report_combines_parts(tmp_path, capsys):
    _write(tmp_path, "static", {"code": 0, "findings": [{"status": "ok"}]})
    rows = [{"verdict": "slower", "case": "c"}, {"verdict": "same", "case": "d"}]
    _write(tmp_path, "perf", {"code": 1, "meta": {}, "results": rows})
    _write(tmp_path, "hostbench", {"code": 0, "summary": "3 benchmarks within 10%"})
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite tests="5" failures="0" errors="0" skipped="1"/></testsuites>')
    assert report.run(tmp_path) == gate.REGRESSION
    md = (tmp_path / "report.md").read_text()
    assert "Gate: FAIL: regression (exit 1)" in md and "1 slower" in md and "5 run" in md
    assert "| hostbench | PASS | 3 benchmarks within 10% |" in md
    assert json.loads((tmp_path / "report.json").read_text())["code"] == 1


def test_report_failed_tests_are_broken_and_nothing_is_infra(tmp_path):
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="0"/></testsuites>')
    _write(tmp_path, "perf", {"code": 1, "meta": {}, "results": [{"verdict": "slower"}]})
    assert report.run(tmp_path) == gate.BROKEN
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.run(empty) == gate.INFRA


def test_report_broken_steps_and_inconclusive(tmp_path):
    _write(tmp_path, "tests", {"code": 2, "error": "the test run passed its 2400 s limit"})
    (tmp_path / "tests.xml").write_text(  # a partial file of the killed run must not count
        '<testsuites><testsuite tests="5" failures="0" errors="0" skipped="0"/></testsuites>')
    assert report.run(tmp_path) == gate.BROKEN
    assert "2400 s limit" in (tmp_path / "report.md").read_text()
    other = tmp_path / "other"
    other.mkdir()
    _write(other, "perf", {"code": 4, "meta": {}, "results": [{"verdict": "inconclusive"}]})
    assert report.run(other) == gate.INCONCLUSIVE


def test_perf_without_gpu_is_infra(tmp_path, monkeypatch):
    import argparse

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = argparse.Namespace(rounds=None, max_rounds=None, aa=True, base=None, base_dir=None,
                              rebuild=False, kernels="ci", archs=None)
    policy = ratchet.load_yaml(POLICY_FILE)
    assert perf.run(args, policy, tmp_path) == gate.INFRA
    assert "no CUDA GPU" in (tmp_path / "perf.md").read_text()


def test_gate_command_from_another_directory_reads_the_repositorys_policy(tmp_path):
    """`fa-tools gate perf` run from outside the checkout (with no GPU visible) reads
    ci/gate_policy.yaml and ci/perf_accept.yaml of the repository the tools belong to, and
    gets as far as the GPU check: exit 3 for no GPU, not a crash for a policy not found."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "fa_tools", "gate", "perf", "--aa", "--out",
                           str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=False, timeout=300)
    assert proc.returncode == gate.INFRA, proc.stderr
    assert "no CUDA GPU" in (out / "perf.md").read_text()


def test_repo_files_resolve_from_the_tools_checkout_else_the_git_one(tmp_path, monkeypatch):
    """Policy files come from the checkout holding fa_tools whatever the current directory; a
    copy of the tools outside any checkout (site-packages) uses the git checkout of the current
    directory; with neither, the error names the file and where it looked."""
    monkeypatch.chdir(tmp_path)
    assert paths.repo_file("ci/gate_policy.yaml") == POLICY_FILE
    assert paths.repo_file("ci/none.yaml", must_exist=False) == ROOT / "ci" / "none.yaml"
    with pytest.raises(paths.RepoFileError, match=r"ci/none\.yaml not found: no /"):
        paths.repo_file("ci/none.yaml")

    monkeypatch.setattr(paths, "CHECKOUT", tmp_path / "site-packages")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # git looks no higher
    with pytest.raises(paths.RepoFileError) as info:
        paths.repo_file("ci/gate_policy.yaml")
    assert all(part in str(info.value) for part in
               ("ci/gate_policy.yaml", str(tmp_path / "site-packages"), str(tmp_path)))

    if shutil.which("git") is None:
        pytest.skip("no git: the fallback to the git checkout is not tested")
    repo = tmp_path / "repo"
    (repo / "ci").mkdir(parents=True)
    (repo / "ci" / "gate_policy.yaml").write_text("tests: {}\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    monkeypatch.chdir(repo / "ci")
    assert paths.repo_file("ci/gate_policy.yaml").resolve() == (
        repo / "ci" / "gate_policy.yaml").resolve()


def test_broken_head_worker_is_exit_2(tmp_path):
    """A head whose flash_attention cannot even be imported is 'broken', never 'slower'."""
    src = tmp_path / "src" / "flash_attention"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("raise ImportError('planted: the head does not import')\n")
    with pytest.raises(abtest.WorkerError) as info:
        abtest.Worker("head", tmp_path / "src")
    assert info.value.kind == "broken" and "planted" in str(info.value)


def test_power_study_tables(tmp_path, monkeypatch):
    """calibrate on simulated workers: a large planted slowdown is always caught, none is
    planted on the A/A runs, and the tables are written."""
    import argparse
    import contextlib

    from fa_tools.gate import calibrate

    @contextlib.contextmanager
    def fake_workers(args, perf_policy, meta):
        meta["gpu"] = "simulated"
        yield FakeWorker({}, {}, 1), FakeWorker({}, {}, 2)

    monkeypatch.setattr(calibrate, "workers", fake_workers)
    case = CASE_1024
    args = argparse.Namespace(case=[case], sizes=[0.5, 10], runs=2, aa_runs=2)
    policy = ratchet.load_yaml(POLICY_FILE)
    assert calibrate.run(args, policy, tmp_path) == gate.PASS
    doc = json.loads((tmp_path / "calibrate.json").read_text())
    big = next(r for r in doc["power"] if r["planted"] == "10%")
    assert big["slower"] == 2 and big["detection_rate"] == 1.0
    assert doc["aa"]["runs"] == 2 and doc["aa"]["runs_with_slower"] == 0
    md = (tmp_path / "calibrate.md").read_text()
    assert "| planted slowdown |" in md and "A/A: 2 whole gate runs" in md


def test_power_study_flags_a_plant_that_did_not_take_effect(tmp_path, monkeypatch):
    """A head whose planted slowdown does not show in the timings (as a device-side spin after
    each call did on an H100, see perfcases.planted_attention) is marked 'not realised'."""
    import argparse
    import contextlib

    from fa_tools.gate import calibrate

    class DeafWorker(FakeWorker):
        def measure(self, case, reps, timeout_s, slowdown=0.0, warm_ms=0.0):
            return super().measure(case, reps, timeout_s, 0.0, warm_ms)

    @contextlib.contextmanager
    def fake_workers(args, perf_policy, meta):
        meta["gpu"] = "simulated"
        yield FakeWorker({}, {}, 1), DeafWorker({}, {}, 2)

    monkeypatch.setattr(calibrate, "workers", fake_workers)
    args = argparse.Namespace(case=[CASE_1024], sizes=[5], runs=2, aa_runs=0)
    calibrate.run(args, ratchet.load_yaml(POLICY_FILE), tmp_path)
    (row,) = json.loads((tmp_path / "calibrate.json").read_text())["power"]
    assert row["realised"] is False and row["slower"] == 0
    assert "| 5% (not realised) | +51 of 1024 keys: 4.98% |" in (tmp_path / "calibrate.md"
                                                                  ).read_text()


def test_planted_work_is_keys_added_to_every_sequence():
    from fa_tools.gpu.perfcases import planted_keys

    short, long = Case("bf16", 128, 16, 1024), Case("bf16", 128, 4, 16384)
    assert [planted_keys(long, f) for f in (0.015, 0.02, 0.03, 0.05, 0.1)] == [
        246, 328, 492, 819, 1638]
    assert [planted_keys(short, f) for f in (0.0001, 0.03)] == [1, 31]


def test_a_case_the_base_cannot_run_is_new_not_broken():
    """A pull request that adds a feature adds its gate case too; the base (the merge-base)
    answers that case with an error: the case is reported as new, the rest compared as usual."""

    class OldBase(FakeWorker):
        def measure(self, case, reps, timeout_s, slowdown=0.0, warm_ms=0.0):
            if case.causal:
                raise abtest.WorkerError("base, case x: TypeError: unexpected keyword "
                                         "argument 'causal'", "infra")
            return super().measure(case, reps, timeout_s, slowdown)

        def alive(self):
            return True

    cases = [CASES[0], Case("bf16", 128, 16, 4096, causal=True)]
    results = {r.case: r for r in abtest.compare(OldBase({}, {}, 1), FakeWorker({}, {}, 2),
                                                 cases, POL, 7)}
    new = results["bf16_d128_b16_s4096_causal"]
    assert new.verdict == "new" and "causal" in new.note and new.rounds == 0
    assert results[CASES[0].name].verdict == "same"
    assert perf.verdict_code(list(results.values())) == gate.PASS
    md = perf.markdown([r.as_dict() for r in results.values()], 0,
                       {"base_label": "b", "head_label": "h", "rounds": 12, "step": 12,
                        "max_rounds": 48, "fwer": 0.01, "alpha_per_look": 1e-4,
                        "threshold_pct": 1.5, "clear_pct": 3.0})
    assert "**new**: the base cannot run it" in md


def test_a_base_that_dies_is_still_infrastructure():
    class DeadBase(FakeWorker):
        def measure(self, case, reps, timeout_s, slowdown=0.0, warm_ms=0.0):
            raise abtest.WorkerError("base: case x did not finish within 60 s", "infra")

        def alive(self):
            return False

    with pytest.raises(abtest.WorkerError, match="did not finish"):
        abtest.compare(DeadBase({}, {}, 1), FakeWorker({}, {}, 2), CASES[:1], POL, 7)


def test_ratchet_spill_exception_allows_its_bytes_only():
    policy = {"static": {**POLICY["static"], "spill_exceptions": {K: {"bytes": 8, "reason": "x"}}}}
    pinned = {"kernels": _metrics(spill_bytes=8)}
    assert not [f for f in ratchet.compare(pinned, _metrics(spill_bytes=8), policy)
                if f.status == "worse"]
    (f,) = [f for f in ratchet.compare(pinned, _metrics(spill_bytes=16), policy)
            if f.status == "worse" and "exception" in f.rule]
    assert f.metric == "spill_bytes" and "at most 8" in f.rule


def test_verdict_compares_cycles_and_reports_times_beside():
    """A head whose calls took 8% longer only because the clock was lower (same cycles) is
    'same' under metric cycles, with the time ratio reported; under metric time it is slower."""

    class SlowClock(FakeWorker):
        def measure(self, case, reps, timeout_s, slowdown=0.0, warm_ms=0.0):
            res = super().measure(case, reps, timeout_s, slowdown, warm_ms)
            return {**res, "ours": res["ours_mcycles"] / 1.5 * 1.08}

    class Steady(FakeWorker):
        def measure(self, case, reps, timeout_s, slowdown=0.0, warm_ms=0.0):
            res = super().measure(case, reps, timeout_s, slowdown, warm_ms)
            return {**res, "ours": res["ours_mcycles"] / 1.5}

    c = CASES[0]
    (r,) = abtest.compare(Steady({}, {}, 1), SlowClock({}, {}, 2), [c], POL, 7)
    assert r.verdict == "same" and abs(r.time_ratio - 1.08) < 0.01
    timed = abtest.Policy(metric="time")
    (r,) = abtest.compare(Steady({}, {}, 1), SlowClock({}, {}, 2), [c], timed, 7)
    assert r.verdict == "slower"
    with pytest.raises(ValueError, match="warm_ms"):
        abtest.Policy.from_dict({"metric": "cycles", "warm_ms": 0})
    with pytest.raises(ValueError, match="metric"):
        abtest.Policy.from_dict({"metric": "watts"})


def test_policy_first_look_can_reach_the_per_look_alpha():
    """With n rounds the smallest one-sided signed-rank p is 2^-n: adding gate cases (or looks)
    without more first rounds would make the first look unable to convict anything. The family
    is the gate's cases and as many SASS-chosen extras as the policy allows."""
    policy = abtest.Policy.from_dict(
        {k: v for k, v in ratchet.load_yaml(POLICY_FILE)["perf"].items()
         if k != "build_timeout_s"})
    n = len(perf.GATE_CASES) + policy.sass_extra_cases
    assert 0.5 ** policy.rounds < policy.alpha_per_look(n)


def test_clock_stamp_cycles_are_per_sm_deltas():
    """Per SM seen in both stamps: end minus start (SM counters are not aligned with each
    other); blocks on an SM seen once are ignored; the window is their median."""
    import torch

    from fa_tools.gpu.clockstamp import Stamps

    stamps = object.__new__(Stamps)
    stamps._marks, stamps._deltas = 2, None
    start = [[0, 1_000, 0], [1, 5_000_000, 0], [2, 70, 0]]
    end = [[0, 3_001_000, 2_000_000], [1, 8_000_000, 2_000_000], [3, 9, 9]]
    stamps._buf = torch.tensor([start, end], dtype=torch.int64)
    assert stamps.cycles() == 3_000_000
    assert stamps.mhz() == 1500.0
    stamps._buf = torch.tensor([start, [[5, 1, 1]] * 3], dtype=torch.int64)
    stamps._deltas = None  # a new window
    with pytest.raises(RuntimeError, match="no SM"):
        stamps.cycles()


def test_a_base_that_can_run_no_case_is_infrastructure_not_a_pass(tmp_path, monkeypatch):
    """Every case 'new' means nothing was compared (a measuring failure on the base's side
    would look like that): infrastructure, never a pass."""
    import argparse
    import contextlib

    class NoCase(FakeWorker):
        def measure(self, case, reps, timeout_s, slowdown=0.0, warm_ms=0.0):
            raise abtest.WorkerError("base, case x: RuntimeError: no clock", "infra")

        def alive(self):
            return True

    @contextlib.contextmanager
    def fake_workers(args, perf_policy, meta):
        meta.update(gpu="simulated", base_label="b", head_label="h")
        yield NoCase({}, {}, 1), FakeWorker({}, {}, 2)

    monkeypatch.setattr(perf, "workers", fake_workers)
    args = argparse.Namespace(rounds=None, max_rounds=None)
    assert perf.run(args, ratchet.load_yaml(POLICY_FILE), tmp_path) == gate.INFRA
    assert "could run none of the gate's cases" in (tmp_path / "perf.md").read_text()


def test_power_study_merge(tmp_path, monkeypatch):
    """Studies made in several pieces (device calls of limited length) merge into the tables one
    long study would give: power rows per planted size, A/A runs renumbered and counted
    together; studies of different policies refuse to merge."""
    import argparse
    import contextlib

    from fa_tools.gate import calibrate

    @contextlib.contextmanager
    def fake_workers(args, perf_policy, meta):
        meta["gpu"] = "simulated"
        yield FakeWorker({}, {}, 1), FakeWorker({}, {}, 2)

    monkeypatch.setattr(calibrate, "workers", fake_workers)
    policy = ratchet.load_yaml(POLICY_FILE)
    case = CASE_1024
    parts = []
    for i, (sizes, aa) in enumerate([([10], 1), ([10, 5], 2)]):
        args = argparse.Namespace(case=[case], sizes=sizes, runs=2, aa_runs=aa)
        calibrate.run(args, policy, tmp_path / f"p{i}")
        parts.append(tmp_path / f"p{i}" / "calibrate.json")
    assert calibrate.merge(parts, tmp_path / "all") == gate.PASS
    doc = json.loads((tmp_path / "all" / "calibrate.json").read_text())
    rows = {r["planted"]: r for r in doc["power"]}
    assert rows["10%"]["runs"] == 4 and rows["5%"]["runs"] == 2
    assert doc["aa"]["runs"] == 3 and doc["aa"]["cases"] == len(perf.GATE_CASES)
    assert sorted({r["aa_run"] for r in doc["runs"] if "aa_run" in r}) == [1, 2, 3]
    assert "A/A: 3 whole gate runs" in (tmp_path / "all" / "calibrate.md").read_text()
    other = json.loads(parts[1].read_text())
    other["meta"]["metric"] = "time"
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="metric"):
        calibrate.merge([parts[0], tmp_path / "other.json"], tmp_path / "bad")


def test_window_vs_full_ratio_and_report():
    from fa_tools.gpu.perfcases import RoundTiming as T
    from fa_tools.gpu.perfcases import WindowVsFull

    r = WindowVsFull("w", 0.25, [T(8.0, 16.0, 1500.0), T(10.0, 16.0, 1600.0)],
                     {"a": [T(2.4, 4.4, 1400.0), T(2.5, 4.8, 1450.0)],
                      "b": [T(2.0, 4.0, 1500.0), T(3.0, 4.0, 1500.0)]})
    assert r.ratios("a") == pytest.approx([1.2, 1.0])
    assert r.ratios("b") == pytest.approx([1.0, 1.2])
    assert r.ratios("a", cycles=True) == pytest.approx([1.1, 1.2])
    lines = r.lines()
    assert len(lines) == 3 and "full 9.000 [8.000, 10.000] ms at 1550 [1500, 1600] MHz" in lines[0]
    assert "window 2.450 [2.400, 2.500] ms at 1425 [1400, 1450] MHz" in lines[1]
    assert lines[1].endswith(
        "window/(fraction*full) = 1.100 [1.000, 1.200], in SM cycles 1.150 [1.100, 1.200]")


# ---- cases of every kind, peerless cases, energy ----------------------------------------------


def test_case_travels_as_json_and_old_requests_still_read():
    c = Case("bf16", 128, 8, 1024, window=(512, 0), softcap=30.0, kv_heads=4, seqlen_k=8192)
    back = Case(**json.loads(json.dumps(c.as_dict())))
    assert back == c and hash(back) == hash(c) and back.window == (512, 0)
    assert c.name == "bf16_d128_b8_s1024_sk8192_kv4_w512_0_cap30"
    old = {"dtype": "bf16", "d_head": 128, "batch": 16, "seqlen": 4096, "heads": 16,
           "causal": True, "varlen": False}  # a request from before the new fields
    assert Case(**old).name == "bf16_d128_b16_s4096_causal"
    assert Case(**old).options() == {"causal": True}, "only what differs from the defaults"
    assert c.options() == {"window_size": (512, 0), "softcap": 30.0}
    assert Case("bf16", 64, 1, 128, window=(-1, 0)).name == "bf16_d64_b1_s128_winf_0"
    with pytest.raises(ValueError, match="multiple"):
        Case("bf16", 128, 1, 128, heads=16, kv_heads=5)
    with pytest.raises(ValueError, match="varlen"):
        Case("bf16", 128, 4, 1024, varlen=True, kv_heads=4)
    assert Case(**old).kind == "fwd", "a request from before the kinds times the forward"


def test_backward_cases_name_their_kind_and_travel_as_json():
    bwd = Case("bf16", 128, 4, 4096, causal=True, kv_heads=4, deterministic=True, kind="bwd")
    assert Case(**json.loads(json.dumps(bwd.as_dict()))) == bwd
    assert bwd.name == "bf16_d128_b4_s4096_kv4_causal_det_bwd"
    assert bwd.options() == {"causal": True, "deterministic": True}
    step = Case("bf16", 128, 4, 4096, causal=True, kind="fwdbwd")
    assert step.name == "bf16_d128_b4_s4096_causal_fwdbwd"
    assert (step.times_forward, step.times_backward) == (True, True)
    assert (bwd.times_forward, bwd.times_backward) == (False, True)
    assert "deterministic" in bwd.peer_note() and not step.peer_note()
    for bad, why in (({"kind": "backward"}, "kind"), ({"deterministic": True}, "deterministic"),
                     ({"varlen": True, "kind": "fwdbwd"}, "training step is fixed-length"),
                     ({"varlen": True, "kind": "bwd", "kv_heads": 4}, "all K/V heads")):
        with pytest.raises(ValueError, match=why):
            Case("bf16", 128, 4, 1024, **bad)


def test_a_varlen_backward_case_counts_its_sequences():
    """A varlen bwd case: named as one, 2.5 forwards of FLOPs summed over its sequences (less
    than the padded batch's), SDPA its peer (on the padded batch) but under a softcap, and
    deterministic dQ an option of it as of a fixed-length one."""
    from fa_tools.gpu.perfcases import varlen_lengths

    case = Case("fp16", 64, 4, 4096, varlen=True, kind="bwd")
    assert case.name == "fp16_d64_b4_s4096_varlen_bwd"
    assert Case(**json.loads(json.dumps(case.as_dict()))) == case
    assert (case.times_forward, case.times_backward) == (False, True)
    lengths = varlen_lengths(case)
    assert len(lengths) == 4 and max(lengths) == 4096 and sum(lengths) < 4 * 4096
    assert case.flops() == 2.5 * 4 * 16 * 64 * sum(n * n for n in lengths)
    assert case.flops() < Case("fp16", 64, 4, 4096, kind="bwd").flops()
    causal = Case("bf16", 128, 4, 4096, causal=True, varlen=True, kind="bwd")
    assert causal.flops() == 2.5 * Case("bf16", 128, 4, 4096, causal=True, varlen=True).flops()
    assert causal.flops() == 2.5 * 4 * 16 * 128 * sum(n * n for n in lengths) / 2
    assert not case.peer_note() and not causal.peer_note()
    capped = Case("bf16", 128, 4, 4096, softcap=30.0, varlen=True, kind="bwd")
    assert capped.name == "bf16_d128_b4_s4096_cap30_varlen_bwd" and "softcap" in capped.peer_note()
    det = Case("bf16", 128, 4, 4096, causal=True, varlen=True, deterministic=True, kind="bwd")
    assert det.name == "bf16_d128_b4_s4096_causal_varlen_det_bwd"
    assert det.options() == {"causal": True, "deterministic": True}


def test_a_varlen_backward_case_calls_the_operator_on_packed_inputs(monkeypatch):
    """Inputs and callables of a varlen bwd case, made on the CPU with the operator faked:
    q, k, v and dout packed from the rows the peers get padded, cu_seqlens the running sums of
    the lengths; ours calls flash_attention::bwd with attention_varlen's out and LSE, those
    cu_seqlens and the longest length; the SDPA peer differentiates the padded batch with the
    padded dout."""
    import itertools
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    import flash_attention as fa
    from fa_tools.gpu import perfcases

    case = Case("bf16", 32, 3, 128, heads=2, causal=True, varlen=True, kind="bwd")
    inputs = perfcases.Inputs.make(case, device="cpu")
    lengths = perfcases.varlen_lengths(case)
    cu, max_len, (qp, kp, vp) = inputs.varlen
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *itertools.accumulate(lengths)]
    assert max_len == 128 and len(set(lengths)) > 1, "sequences of different lengths"
    pairs = ((inputs.q, qp), (inputs.k, kp), (inputs.v, vp), (inputs.dout, inputs.dout_padded))
    for packed, padded in pairs:
        assert packed.shape == (sum(lengths), 2, 32) and padded.shape == (3, 128, 2, 32)
        for b, n in enumerate(lengths):
            assert torch.equal(packed[cu[b]:cu[b + 1]], padded[b, :n])

    calls = []

    def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **opts):
        calls.append((q, k, v, cu_q, cu_k, max_q, max_k, opts))
        return "out", "lse"

    def bwd(*args):
        calls.append(args)
        return "dq", "dk", "dv"

    monkeypatch.setattr(fa, "attention_varlen", attention_varlen)
    monkeypatch.setattr(torch.ops.flash_attention, "bwd", SimpleNamespace(default=bwd),
                        raising=False)
    fns = perfcases.training_contenders(case, inputs, ("ours", "sdpa_fa2"))
    assert fns["ours"]() == ("dq", "dk", "dv")
    (*fwd_tensors, fwd_cu_q, fwd_cu_k, fwd_max_q, fwd_max_k, opts), args = calls
    assert all(a is b for a, b in zip(fwd_tensors, (inputs.q, inputs.k, inputs.v)))
    assert fwd_cu_q is cu and fwd_cu_k is cu and (fwd_max_q, fwd_max_k) == (128, 128)
    assert opts == {"causal": True, "return_lse": True}
    tensors = (inputs.dout, inputs.q, inputs.k, inputs.v)
    assert len(args) == 18 and all(a is b for a, b in zip(args[:4], tensors))
    assert args[4:7] == ("out", "lse", None) and args[7] is cu and args[8] is cu
    assert args[9:] == (128, 128, None, True, -1, -1, 0.0, False, "")

    # the peer (SDPA's CPU flash kernel here): the padded batch's gradients
    assert set(fns) == {"ours", "sdpa_fa2"}
    leaves = [t.transpose(1, 2).float().requires_grad_() for t in (qp, kp, vp)]
    ref = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, is_causal=True), leaves,
                              inputs.dout_padded.transpose(1, 2).float())
    for got, want in zip(fns["sdpa_fa2"](), ref):
        assert got.shape == (3, 2, 128, 32)
        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2


def test_backward_flops_are_two_and_a_half_forwards():
    """FlashAttention's convention: a backward counts 2.5 forwards, a training step 3.5, each
    on the forward's count (visible pairs under a window)."""
    for features in ({}, {"causal": True}, {"window": (512, 0)}):
        fwd = Case("bf16", 128, 4, 4096, **features).flops()
        assert Case("bf16", 128, 4, 4096, kind="bwd", **features).flops() == 2.5 * fwd
        assert Case("bf16", 128, 4, 4096, kind="fwdbwd", **features).flops() == 3.5 * fwd
    assert Case("bf16", 128, 4, 4096).flops() == 4 * 4 * 16 * 4096 * 4096 * 128


def test_planted_work_is_for_forward_cases_only():
    from fa_tools.gpu.perfcases import planted_attention

    with pytest.raises(ValueError, match="forward cases"):
        planted_attention(Case("bf16", 128, 4, 4096, kind="bwd"), None, 0.05)


def test_gate_case_names_are_unique_and_sdpa_less_cases_say_why():
    names = [c.name for c in perf.GATE_CASES]
    assert len(names) == len(set(names))
    for c in perf.GATE_CASES:
        assert bool(c.peer_note()) == bool(c.window or c.softcap or c.deterministic)


class NoPeer(FakeWorker):
    """A worker's reply for a case SDPA cannot run: no peer keys; energy per call reported."""

    def measure(self, case, reps, timeout_s, slowdown=0.0, warm_ms=0.0):
        res = super().measure(case, reps, timeout_s, slowdown, warm_ms)
        res = {k: v for k, v in res.items() if not k.startswith("sdpa_fa2")}
        return {**res, "ours_mj": 400.0 * res["ours_mcycles"]}


def test_a_case_without_peer_is_judged_on_the_raw_ratio_alone():
    window = Case("bf16", 128, 8, 8192, window=(1024, 1024))
    slow, same = (abtest.compare(NoPeer({}, {}, 1), NoPeer(f, {}, 2), [window], POL, 7)[0]
                  for f in ({window.name: 1.05}, {}))
    assert slow.verdict == "slower" and same.verdict == "same"
    assert math.isnan(slow.norm_ratio) and slow.peer_note == "SDPA has no sliding window"
    assert slow.mj_ratio == pytest.approx(1.05, rel=0.01) and slow.head_mj > slow.base_mj
    md = perf.markdown([slow.as_dict()], 1, {"base_label": "b", "head_label": "h",
                                             "rounds": 14, "step": 12, "max_rounds": 48,
                                             "fwer": 0.01, "alpha_per_look": 1e-4,
                                             "threshold_pct": 1.5, "clear_pct": 3.0})
    assert "n/a: SDPA has no sliding window" in md


def test_energy_window_and_summary():
    from fa_tools.gpu import energy

    reads = iter([1000, 1900])
    win = energy.Window(energy.Counter(lambda: next(reads), "fake"))
    win.start()
    win.stop(calls=9)
    assert win.per_call == 100.0
    broken = energy.Window(energy.Counter(lambda: 1 / 0, "fake"))
    broken.start()
    broken.stop(calls=9)
    assert broken.per_call is None, "a failed read is no data, not an exception"
    assert energy.Window(None).per_call is None
    # the counter polled: it changed at 20 ms steps by 5 mJ or more
    samples = [(t / 1000, 1000 + 5 * (t // 20) + (t >= 60)) for t in range(0, 101)]
    g = energy.summarise(samples, "fake")
    assert g.changes == 5 and g.step_mj_min == 5 and g.interval_ms_median == pytest.approx(20)
    assert "updates every 20.0 ms" in g.describe()
    assert energy.granularity(None, "no NVML").describe() == "n/a (no NVML)"
    b, h, r = abtest.energy_summary([10.0, None, 10.0], [11.0, 11.0, None])
    assert (b, h) == (10.0, 11.0) and r == pytest.approx(1.1)
    assert all(math.isnan(x) for x in abtest.energy_summary([None], [None]))


def test_no_nvml_is_reported_not_faked(monkeypatch):
    from fa_tools.gpu import energy

    def missing(uuid):
        raise ImportError("no module named pynvml")

    def unsupported(uuid):
        raise energy.EnergyUnavailable("NVML nvmlDeviceGetTotalEnergyConsumption failed with "
                                       "error 3")

    monkeypatch.setattr(energy, "_pynvml_counter", missing)
    monkeypatch.setattr(energy, "_ctypes_counter", unsupported)
    monkeypatch.setattr(energy, "_device_uuid", lambda: None)
    counter, why = energy.open_counter()
    assert counter is None and "pynvml: not installed" in why and "error 3" in why


# ---- accepted regressions and the gate run with its additions ---------------------------------


def _run_gate(tmp_path, monkeypatch, base, head, accept_text=None, cases=CASES[:2], arch="",
              kinds=None):
    """perf.run on simulated workers over `cases`, with an accept file of accept_text, on a GPU
    of `arch` ("90": an H100; "": not known, no SASS diff)."""
    import argparse
    import contextlib

    @contextlib.contextmanager
    def fake_workers(args, perf_policy, meta):
        meta.update(gpu="simulated", base_label="b", head_label="h", arch=arch)
        yield base, head

    monkeypatch.setattr(perf, "workers", fake_workers)
    monkeypatch.setattr(perf, "GATE_CASES", tuple(cases))
    doc = ratchet.load_yaml(POLICY_FILE)
    accept_path = tmp_path / "perf_accept.yaml"
    if accept_text is not None:
        accept_path.write_text(accept_text)
    doc["perf"] = {**doc["perf"], "accept_file": str(accept_path)}
    out = tmp_path / "out"
    code = perf.run(argparse.Namespace(rounds=None, max_rounds=None, kinds=kinds), doc, out)
    return code, json.loads((out / "perf.json").read_text()), (out / "perf.md").read_text()


ACCEPT = """accept:
  - case: bf16_d128_b16_s1024
    max_slowdown_pct: {pct}
    reason: "planted: the new mask path costs 5% here, measured on an H100"
    date: 2026-11-24
"""


def test_accepted_slowdown_within_its_bound_passes_with_the_reason(tmp_path, monkeypatch):
    slow = CASES[0].name
    code, doc, md = _run_gate(tmp_path, monkeypatch, FakeWorker({}, {}, 1),
                              FakeWorker({slow: 1.05}, {}, 2), ACCEPT.format(pct=6))
    assert code == gate.PASS
    (r,) = [r for r in doc["results"] if r["case"] == slow]
    assert r["verdict"] == "accepted" and "costs 5% here" in r["accepted"]
    assert ("**accepted**: planted: the new mask path costs 5% here, measured on an H100 "
            "(accepted up to +6%, 2026-11-24)") in md


def test_slowdown_beyond_the_accepted_bound_still_fails(tmp_path, monkeypatch):
    slow = CASES[0].name
    code, _, md = _run_gate(tmp_path, monkeypatch, FakeWorker({}, {}, 1),
                              FakeWorker({slow: 1.05}, {}, 2), ACCEPT.format(pct=3))
    assert code == gate.REGRESSION
    assert "**slower** (beyond the accepted +3% (planted" in md


def test_accept_entry_naming_no_case_is_a_broken_configuration(tmp_path, monkeypatch):
    text = ACCEPT.format(pct=3).replace("bf16_d128_b16_s1024", "bf16_d128_b16_s1025")
    code, doc, md = _run_gate(tmp_path, monkeypatch, FakeWorker({}, {}, 1),
                              FakeWorker({}, {}, 2), text)
    assert code == gate.BROKEN and "results" not in doc
    assert "broken configuration" in md and "bf16_d128_b16_s1025, which is not a case" in md
    for bad, why in ((ACCEPT.format(pct=0), "max_slowdown_pct"),
                     (ACCEPT.format(pct=3).replace("    reason:", "    why:"), "missing reason"),
                     (ACCEPT.format(pct=3) + ACCEPT.format(pct=4)[8:], "accepted twice")):
        code, _, md = _run_gate(tmp_path, monkeypatch, FakeWorker({}, {}, 1),
                                FakeWorker({}, {}, 2), bad)
        assert code == gate.BROKEN and why in md, why


def test_unused_accept_entry_is_reported_for_removal(tmp_path, monkeypatch):
    code, doc, md = _run_gate(tmp_path, monkeypatch, FakeWorker({}, {}, 1),
                              FakeWorker({}, {}, 2), ACCEPT.format(pct=3))
    assert code == gate.PASS
    assert doc["meta"]["accept_unused"] == [{"case": CASES[0].name, "verdict": "same"}]
    assert "Accept entry for bf16_d128_b16_s1024 unused (verdict same): remove it" in md


def test_gate_run_adds_and_reports_the_cases_of_changed_kernels(tmp_path, monkeypatch):
    """Two builds whose SASS differs in one kernel no gate case runs: the gate measures a case
    for it (counted in the alpha split), and says which and why."""
    from fa_tools.gate import sassdiff
    from flash_attention.kernels import resolve

    monkeypatch.setenv("FLASH_ATTENTION_TUNING_FILE", str(tmp_path / "none.json"))
    monkeypatch.setattr("flash_attention.dispatch._tuning", None)
    default = [c.name for c in resolve("fwd:default")]
    code = {k: [b"\0" * 16] * 10 for k in default}
    changed = dict(code, **{"fwd_sm90_fp16_d64_r192_c96_s3_fwaln": [b"\1" * 16] * 3
                            + [b"\0" * 16] * 7})
    base, head = FakeWorker({}, {}, 1), FakeWorker({}, {}, 2)
    base.src_dir, head.src_dir = "base", "head"
    base.configs = head.configs = default
    monkeypatch.setattr(perf, "_binary", lambda src: src)
    monkeypatch.setattr(sassdiff, "kernel_code",
                        lambda binary, arch: code if binary == "base" else changed)
    _, doc, _ = _run_gate(tmp_path, monkeypatch, base, head)
    assert doc["meta"]["sass"]["note"] == "no GPU architecture known", "nothing to compare"

    verdict, doc, md = _run_gate(tmp_path, monkeypatch, base, head, arch="90")
    assert verdict == gate.PASS
    (extra,) = [r for r in doc["results"] if r["why"]]
    assert extra["case"] == "fp16_d64_b16_s4096"
    assert extra["kernel"] == "fwd_sm90_fp16_d64_r192_c96_s3_fwaln", (
        "the kernel dispatch runs for it")
    assert "SASS differs (3 instructions changed: +3 -3 of 10)" in extra["why"]
    assert doc["meta"]["cases"] == len(CASES[:2]) + 1
    assert doc["meta"]["alpha_per_look"] == pytest.approx(0.01 / (3 * 4))
    assert "Added case fp16_d64_b16_s4096: kernel fwd_sm90_fp16_d64_r192_c96_s3_fwaln: SASS" in md


BWD = Case("bf16", 128, 4, 4096, causal=True, kind="bwd")
STEP = Case("bf16", 128, 4, 4096, causal=True, kv_heads=4, kind="fwdbwd")


def _default_build(tmp_path, monkeypatch, *workers):
    """Workers of a `default` build (forward and backward), dispatch without a tuning file."""
    from flash_attention.kernels import resolve

    monkeypatch.setenv("FLASH_ATTENTION_TUNING_FILE", str(tmp_path / "none.json"))
    monkeypatch.setattr("flash_attention.dispatch._tuning", None)
    for w in workers:
        w.configs = [c.name for c in resolve("fwd:default")]
        w.bwd_configs = [c.name for c in resolve("bwd:default")]


# 4 sequences (32 tiles, below the deep kernel's band): the 4-warp kernel, split, and the combine
DECODE = Case("bf16", 128, 4, 1, heads=32, kv_heads=8, seqlen_k=8192, page_size=16,
              kind="decode")


def test_a_slower_decode_step_fails_the_gate_and_kinds_selects_the_cases(tmp_path, monkeypatch):
    """A decode step 4% slower in the head: exit 1 naming it, its row saying the decode kernel
    and the combine it runs; with --kinds decode only the decode steps run, and the report says
    the run was a subset."""
    base, head = FakeWorker({}, {}, 1), FakeWorker({DECODE.name: 1.04}, {}, 2)
    _default_build(tmp_path, monkeypatch, base, head)
    code, doc, md = _run_gate(tmp_path, monkeypatch, base, head, cases=[CASES[1], BWD, DECODE],
                              arch="90", kinds=("decode",))
    assert code == gate.REGRESSION
    assert {r["case"]: r["verdict"] for r in doc["results"]} == {DECODE.name: "slower"}
    assert doc["results"][0]["kernel"] == ("dec_sm80_bf16_d128_r16_c16_w4_f + "
                                           "dec_sm80_combine_bf16")
    assert doc["meta"]["kinds"] == ["decode"] and "Only the cases of kind decode" in md
    from fa_tools.gate.cli import _kinds

    assert _kinds("fwd, decode") == ("fwd", "decode")
    with pytest.raises(argparse.ArgumentTypeError, match="kinds must be"):
        _kinds("prefill")


FP8 = Case("e4m3", 128, 16, 4096, causal=True)


def test_a_slower_fp8_forward_fails_the_gate_and_is_left_out_off_sm90(tmp_path, monkeypatch):
    """An FP8 forward case 4% slower in the head: exit 1 naming it and its e4m3 kernel; --kinds
    fp8 runs the FP8 cases alone (fwd leaves them out); on a GPU other than sm_90 the gate
    leaves them out and its notes say which and why."""
    base, head = FakeWorker({}, {}, 1), FakeWorker({FP8.name: 1.04}, {}, 2)
    _default_build(tmp_path, monkeypatch, base, head)
    code, doc, md = _run_gate(tmp_path, monkeypatch, base, head, cases=[CASES[1], FP8],
                              arch="90", kinds=("fp8",))
    assert code == gate.REGRESSION
    assert {r["case"]: r["verdict"] for r in doc["results"]} == {FP8.name: "slower"}
    assert doc["results"][0]["kernel"] == "fwd_sm90_e4m3_d128_r128_c192_s2_fwpiaum"
    code, doc, _ = _run_gate(tmp_path, monkeypatch, base, head, cases=[CASES[1], FP8], arch="90",
                             kinds=("fwd",))
    assert {r["case"] for r in doc["results"]} == {CASES[1].name}
    code, doc, md = _run_gate(tmp_path, monkeypatch, base, head, cases=[CASES[1], FP8],
                              arch="80")
    assert code == gate.PASS and {r["case"] for r in doc["results"]} == {CASES[1].name}
    assert doc["meta"]["not_run"]["cases"] == [FP8.name]
    assert f"Not run here (FP8 forward cases need sm_90 (this GPU: sm_80)): {FP8.name}" in md
    from fa_tools.gate.cli import _kinds

    assert _kinds("fp8") == ("fp8",)


def test_a_slower_backward_fails_the_gate_naming_the_case(tmp_path, monkeypatch):
    """A backward case whose head is 4% slower: exit 1, the case named slower in the table and
    the summary; the forward and the training-step cases beside it stay same; each row says
    which kernels the head runs for it."""
    base, head = FakeWorker({}, {}, 1), FakeWorker({BWD.name: 1.04}, {}, 2)
    _default_build(tmp_path, monkeypatch, base, head)
    code, doc, md = _run_gate(tmp_path, monkeypatch, base, head, cases=[CASES[1], BWD, STEP],
                              arch="90")
    assert code == gate.REGRESSION
    verdicts = {r["case"]: r["verdict"] for r in doc["results"]}
    assert verdicts == {BWD.name: "slower", CASES[1].name: "same", STEP.name: "same"}
    assert f"| {BWD.name} | 15 |" in md and "**slower**" in md
    kernels = {r["case"]: r["kernel"] for r in doc["results"]}
    # on sm_90 the default build's Hopper backward runs the fixed-length cases
    assert kernels[BWD.name] == ("bwd_sm90_bf16_d128_r64_c128_f + bwd_sm80_preprocess_bf16 + "
                                 "bwd_sm90_convert_dq_bf16")
    assert kernels[STEP.name].startswith("fwd_sm90_bf16_d128_") and kernels[STEP.name].endswith(
        " + bwd_sm90_bf16_d128_r64_c128_f + bwd_sm80_preprocess_bf16 + bwd_sm90_convert_dq_bf16")
    by_case = {r["case"]: r for r in doc["results"]}
    assert by_case[BWD.name]["head_tflops"] == pytest.approx(
        BWD.flops() / by_case[BWD.name]["head_ms"] / 1e9)
    out = tmp_path / "out"
    report.run(out)
    assert "| perf | FAIL: regression | 1 slower, 0 inconclusive, 0 accepted, 0 faster, " \
           "2 same, 0 new of 3 cases |" in (out / "report.md").read_text()


def test_gate_run_adds_backward_cases_for_changed_backward_kernels(tmp_path, monkeypatch):
    """A changed backward kernel no gate case runs gets a backward case (the kernel the
    operator picks for it); a changed helper a gate case runs is reported as measured; an
    accept entry may name a case made for any backward kernel."""
    from fa_tools.gate import sassdiff
    from flash_attention.kernels import resolve
    from flash_attention.kernels.helpers import helpers as helpers_of_build

    base, head = FakeWorker({}, {}, 1), FakeWorker({}, {}, 2)
    _default_build(tmp_path, monkeypatch, base, head)
    base.src_dir, head.src_dir = "base", "head"
    helpers = [h.name for h in helpers_of_build(resolve("bwd:default"))]  # both kinds
    code = {k: [b"\0" * 16] * 10 for k in head.configs + head.bwd_configs + helpers}
    changed = dict(code, bwd_sm90_fp16_d256_r64_c64_fjt=[b"\1" * 16] * 4 + [b"\0" * 16] * 6,
                   bwd_sm80_preprocess_bf16=[b"\1" * 16] * 10)
    monkeypatch.setattr(perf, "_binary", lambda src: src)
    monkeypatch.setattr(sassdiff, "kernel_code",
                        lambda binary, arch: code if binary == "base" else changed)
    accept_made = ACCEPT.format(pct=3).replace("bf16_d128_b16_s1024",
                                               "fp16_d64_b4_s4096_cap30_causal_bwd")
    verdict, doc, md = _run_gate(tmp_path, monkeypatch, base, head, accept_made,
                                 cases=[BWD], arch="90")
    assert verdict == gate.PASS, md
    (extra,) = [r for r in doc["results"] if r["why"]]
    # (the Hopper varlen d_head 256 softcap kernel: no gate case runs it in fp16)
    assert extra["case"] == "fp16_d256_b4_s4096_cap30_causal_varlen_bwd"
    assert extra["kernel"].startswith("bwd_sm90_fp16_d256_r64_c64_fjt + ")
    assert "kernel bwd_sm90_fp16_d256_r64_c64_fjt: SASS differs (4 instructions changed" in md
    assert ("kernel bwd_sm80_preprocess_bf16: SASS differs (10 instructions changed: +10 -10 "
            f"of 10); measured by {BWD.name}") in md
    assert doc["meta"]["accept_unused"] == [{"case": "fp16_d64_b4_s4096_cap30_causal_bwd",
                                             "verdict": "not measured"}]


def test_accept_rules_on_results():
    from fa_tools.gate import accept

    def result(verdict, ratio, hi, norm=math.nan):
        r = abtest.CaseResult.new("c", "")
        r.verdict, r.ratio, r.ci_high, r.norm_ratio = verdict, ratio, hi, norm
        return r

    entry = [accept.Acceptance("c", 4.0, "why", "2026-11-24", "abc1234")]
    for r, verdict in ((result("slower", 1.03, 1.05), "accepted"),  # the estimate counts
                       (result("slower", 1.03, 1.05, norm=1.045), "slower"),  # and normalised
                       (result("inconclusive", 1.02, 1.035), "accepted"),  # all of the CI
                       (result("inconclusive", 1.02, 1.045), "inconclusive")):
        assert accept.apply([r], entry) == [] and r.verdict == verdict
    assert result("x", 1, 1).accepted == ""
    r = result("slower", 1.03, 1.05)
    accept.apply([r], entry)
    assert r.accepted == "why (accepted up to +4%, 2026-11-24, abc1234)"
    assert accept.apply([result("faster", 0.9, 0.95)], entry) == [{"case": "c",
                                                                    "verdict": "faster"}]


def test_energy_resolution_note():
    """The report says energy is indicative when a round spans few counter updates (H100:
    one per ~100 ms against 140 ms of calls), and says nothing when it spans many."""
    from fa_tools.gate import perf

    meta = {"warm_ms": 100, "round_ms": 40,
            "energy": {"base": {"interval_ms_median": 99.5}, "head": {"interval_ms_median": 99.8}}}
    assert "indicative only" in perf._energy_resolution(meta)
    meta["energy"] = {"base": {"interval_ms_median": 5.0}}
    assert perf._energy_resolution(meta) is None
    assert perf._energy_resolution({"warm_ms": 100, "round_ms": 40}) is None
