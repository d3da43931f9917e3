"""Scripts outside the packages (ci/, benchmarks/) loaded as modules by their tests, and the
asv benchmark classes among them run as asv runs them."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str):
    """The module of the script at ROOT / relpath, registered in sys.modules under its file
    name (dataclasses and pickling look their module up there)."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def run_asv_class(cls, cache) -> dict[tuple, dict[str, float]]:
    """Every case of an asv benchmark class as asv runs it: setup (NotImplementedError: skipped),
    then each track_* method. {params: {method: value}} for the cases not skipped."""
    methods = [m for m in dir(cls) if m.startswith("track_")]
    out = {}
    for params in itertools.product(*cls.params):
        bench = cls()
        try:
            bench.setup(cache, *params)
        except NotImplementedError:
            continue
        out[params] = {m: getattr(bench, m)(cache, *params) for m in methods}
    return out
