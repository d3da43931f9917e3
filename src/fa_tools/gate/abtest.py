"""The sequential A/B performance comparison.

Two builds (base and head), one live measuring process each (worker.py), measured in rounds
that alternate which side goes first. Each round gives, per case, one median time per side for
attention() and for the SDPA FA2 peer measured right after it, each timed after `warm_ms` of
its own calls back to back: at the clock the GPU settles at under continuous load (a burst
after an idle moment rides the boost clock down, by how much depends on the kernel). The
measure compared is the SM cycles per call over those calls (clock stamps around them,
gpu/clockstamp.py; policy `metric: cycles`), not their time: at the power limit an H100's clock
steps between levels tens of milliseconds apart, which moved the time of one unchanged kernel by
up to 8% from round to round while its cycles stayed put. The times are reported beside. (The
price: a change that only raises the power drawn per cycle, and so the clock falls, is not seen;
`metric: time` gates on time, with the spread that comes with it.) Per case the gate looks at
the paired log-ratios ln(head/base), raw and normalised by the peer (policy in
ci/gate_policy.yaml):

  slower        the one-sided signed-rank test on the raw log-ratios significant at the
                per-look level, and both estimated ratios (Hodges-Lehmann, raw and normalised)
                beyond 1 + threshold_pct
  faster        significant the other way, beyond 1 / (1 + threshold_pct)
  same          the raw 95% interval entirely below 1 + clear_pct (a slowdown of the size the
                gate promises to catch is ruled out) and the normalised estimate below it too
  undecided     anything else: the case gets `step` more rounds, up to `max_rounds`; still
                undecided then -> inconclusive
  new           the base cannot run the case (a feature the pull request adds): nothing to
                compare, reported with the base's error, no effect on the exit code

A case SDPA cannot run (a sliding window, a softcap: Case.peer_note) has no normalised ratio;
it is judged on the raw ratios alone, and the report says so.

Significance is tested on the raw ratios only: rounds alternate which side goes first and pair
measurements seconds apart, so drift cancels within a pair, and the raw test alone keeps the
false-positive rate. The normalised ratios (each time divided by the SDPA FA2 time of the same
round and process) carry the peer's noise too; they serve as a guard, so that a change of the
machine that hits both contenders (the peer as much as ours) is not called a regression, and a
slowdown the raw ratio hides behind such a change is not cleared.

The false-positive rate is controlled per gate run: the family-wise alpha is split evenly
(Bonferroni) over the cases and over the looks each case can have, so all cases and all looks
together stay under it. Every request to a worker runs under a time limit derived from the base's
own timings; a request past it is killed and reported as broken (or infrastructure, if it is
the base), naming the case.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flash_attention.kernels.legacy import current_name

from ..gpu.perfcases import Case
from .stats import cv, hodges_lehmann, log_ratios, signed_rank_greater

log = logging.getLogger(__name__)
TOOLS_DIR = Path(__file__).resolve().parents[1]  # the fa_tools package


class WorkerError(RuntimeError):
    """A measuring process failed: kind 'broken' (the build under test) or 'infra'."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Policy:
    """The perf section of ci/gate_policy.yaml."""

    threshold_pct: float = 1.5
    clear_pct: float = 3.0
    fwer: float = 0.01
    rounds: int = 12
    step: int = 12
    max_rounds: int = 48
    round_ms: float = 40.0
    warm_ms: float = 100.0
    metric: str = "cycles"  # what the verdict compares: SM cycles per call, or "time"
    min_reps: int = 3
    max_reps: int = 50
    first_call_timeout_s: float = 300.0
    min_timeout_s: float = 60.0
    timeout_factor: float = 20.0
    sass_extra_cases: int = 6  # at most this many cases added for kernels whose SASS changed
    accept_file: str = "ci/perf_accept.yaml"  # accepted regressions of named cases (accept.py)

    @classmethod
    def from_dict(cls, doc: dict) -> Policy:
        known = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        unknown = set(doc) - set(known)
        if unknown:
            raise ValueError(f"unknown perf policy keys: {', '.join(sorted(unknown))}")
        policy = cls(**known)
        if policy.metric not in ("cycles", "time"):
            raise ValueError(f"perf policy metric: 'cycles' or 'time', not {policy.metric!r}")
        if policy.metric == "cycles" and policy.warm_ms <= 0:
            raise ValueError("perf policy metric 'cycles' needs warm_ms > 0 (steady-state "
                             "timing with clock stamps)")
        return policy

    def key(self, contender: str) -> str:
        """The worker reply's field the verdict compares for a contender."""
        return f"{contender}_mcycles" if self.metric == "cycles" else contender

    @property
    def looks(self) -> int:
        """How many times a case can be analysed: after `rounds`, then every `step`."""
        return 1 + math.ceil(max(0, self.max_rounds - self.rounds) / self.step)

    def alpha_per_look(self, n_cases: int) -> float:
        return self.fwer / (n_cases * self.looks)


def gpu_health(python: str = sys.executable, timeout_s: float = 60.0) -> str:
    """After a killed worker: does a fresh process still get correct work done on the GPU?"""
    code = ("import torch; a = torch.ones(256, 256, device='cuda'); "
            "assert (a @ a).sum().item() == 256 ** 3; print(torch.cuda.get_device_name())")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"GPU check: a fresh process did not finish a matmul within {timeout_s:.0f} s"
    if proc.returncode != 0:
        return f"GPU check failed: {proc.stderr.strip().splitlines()[-1:]}"
    return f"GPU check after the kill: healthy ({proc.stdout.strip()})"


class Worker:
    """One worker.py process bound to the flash_attention of `src_dir`. The gate's own fa_tools
    is put first on the path (copied alone), so an old base tree is measured by the same timing
    code as the head. Replies are read with a deadline; a worker past it is killed with its
    process group."""

    def __init__(self, label: str, src_dir: Path, python: str = sys.executable,
                 start_timeout_s: float = 300.0):
        self.label = label
        self.src_dir = Path(src_dir).resolve()
        self.python = python
        self._buf = b""
        self._tools = Path(tempfile.mkdtemp(prefix="fa-gate-tools-"))
        shutil.copytree(TOOLS_DIR, self._tools / "fa_tools",
                        ignore=shutil.ignore_patterns("__pycache__"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(self._tools), str(self.src_dir)]),
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([python, "-m", "fa_tools.gate.worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=self._tools, start_new_session=True)
        hello = self._read(start_timeout_s, "start-up (import of torch and flash_attention)")
        if not hello.get("ok"):
            raise WorkerError(f"{label} worker did not start: {hello.get('error')}",
                              self._kind)
        module = Path(hello["module"]).resolve()
        if self.src_dir not in module.parents:
            raise WorkerError(f"{label} worker imported {module}, not the build in {self.src_dir}",
                              "infra")
        # kernel names as this tree calls them (a base from before the one name scheme reports
        # the old ones)
        self.configs = [current_name(n) for n in hello["configs"]]
        self.bwd_configs = [current_name(n) for n in hello["bwd_configs"]]
        self.gpu = hello["gpu"]
        self.energy = hello.get("energy") or {"supported": False, "reason": "not reported"}
        log.info("%s: %s (%d kernels) on %s", label, module.parent, len(self.configs), self.gpu)

    @property
    def _kind(self) -> str:
        return "broken" if self.label == "head" else "infra"

    def _read(self, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self.kill()
                raise WorkerError(f"{self.label}: {what} did not finish within {timeout_s:.0f} s;"
                                  f" the worker was killed. {gpu_health(self.python)}",
                                  self._kind)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self.proc.wait()
                return {"ok": False, "error": f"process exited with {code}"}
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def measure(self, case: Case, reps: int, timeout_s: float, slowdown: float = 0.0,
                warm_ms: float = 0.0) -> dict[str, float]:
        """{contender: median ms} of one case, each contender timed after warm_ms of its own
        calls (0: a burst); slowdown > 0 only from the power study."""
        request = {"case": case.as_dict(), "reps": reps, "slowdown": slowdown,
                   "warm_ms": warm_ms}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._read(timeout_s, f"case {case.name} ({reps} calls per contender)")
        if not reply.get("ok"):
            raise WorkerError(f"{self.label}, case {case.name}: {reply.get('error')}\n"
                              f"{reply.get('trace', '')}", self._kind)
        return reply["results"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self._tools, ignore_errors=True)


@dataclass
class CaseResult:
    case: str
    rounds: int
    base_ms: float
    head_ms: float
    ratio: float  # head / base: Hodges-Lehmann of the paired log-ratios, > 1: head slower
    ci_low: float
    ci_high: float
    p_slower: float  # one-sided signed-rank: head slower than base
    p_faster: float
    norm_ratio: float  # the same on times divided by the in-round SDPA FA2 time
    norm_ci_low: float
    norm_ci_high: float
    norm_p_slower: float
    base_cv: float
    head_cv: float
    verdict: str  # slower | faster | same | undecided | inconclusive | new
    samples: dict = field(default_factory=dict)
    note: str = ""
    time_ratio: float = math.nan  # head / base of the per-round median times (Hodges-Lehmann)
    peer_note: str = ""  # why there is no normalised ratio (no SDPA peer), "" when there is
    base_mj: float = math.nan  # millijoules per call, median over rounds (NVML; informational)
    head_mj: float = math.nan
    mj_ratio: float = math.nan  # head / base of the paired per-round energies (Hodges-Lehmann)
    why: str = ""  # why the case was measured when not one of the gate's own (SASS diff)
    accepted: str = ""  # the accept file's reason, when a slowdown within its bound was accepted

    @classmethod
    def new(cls, case: str, why: str) -> CaseResult:
        """A case the base cannot run: no numbers."""
        nan = math.nan
        return cls(case, 0, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan, nan,
                   "new", note=why)

    def as_dict(self) -> dict:
        return asdict(self)


def _paired(base: list[float | None], head: list[float | None]) -> tuple[list, list]:
    """The rounds where both sides have a value."""
    pairs = [(b, h) for b, h in zip(base, head) if b is not None and h is not None]
    return [b for b, _ in pairs], [h for _, h in pairs]


def energy_summary(base_mj: list[float | None], head_mj: list[float | None]
                   ) -> tuple[float, float, float]:
    """(base mJ per call, head mJ per call, head/base) from per-round energies (None where a
    read failed): medians and the Hodges-Lehmann ratio of the rounds both sides have; nan
    without any."""
    b, h = _paired(base_mj, head_mj)
    b, h = [x for x in b if x > 0], [x for x in h if x > 0]
    if not b or len(b) != len(h):
        return math.nan, math.nan, math.nan
    return statistics.median(b), statistics.median(h), math.exp(
        hodges_lehmann(log_ratios(h, b))[0])


def analyse(case: str, base: list[float], head: list[float], base_peer: list[float],
            head_peer: list[float], policy: Policy, alpha: float, level: float = 0.95,
            base_ms: list[float] | None = None, head_ms: list[float] | None = None
            ) -> CaseResult:
    """Verdict of one case at one look (see the module doc); samples are per-round values of
    the policy's metric (cycles or ms per call), paired by round; base_ms/head_ms: the per-round
    median times, reported beside (default: the samples themselves). Without peer samples (a
    case SDPA cannot run) the verdict rests on the raw ratios alone."""
    d = log_ratios(head, base)
    est, lo, hi = hodges_lehmann(d, level)
    p_slow = signed_rank_greater(d)
    p_fast = signed_rank_greater([-x for x in d])
    has_peer = len(base_peer) == len(base) and len(head_peer) == len(head) and bool(base)
    if has_peer:
        nd = [a - b for a, b in zip(d, log_ratios(head_peer, base_peer))]
        nest, nlo, nhi = hodges_lehmann(nd, level)
        np_slow = signed_rank_greater(nd)
    else:
        nest = nlo = nhi = np_slow = math.nan
    convict = math.log1p(policy.threshold_pct / 100)
    clear = math.log1p(policy.clear_pct / 100)
    if p_slow < alpha and est > convict and (not has_peer or nest > convict):
        verdict = "slower"
    elif p_fast < alpha and est < -convict:
        verdict = "faster"
    elif hi < clear and (not has_peer or nest < clear):
        verdict = "same"
    else:
        verdict = "undecided"
    base_ms, head_ms = base_ms or base, head_ms or head
    time_est = hodges_lehmann(log_ratios(head_ms, base_ms), level)[0]
    return CaseResult(case, len(d), statistics.median(base_ms), statistics.median(head_ms),
                      math.exp(est), math.exp(lo), math.exp(hi), p_slow, p_fast, math.exp(nest),
                      math.exp(nlo), math.exp(nhi), np_slow, cv(base), cv(head), verdict,
                      {"base": base, "head": head, "base_peer": base_peer,
                       "head_peer": head_peer, "base_ms": base_ms, "head_ms": head_ms},
                      time_ratio=math.exp(time_est))


@dataclass
class Plan:
    """Per case: calls per round and each side's time limit per request, from the base's own
    timings in a discarded warm-up round."""

    reps: dict[str, int]
    timeout_s: dict[str, float]
    new: dict[str, str] = field(default_factory=dict)  # cases the base cannot run: its error


def warm_up(base: Worker, head: Worker, cases: list[Case], policy: Policy,
            slowdown: dict[str, float]) -> Plan:
    reps, timeout, new = {}, {}, {}
    for c in cases:
        t0 = time.monotonic()
        try:
            first = base.measure(c, policy.min_reps, policy.first_call_timeout_s,
                                 warm_ms=policy.warm_ms)
        except WorkerError as exc:
            if not base.alive():  # killed at its limit, or died: the base is broken
                raise
            new[c.name] = str(exc).splitlines()[0]
            log.info("%s: the base cannot run it (%s); not compared", c.name, new[c.name])
            continue
        base_s = time.monotonic() - t0
        n = math.ceil(policy.round_ms / max(first["ours"], 1e-3))
        reps[c.name] = min(policy.max_reps, max(policy.min_reps, n))
        # a request of reps calls costs at most about reps / min_reps times the warm-up
        # request (less: the warm calls and the first call's set-up are paid once)
        expected = base_s * reps[c.name] / policy.min_reps
        timeout[c.name] = max(policy.min_timeout_s, policy.timeout_factor * expected)
        head.measure(c, policy.min_reps, max(policy.min_timeout_s,
                                             policy.timeout_factor * base_s),
                     slowdown.get(c.name, 0.0), policy.warm_ms)
    return Plan(reps, timeout, new)


def _record(samples: dict[str, list], side: str, res: dict[str, float], policy: Policy) -> None:
    """One worker reply into the case's per-round samples: the metric of ours, of the SDPA
    peer when the case has one, the time, and the energy per call (None when not read)."""
    samples[side].append(res[policy.key("ours")])
    peer = res.get(policy.key("sdpa_fa2"))
    if peer is not None:
        samples[f"{side}_peer"].append(peer)
    samples[f"{side}_ms"].append(res["ours"])
    samples[f"{side}_mj"].append(res.get("ours_mj"))


def compare(base: Worker, head: Worker, cases: list[Case], policy: Policy, n_family: int,
            slowdown: dict[str, float] | None = None) -> list[CaseResult]:
    """The sequential comparison of `cases`; alpha is split over n_family cases (the whole
    gate's case count, also when a study runs a subset)."""
    slowdown = slowdown or {}
    plan = warm_up(base, head, cases, policy, slowdown)
    alpha = policy.alpha_per_look(n_family)
    keys = ("base", "head", "base_peer", "head_peer", "base_ms", "head_ms", "base_mj",
            "head_mj")
    samples = {c.name: {k: [] for k in keys} for c in cases}
    active = [c for c in cases if c.name not in plan.new]
    done = {name: CaseResult.new(name, why) for name, why in plan.new.items()}
    rounds = 0
    target = policy.rounds
    t0 = time.monotonic()
    while active:
        while rounds < target:
            sides = [("base", base), ("head", head)]
            for side, worker in sides if rounds % 2 == 0 else sides[::-1]:
                for c in active:
                    res = worker.measure(c, plan.reps[c.name], plan.timeout_s[c.name],
                                         slowdown.get(c.name, 0.0) if side == "head" else 0.0,
                                         policy.warm_ms)
                    _record(samples[c.name], side, res, policy)
            rounds += 1
        final = rounds >= policy.max_rounds
        still = []
        for c in active:
            s = samples[c.name]
            r = analyse(c.name, s["base"], s["head"], s["base_peer"], s["head_peer"], policy,
                        alpha, base_ms=s["base_ms"], head_ms=s["head_ms"])
            r.peer_note = c.peer_note()
            r.base_mj, r.head_mj, r.mj_ratio = energy_summary(s["base_mj"], s["head_mj"])
            r.samples.update(base_mj=s["base_mj"], head_mj=s["head_mj"])
            if r.verdict == "undecided" and not final:
                still.append(c)
                continue
            if r.verdict == "undecided":
                r.verdict = "inconclusive"
            done[c.name] = r
        log.info("after %d rounds (%.0f s): %d decided, %d undecided", rounds,
                 time.monotonic() - t0, len(done), len(still))
        active = still
        target = min(policy.max_rounds, rounds + policy.step)
    return sorted(done.values(), key=lambda r: (r.verdict == "new", -abs(r.ratio - 1)))
