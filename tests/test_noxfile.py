"""noxfile.py runs on a fresh machine: nox imports it in an interpreter that has nothing but nox
(ci/nox.sh makes such a .venv), before any session has installed anything. So the file imports
only the standard library and nox, and each session installs what it runs before running it:
every place that runs `python -m fa_tools` first ensures FA_TOOLS_DEPS, and FA_TOOLS_DEPS names
every third-party module the fa_tools package imports. (An `import yaml` in the gate session
once made `ci/nox.sh -s gate` fail at once on a fresh machine, while `-s build test` passed
because the build happened to install pyyaml first.) CPU only, seconds."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOXFILE = ROOT / "noxfile.py"


def _tree() -> ast.Module:
    return ast.parse(NOXFILE.read_text(), filename=str(NOXFILE))


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level module) of every import anywhere in the tree, function bodies too."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def _fa_tools_deps() -> dict[str, str]:
    for node in _tree().body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "FA_TOOLS_DEPS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("noxfile.py defines no FA_TOOLS_DEPS")


def _runs_fa_tools(call: ast.Call) -> bool:
    """A call with the string "fa_tools" among its arguments (or in a list argument), as in
    session.run(PY, "-m", "fa_tools", ...) and subprocess.run([PY, "-m", "fa_tools", ...])."""
    args = [a for arg in call.args for a in (arg.elts if isinstance(arg, ast.List) else [arg])]
    return any(isinstance(a, ast.Constant) and a.value == "fa_tools" for a in args)


def _ensures_fa_tools_deps(call: ast.Call) -> bool:
    return (isinstance(call.func, ast.Name) and call.func.id == "_ensure"
            and any(isinstance(a, ast.Name) and a.id == "FA_TOOLS_DEPS" for a in call.args))


def test_noxfile_imports_only_the_standard_library_and_nox():
    outside = [f"noxfile.py:{line}: import {name}" for line, name in _imported(_tree())
               if name not in sys.stdlib_module_names and name != "nox"]
    assert outside == [], ("noxfile.py is imported by an interpreter that may hold nothing but "
                           "nox: ensure the package in the session and use it in a child "
                           "process (see _policy_section)")


def test_every_fa_tools_run_ensures_its_requirements_first():
    """Each function that runs fa_tools calls _ensure(session, FA_TOOLS_DEPS) before it."""
    functions = [n for n in ast.walk(_tree()) if isinstance(n, ast.FunctionDef)]
    runs, unguarded = 0, []
    for func in functions:
        calls = sorted((n for n in ast.walk(func) if isinstance(n, ast.Call)),
                       key=lambda n: (n.lineno, n.col_offset))
        ensured_at = min((c.lineno for c in calls if _ensures_fa_tools_deps(c)), default=None)
        for call in filter(_runs_fa_tools, calls):
            runs += 1
            if ensured_at is None or ensured_at > call.lineno:
                unguarded.append(f"noxfile.py:{call.lineno} in {func.name}()")
    assert runs, "no call that runs fa_tools was found: has the way it is run changed?"
    assert unguarded == [], "fa_tools run without _ensure(session, FA_TOOLS_DEPS) before it"


def test_fa_tools_deps_cover_what_fa_tools_imports():
    """Import every module of fa_tools in a clean interpreter; each third-party top-level
    module it loads (not the standard library, not the project's own packages under src/) must
    be in FA_TOOLS_DEPS. Modules imported only inside functions (torch, by the GPU commands)
    are not loaded here, and are the build's to install."""
    probe = """
import importlib, json, pkgutil, sys
before = set(sys.modules)
import fa_tools
for info in pkgutil.walk_packages(fa_tools.__path__, "fa_tools."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
files = {}
for name in set(sys.modules) - before:
    top = name.split(".")[0]
    path = getattr(sys.modules.get(top), "__file__", None)
    if path and top not in sys.stdlib_module_names:
        files[top] = path
print(json.dumps(files))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=env, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr
    src = ROOT / "src"
    third_party = {top for top, path in json.loads(proc.stdout).items()
                   if not Path(path).resolve().is_relative_to(src)}
    assert sorted(third_party - _fa_tools_deps().keys()) == [], (
        "fa_tools imports these at module level: add them to FA_TOOLS_DEPS in noxfile.py")
