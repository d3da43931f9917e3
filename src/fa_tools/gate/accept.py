"""Accepted regressions: a reviewed file (policy `accept_file`, ci/perf_accept.yaml) in which
maintainers accept a known slowdown of a named case, up to a bound, with the reason:

    accept:
      - case: bf16_d128_b16_s4096_causal
        max_slowdown_pct: 3.0
        reason: "..."
        date: 2026-11-24
        commit: abc1234      # optional: the change that slows it

The gate reads the head's file. A case judged slower whose estimated slowdown (raw, and
normalised where the case has a peer) is within its entry's bound becomes "accepted" (exit 0),
the reason quoted in the report; one still inconclusive after the most rounds is accepted when
its whole 95% interval is within the bound. Beyond the bound it stays slower. An entry that
names no case the gate can measure, or is malformed, is a broken configuration (exit 2). An
entry whose case was not slower is reported as unused: entries are removed once the base
includes the change (git keeps their history, as the static pins' history keeps re-pin reasons).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from .abtest import CaseResult

_REQUIRED = ("case", "max_slowdown_pct", "reason", "date")
_OPTIONAL = ("commit",)


class AcceptError(ValueError):
    """The accept file is malformed or names a case the gate does not have."""


@dataclass(frozen=True)
class Acceptance:
    case: str
    max_slowdown_pct: float
    reason: str
    date: str
    commit: str = ""

    @property
    def bound(self) -> float:
        """The largest head/base ratio accepted."""
        return 1 + self.max_slowdown_pct / 100

    def describe(self) -> str:
        when = self.date + (f", {self.commit}" if self.commit else "")
        return f"{self.reason} (accepted up to +{self.max_slowdown_pct:g}%, {when})"


def _entry(i: int, raw: object, path: Path) -> Acceptance:
    where = f"{path}: entry {i + 1}"
    if not isinstance(raw, dict):
        raise AcceptError(f"{where} is not a mapping")
    missing = [k for k in _REQUIRED if raw.get(k) in (None, "")]
    unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
    if missing or unknown:
        raise AcceptError(f"{where}: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else [])
            + ([f"unknown keys {', '.join(unknown)}"] if unknown else [])))
    pct = raw["max_slowdown_pct"]
    if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 < pct < 100:
        raise AcceptError(f"{where}: max_slowdown_pct must be a number in (0, 100), got {pct!r}")
    date = raw["date"]
    if isinstance(date, (dt.date, dt.datetime)):
        date = date.isoformat()
    return Acceptance(str(raw["case"]), float(pct), str(raw["reason"]).strip(), str(date),
                      str(raw.get("commit") or ""))


def load(path: Path) -> list[Acceptance]:
    """The entries of the accept file (none when it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise AcceptError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(doc, dict) or set(doc) - {"accept"}:
        raise AcceptError(f"{path}: expected one key, 'accept', holding a list of entries")
    raw = doc.get("accept") or []
    if not isinstance(raw, list):
        raise AcceptError(f"{path}: 'accept' must be a list of entries")
    entries = [_entry(i, e, path) for i, e in enumerate(raw)]
    seen: set[str] = set()
    for e in entries:
        if e.case in seen:
            raise AcceptError(f"{path}: case {e.case} is accepted twice; keep one entry")
        seen.add(e.case)
    return entries


def check_cases(entries: Iterable[Acceptance], known: Iterable[str], path: Path) -> None:
    """Every entry must name a case the gate can measure."""
    known = sorted(set(known))
    unknown = [e.case for e in entries if e.case not in known]
    if unknown:
        raise AcceptError(f"{path} names {', '.join(unknown)}, which is not a case of the gate "
                          f"(a typo, or a case since renamed or removed: fix or drop the entry); "
                          f"the gate's cases: {', '.join(known)}")


def _within(r: CaseResult, bound: float, upper: float) -> bool:
    """The raw value `upper` and the normalised estimate (where the case has a peer) within
    bound."""
    norm = r.norm_ratio
    return upper <= bound and (math.isnan(norm) or norm <= bound)


def apply(results: Sequence[CaseResult], entries: Iterable[Acceptance]) -> list[dict]:
    """Turn the slower (or inconclusive) results within their case's accepted bound into
    "accepted"; returns the entries that accepted nothing, with their case's verdict."""
    by_case = {e.case: e for e in entries}
    used: set[str] = set()
    for r in results:
        e = by_case.get(r.case)
        if e is None:
            continue
        if (r.verdict == "slower" and _within(r, e.bound, r.ratio)) or (
                r.verdict == "inconclusive" and _within(r, e.bound, r.ci_high)):
            r.verdict, r.accepted = "accepted", e.describe()
            used.add(r.case)
        elif r.verdict in ("slower", "inconclusive"):
            r.note = (f"beyond the accepted +{e.max_slowdown_pct:g}% ({e.reason})"
                      + (f"; {r.note}" if r.note else ""))
            used.add(r.case)
    verdicts = {r.case: r.verdict for r in results}
    return [{"case": e.case, "verdict": verdicts.get(e.case, "not measured")}
            for e in by_case.values() if e.case not in used]
