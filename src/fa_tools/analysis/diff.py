"""Differences between two reports of the same kind: two histograms (fa-tools count --format
json) or two resource reports (fa-tools resources --format json), before/after or two configs.
The result is a markdown table sorted by absolute change, with the relative change, and a
summary line."""

from __future__ import annotations

from dataclasses import dataclass

RESOURCE_METRICS = ("registers", "spill_stores", "spill_loads", "stack_frame",
                    "cumulative_stack", "static_smem", "dynamic_smem", "barriers", "cmem0",
                    "ctas_per_sm", "warps_per_sm")


@dataclass(frozen=True)
class Change:
    key: str
    before: float
    after: float

    @property
    def delta(self) -> float:
        return self.after - self.before

    @property
    def relative(self) -> float | None:
        return None if self.before == 0 else self.delta / self.before


def flatten(doc: list[dict], with_kernel: bool = True, opcodes: bool = False) -> dict[str, float]:
    """Numbers of a report keyed by '<kernel> sm_<arch> <metric>' (kernel left out with
    with_kernel=False, to compare two different configs)."""
    out: dict[str, float] = {}
    for rec in doc:
        prefix = (f"{rec['kernel']} " if with_kernel else "") + f"sm_{rec['arch']}"
        if "categories" in rec:  # an opcode histogram
            out[f"{prefix} total"] = rec["total"]
            out[f"{prefix} predicated"] = rec["predicated"]
            for name, n in rec["categories"].items():
                out[f"{prefix} category:{name}"] = n
            if opcodes:
                for name, n in rec["full"].items():
                    out[f"{prefix} opcode:{name}"] = n
        else:  # a resource record
            for metric in RESOURCE_METRICS:
                if rec.get(metric) is not None:
                    out[f"{prefix} {metric}"] = rec[metric]
    return out


def compare(before: dict[str, float], after: dict[str, float]) -> list[Change]:
    keys = sorted(set(before) | set(after))
    changes = [Change(k, before.get(k, 0), after.get(k, 0)) for k in keys]
    changes = [c for c in changes if c.delta != 0]
    return sorted(changes, key=lambda c: (-abs(c.delta), c.key))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3f}"


def markdown(changes: list[Change], compared: int, label_a: str = "before",
             label_b: str = "after") -> str:
    if not changes:
        return f"No differences ({compared} values compared).\n"
    lines = [f"| value | {label_a} | {label_b} | change | relative |", "|---|---|---|---|---|"]
    for c in changes:
        rel = "new" if c.relative is None else f"{c.relative:+.1%}"
        lines.append(f"| {c.key} | {_num(c.before)} | {_num(c.after)} | {c.delta:+g} | {rel} |")
    up = sum(1 for c in changes if c.delta > 0)
    lines.append("")
    lines.append(f"{len(changes)} of {compared} values changed: {up} up, "
                 f"{len(changes) - up} down.")
    return "\n".join(lines) + "\n"
