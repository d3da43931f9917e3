"""`fa-tools gate`: the gate's subcommands (see the package doc for the exit codes).

  static       resource ratchet of the build against ci/baselines/static.yaml (no GPU)
  perf         sequential A/B of the head against a base (--base REF, --base-dir DIR or --aa)
  calibrate    power study: detection rate of planted slowdowns, A/A false positives (GPU)
  rebaseline   re-pin the static baselines (--reason required)
  report       combine the parts in --out into report.md / report.json; exit with the code
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import paths
from . import BROKEN, ratchet

POLICY, BASELINE = "ci/gate_policy.yaml", "ci/baselines/static.yaml"  # in the repository


def _policy(args: argparse.Namespace) -> Path:
    """--policy as given, else the repository's (found whatever the current directory)."""
    return Path(args.policy) if args.policy else paths.repo_file(POLICY)


def _baseline(args: argparse.Namespace) -> Path:
    """--baseline as given, else the repository's; it may not exist yet (rebaseline makes
    it, static says how to)."""
    return Path(args.baseline) if args.baseline else paths.repo_file(BASELINE, must_exist=False)


def command(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.action == "static":
        from . import static

        code = static.run(_policy(args), _baseline(args), out)
        print((out / "static.md").read_text())
        return code
    if args.action == "rebaseline":
        from . import static

        try:
            return static.rebaseline(_policy(args), _baseline(args), args.reason or "")
        except ValueError as exc:
            print(f"fa-tools gate rebaseline: {exc}", file=sys.stderr)
            return BROKEN
    if args.action == "perf":
        from . import perf

        if not (args.aa or args.base or args.base_dir):
            raise SystemExit("fa-tools gate perf: give --base REF, --base-dir DIR or --aa")
        code = perf.run(args, ratchet.load_yaml(_policy(args)), out)
        print((out / "perf.md").read_text())
        return code
    if args.action == "calibrate":
        from . import calibrate

        if args.merge:
            code = calibrate.merge([Path(m) for m in args.merge], out)
            print((out / "calibrate.md").read_text())
            return code
        if not args.case and not args.aa_runs:
            raise SystemExit("fa-tools gate calibrate: name a --case to plant slowdowns on, "
                             "or ask for --aa-runs")
        code = calibrate.run(args, ratchet.load_yaml(_policy(args)), out)
        print((out / "calibrate.md").read_text())
        return code
    from . import report

    return report.run(out)


def _sizes(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _kinds(text: str) -> tuple[str, ...]:
    from ..gpu.perfcases import GATE_KINDS

    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in GATE_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"kinds must be some of {', '.join(GATE_KINDS)}, got "
                                         f"{text!r}")
    return kinds


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gate", help="static ratchet, A/B perf gate, power study, rebaseline, "
                       "report", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("static", "perf", "calibrate", "rebaseline", "report"))
    p.add_argument("--policy", help=f"gate policy (default: the repository's {POLICY})")
    p.add_argument("--baseline", help=f"static pins (default: the repository's {BASELINE})")
    p.add_argument("--out", default="gate-report", help="directory for reports")
    p.add_argument("--reason", help="why the pins change (rebaseline)")
    p.add_argument("--base", help="git ref of the target branch; its merge-base is compared")
    p.add_argument("--base-dir", help="a source tree to use as base instead of a git ref")
    p.add_argument("--aa", action="store_true", help="A/A: the head against itself")
    p.add_argument("--rounds", type=int, help="override the policy's first rounds")
    p.add_argument("--max-rounds", type=int, help="override the policy's most rounds")
    p.add_argument("--rebuild", action="store_true", help="rebuild the base even if built")
    p.add_argument("--kernels", default=os.environ.get("FLASH_ATTENTION_KERNELS", "ci,default"))
    p.add_argument("--archs", help="archs of the base build (default: this GPU's)")
    p.add_argument("--kinds", type=_kinds, default=None,
                   help="perf: only the gate cases of these kinds (comma-separated: fwd, bwd, "
                        "fwdbwd, decode, fp8 (the FP8 forward's cases, not in fwd); default "
                        "all), e.g. `--kinds decode` for the decode steps; the report names "
                        "the kinds run")
    p.add_argument("--case", action="append", default=[],
                   help="calibrate: a gate case to plant slowdowns on (repeatable)")
    p.add_argument("--sizes", type=_sizes, default=[1.5, 2, 3, 5, 10],
                   help="calibrate: planted slowdowns in percent, comma-separated")
    p.add_argument("--runs", type=int, default=10, help="calibrate: gate runs per planted size")
    p.add_argument("--merge", action="append", default=[], metavar="CALIBRATE_JSON",
                   help="calibrate: merge earlier studies (repeatable) into one, no GPU needed")
    p.add_argument("--aa-runs", type=int, default=20,
                   help="calibrate: whole A/A gate runs for the false-positive rate")
    p.set_defaults(func=command)
