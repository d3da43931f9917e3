"""The A/B performance comparison: two builds (base and head), one live measuring process
each, rounds alternating base, head, base, head... on one GPU; per case the ratio of medians
head/base with a bootstrap interval and a one-sided Mann-Whitney p-value, on raw times and on
times normalised by the SDPA FA2 peer measured in the same round."""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .perfcases import Case
from .stats import bootstrap_ratio_ci, cv, mann_whitney_greater

log = logging.getLogger(__name__)
TOOLS_DIR = Path(__file__).resolve().parent


class WorkerError(RuntimeError):
    """A measuring process failed: kind 'broken' (the build under test) or 'infra'."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class Worker:
    """One perf_worker process bound to the flash_attention of `src_dir`. The gate's own
    fa_tools is put first on the path (copied alone), so an old base tree is measured by the
    same timing code as the head."""

    def __init__(self, label: str, src_dir: Path, python: str = sys.executable):
        self.label = label
        self.src_dir = Path(src_dir).resolve()
        self._tools = Path(tempfile.mkdtemp(prefix="fa-gate-tools-"))
        shutil.copytree(TOOLS_DIR, self._tools / "fa_tools",
                        ignore=shutil.ignore_patterns("__pycache__"))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(self._tools), str(self.src_dir)]),
                   PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([python, "-m", "fa_tools.perf_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=self._tools)
        hello = self._read()
        if not hello.get("ok"):
            raise WorkerError(f"{label} worker did not start: {hello.get('error')}",
                              "broken" if label == "head" else "infra")
        module = Path(hello["module"]).resolve()
        if self.src_dir not in module.parents:
            raise WorkerError(f"{label} worker imported {module}, not the build in {self.src_dir}",
                              "infra")
        self.configs = hello["configs"]
        self.gpu = hello["gpu"]
        log.info("%s: %s (%d kernels) on %s", label, module.parent, len(self.configs), self.gpu)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            return {"ok": False, "error": f"process exited with {code}"}
        return json.loads(line)

    def measure(self, cases: list[Case], reps: int) -> dict[str, dict[str, float]]:
        self.proc.stdin.write(json.dumps({"cases": [c.as_dict() for c in cases],
                                          "reps": reps}) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if not reply.get("ok"):
            raise WorkerError(f"{self.label}: {reply.get('error')}\n{reply.get('trace', '')}",
                              "broken")
        return reply["results"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        shutil.rmtree(self._tools, ignore_errors=True)


@dataclass
class CaseResult:
    case: str
    base_ms: float
    head_ms: float
    ratio: float  # head / base, > 1: head slower
    ci_low: float
    ci_high: float
    p_slower: float  # one-sided: head slower than base
    p_faster: float
    norm_ratio: float  # the same on times divided by the in-round SDPA FA2 time
    norm_ci_low: float
    norm_ci_high: float
    norm_p_slower: float
    base_cv: float
    head_cv: float
    verdict: str  # "slower", "faster", "same"
    samples: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def analyse(case: str, base: list[float], head: list[float], base_peer: list[float],
            head_peer: list[float], threshold_pct: float, alpha: float,
            iterations: int = 2000) -> CaseResult:
    ratio = statistics.median(head) / statistics.median(base)
    lo, hi = bootstrap_ratio_ci(head, base, iterations=iterations)
    nb = [b / p for b, p in zip(base, base_peer)]
    nh = [h / p for h, p in zip(head, head_peer)]
    nratio = statistics.median(nh) / statistics.median(nb)
    nlo, nhi = bootstrap_ratio_ci(nh, nb, iterations=iterations, seed=1)
    p_slow = mann_whitney_greater(head, base)
    p_fast = mann_whitney_greater(base, head)
    np_slow = mann_whitney_greater(nh, nb)
    limit = 1 + threshold_pct / 100
    # Slower only if raw and peer-normalised times agree: significant and beyond the threshold.
    if p_slow < alpha and np_slow < alpha and ratio > limit and nratio > limit:
        verdict = "slower"
    elif p_fast < alpha and ratio < 1 / limit:
        verdict = "faster"
    else:
        verdict = "same"
    return CaseResult(case, statistics.median(base), statistics.median(head), ratio, lo, hi,
                      p_slow, p_fast, nratio, nlo, nhi, np_slow, cv(base), cv(head), verdict,
                      {"base": base, "head": head, "base_peer": base_peer,
                       "head_peer": head_peer})


def run_rounds(base: Worker, head: Worker, cases: list[Case], rounds: int, reps: int
               ) -> dict[str, dict[str, list[float]]]:
    """samples[side][case] for 'base', 'head', 'base_peer', 'head_peer': one median per round."""
    samples: dict[str, dict[str, list[float]]] = {k: {c.name: [] for c in cases}
                                                  for k in ("base", "head", "base_peer",
                                                            "head_peer")}
    for r in range(rounds):
        for side, worker in (("base", base), ("head", head)):
            res = worker.measure(cases, reps)
            for c in cases:
                samples[side][c.name].append(res[c.name]["ours"])
                samples[f"{side}_peer"][c.name].append(res[c.name]["sdpa_fa2"])
        log.info("round %d/%d done", r + 1, rounds)
    return samples


def compare(base: Worker, head: Worker, cases: list[Case], rounds: int, reps: int,
            threshold_pct: float, alpha: float) -> list[CaseResult]:
    s = run_rounds(base, head, cases, rounds, reps)
    results = [analyse(c.name, s["base"][c.name], s["head"][c.name], s["base_peer"][c.name],
                       s["head_peer"][c.name], threshold_pct, alpha) for c in cases]
    return sorted(results, key=lambda r: -abs(r.ratio - 1))
