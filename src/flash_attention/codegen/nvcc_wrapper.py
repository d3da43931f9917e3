"""Runs nvcc (or the host C++ compiler) for the build, keeps the ptxas report, caches objects.

The build points torch's ninja rules at this script: ``$nvcc`` is ``python nvcc_wrapper.py
ARGS`` (PYTORCH_NVCC) and ``$cxx`` a launcher that runs ``python nvcc_wrapper.py --cxx
COMPILER ARGS`` (setup.py writes it). Each call runs the real compiler with the same arguments,
writes what it printed on stderr to ``<object>.ptxas.log`` beside the object, and passes
through only what is not a ptxas info line, so warnings and errors still reach the console
while the per-kernel resource lines land in a file for the resource report.

Object cache (content-addressed, shared by all builds of all checkouts on the machine): a
compile of one source to one object is looked up under a key made of

- the compiler: its resolved path and ``--version`` (for nvcc also the host compilers'), and
  the environment variables that change what it does (NVCC_APPEND_FLAGS, CPATH, ...);
- the full command line, with the per-build paths (the object and its depfile) replaced by
  placeholders, and the working directory;
- the source text and every project header it can include: ``#include "..."`` followed through
  the source's directory and the ``-I`` directories, whatever the preprocessor conditions;

and an entry is used only if every file the compiler read the last time (its depfile: torch,
CUDA and system headers included) still has the same content. A hit restores the object, the
depfile ninja reads and the ptxas report, and replays the compiler's warnings; a miss compiles
and stores. Each call prints ``fa-build-cache: hit|miss <source>`` and leaves
``<object>.fa-cache.json`` for the build summary (setup.py).

Environment: FA_BUILD_CACHE, the cache directory (default ``~/.cache/fa-build``; ``off``
disables it). Standalone: imports nothing from the package.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# ptxas -v lines: "ptxas info : ..." and the indented "N bytes stack frame, ..." property line.
_PTXAS_INFO = re.compile(r"^(ptxas info\s*:|\s+\d+ bytes stack frame,)")
_QUOTE_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"\n]+)"', re.MULTILINE)
_SOURCE_SUFFIXES = (".cu", ".cpp", ".cc", ".cxx", ".c")
# Variables that change what nvcc or gcc compile without showing on the command line.
_COMPILER_ENV = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN", "CPATH",
                 "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH")
CACHE_FORMAT = "fa-build-cache 1"
LOG_PREFIX = "fa-build-cache:"


def _real_nvcc() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return os.path.join(cuda_home, "bin", "nvcc")


def cache_dir() -> Path | None:
    """The cache directory, or None when FA_BUILD_CACHE is off/0/none/false."""
    value = os.environ.get("FA_BUILD_CACHE")
    if value is None or value == "":
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "fa-build"
    if value.lower() in ("off", "0", "none", "false", "no"):
        return None
    return Path(value).expanduser()


# --- what a command compiles ------------------------------------------------------------------

def _option_value(args: list[str], flag: str) -> str | None:
    """The value of `flag VALUE` or `flag=VALUE` (last occurrence), else None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def _include_dirs(args: list[str]) -> list[Path]:
    dirs = []
    for i, arg in enumerate(args):
        if arg in ("-I", "-isystem", "-iquote", "--include-path") and i + 1 < len(args):
            dirs.append(args[i + 1])
        elif arg.startswith("--include-path="):
            dirs.append(arg.split("=", 1)[1])
        elif arg.startswith("-I") and len(arg) > 2:
            dirs.append(arg[2:])
    return [Path(d) for d in dirs]


class Compile:
    """One `-c SOURCE -o OBJECT` compile; None from parse() for anything else (links, probes)."""

    def __init__(self, args: list[str], source: str, obj: str, depfile: str | None) -> None:
        self.args, self.source, self.obj, self.depfile = args, source, obj, depfile

    @classmethod
    def parse(cls, args: list[str]) -> Compile | None:
        if "-c" not in args:
            return None
        obj = _option_value(args, "-o")
        sources = [a for a in args if a.endswith(_SOURCE_SUFFIXES) and not a.startswith("-")
                   and os.path.isfile(a)]
        if obj is None or len(sources) != 1 or obj in sources:
            return None
        return cls(args, sources[0], obj, _option_value(args, "-MF"))

    def normalised_args(self) -> list[str]:
        """The command line with the per-build output paths replaced by placeholders."""
        names = {self.obj: "@OBJ@"}
        if self.depfile:
            names[self.depfile] = "@DEP@"
        out = []
        for arg in self.args:
            for path, name in names.items():
                arg = name if arg == path else arg.replace("=" + path, "=" + name)
            out.append(arg)
        return out


# A generated source whose first lines carry this marker holds an sm_90a kernel (wgmma,
# setmaxnreg): it compiles for that target alone, whatever the build's architecture list.
ARCH_MARKER = "// fa-arch: sm_90a"
_GENCODE = re.compile(r"^(-gencode|--generate-code)(=.*)?$")


def arch_override(args: list[str], source: str) -> list[str]:
    """The command line with its -gencode flags replaced by sm_90a for a marked source."""
    try:
        with open(source, encoding="utf-8", errors="replace") as fh:
            head = fh.read(4096)
    except OSError:
        return args
    if ARCH_MARKER not in head:
        return args
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
            continue
        m = _GENCODE.match(arg)
        if m:
            skip = m[2] is None  # "-gencode VALUE": drop the value too
            continue
        if arg.startswith(("-arch=", "--gpu-architecture=", "-code=", "--gpu-code=")):
            continue
        out.append(arg)
    return [*out, "-gencode=arch=compute_90a,code=sm_90a"]


def project_headers(source: Path, include_dirs: list[Path]) -> list[Path]:
    """Every file `#include "..."` can reach from source (through the including file's
    directory and the -I directories), regardless of preprocessor conditions, sorted."""
    seen: set[Path] = set()
    todo = [source.resolve()]
    while todo:
        current = todo.pop()
        try:
            text = current.read_bytes()
        except OSError:
            continue
        for match in _QUOTE_INCLUDE.finditer(text):
            name = match.group(1).decode(errors="replace")
            for directory in [current.parent, *include_dirs]:
                candidate = (directory / name)
                if candidate.is_file():
                    candidate = candidate.resolve()
                    if candidate not in seen:
                        seen.add(candidate)
                        todo.append(candidate)
                    break
    seen.discard(source.resolve())
    return sorted(seen)


def _version_text(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        return f"{tool}: not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False,
                             timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{tool}: {exc}"
    return f"{os.path.realpath(path)}\n{out.stdout}{out.stderr}"


def compiler_identity(compiler: list[str]) -> str:
    """The compiler command, the version of the compiler it runs (the last word: "ccache c++"
    runs c++) and, for nvcc, of the host compilers it hands host code to; and the environment
    variables that change what they compile."""
    parts = [" ".join(compiler), _version_text(compiler[-1])]
    if os.path.basename(compiler[-1]) == "nvcc":
        parts += [_version_text("gcc"), _version_text("g++")]
    parts += [f"{name}={os.environ[name]}" for name in _COMPILER_ENV if name in os.environ]
    return "\n".join(parts)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_key(compiler: list[str], comp: Compile) -> str:
    h = hashlib.sha256()

    def add(label: str, data: bytes | str) -> None:
        data = data.encode() if isinstance(data, str) else data
        h.update(f"{label} {len(data)}\n".encode())
        h.update(data)

    add("format", CACHE_FORMAT)
    add("compiler", compiler_identity(compiler))
    add("args", "\0".join(comp.normalised_args()))
    add("cwd", os.getcwd())
    add("source", Path(comp.source).read_bytes())
    for header in project_headers(Path(comp.source), _include_dirs(comp.args)):
        add("header", str(header))
        add("text", header.read_bytes())
    return h.hexdigest()


# --- depfiles ---------------------------------------------------------------------------------

_UNESCAPED_COLON = re.compile(r"(?<!\\):(?:[ \t]|$)")
_UNESCAPED_SPACE = re.compile(r"(?<!\\)[ \t]+")


def read_depfile(text: str) -> list[str]:
    """The prerequisites of a make-style depfile (`target: dep dep \\` ...), in order."""
    deps: list[str] = []
    for line in text.replace("\\\n", " ").splitlines():
        sep = _UNESCAPED_COLON.search(line)
        if sep is None:
            continue
        for token in _UNESCAPED_SPACE.split(line[sep.end():].strip()):
            if token:
                deps.append(token.replace("\\ ", " ").replace("\\#", "#").replace("$$", "$"))
    return list(dict.fromkeys(deps))


# --- the cache --------------------------------------------------------------------------------

def _log(message: str) -> None:
    print(f"{LOG_PREFIX} {message}", flush=True)


def _write_marker(obj: str, result: str, key: str, seconds: float) -> None:
    with contextlib.suppress(OSError):
        Path(obj + ".fa-cache.json").write_text(json.dumps(
            {"result": result, "key": key, "source_seconds": round(seconds, 3)}) + "\n")


def _stats_line(root: Path, result: str, source: str, seconds: float) -> None:
    with contextlib.suppress(OSError), open(root / "stats.log", "a") as fh:
        fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {result} {seconds:.1f}s {source}\n")


def _replay(stderr: str) -> None:
    for line in stderr.splitlines(keepends=True):
        if not _PTXAS_INFO.match(line):
            sys.stderr.write(line)


def lookup(entry: Path) -> dict | None:
    """The entry's manifest if every dependency recorded in it is unchanged, else None."""
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        for path, digest in manifest["deps"].items():
            if _sha256_file(Path(path)) != digest:
                return None
    except (OSError, ValueError, KeyError):
        return None
    return manifest


def restore(entry: Path, manifest: dict, comp: Compile) -> None:
    tmp = comp.obj + ".fa-cache-tmp"
    shutil.copyfile(entry / "object.o", tmp)
    os.replace(tmp, comp.obj)
    if comp.depfile:
        Path(comp.depfile).write_text(manifest["depfile"].replace("@OBJ@", comp.obj))
    stderr = (entry / "stderr.txt").read_text()
    Path(comp.obj + ".ptxas.log").write_text(stderr)
    _replay(stderr)


def store(root: Path, entry: Path, comp: Compile, depfile_text: str, stderr: str) -> None:
    deps = [d for d in read_depfile(depfile_text) if os.path.abspath(d) != os.path.abspath(
        comp.obj)]
    manifest = {
        "source": comp.source,
        "depfile": depfile_text.replace(comp.obj, "@OBJ@"),
        "deps": {os.path.abspath(d): _sha256_file(Path(d)) for d in deps},
    }
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        shutil.copyfile(comp.obj, tmp / "object.o")
        (tmp / "stderr.txt").write_text(stderr)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=0) + "\n")
        if entry.exists():  # a stale entry (a dependency changed): replace it
            shutil.rmtree(entry, ignore_errors=True)
        try:
            os.rename(tmp, entry)  # atomic
        except OSError:
            if not entry.is_dir():  # else another job stored the same key first: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_compiler(compiler: list[str], args: list[str], obj: str | None) -> tuple[int, str]:
    """Run the compiler, keep its stderr beside the object, pass the rest through."""
    proc = subprocess.run([*compiler, *args], stdout=sys.stdout, stderr=subprocess.PIPE,
                          text=True, check=False)
    if obj is not None:
        with contextlib.suppress(OSError):
            Path(obj + ".ptxas.log").write_text(proc.stderr)
    _replay(proc.stderr)
    return proc.returncode, proc.stderr


def compile_cached(compiler: list[str], comp: Compile, root: Path) -> int:
    t0 = time.monotonic()
    name = os.path.basename(comp.source)
    try:
        key = cache_key(compiler, comp)
    except OSError as exc:
        _log(f"off for {name} ({exc})")
        return run_compiler(compiler, comp.args, comp.obj)[0]
    entry = root / key[:2] / key
    manifest = lookup(entry) if entry.is_dir() else None
    if manifest is not None:
        try:
            restore(entry, manifest, comp)
        except OSError as exc:
            _log(f"cannot restore {name} ({exc}); compiling")
        else:
            seconds = time.monotonic() - t0
            _log(f"hit {name} ({key[:12]}, {seconds:.1f} s)")
            _write_marker(comp.obj, "hit", key, seconds)
            _stats_line(root, "hit", comp.source, seconds)
            return 0
    # Miss: compile; a command without a depfile gets one, so the entry knows what was read.
    args, own_depfile = comp.args, None
    if comp.depfile is None:
        own_depfile = comp.obj + ".fa-cache.d"
        args = [*args, "-MD", "-MF", own_depfile]
    returncode, stderr = run_compiler(compiler, args, comp.obj)
    seconds = time.monotonic() - t0
    if returncode == 0:
        depfile = comp.depfile or own_depfile
        try:
            store(root, entry, comp, Path(depfile).read_text(), stderr)
        except OSError as exc:
            _log(f"not stored {name} ({exc})")
        _log(f"miss {name} ({key[:12]}, compiled in {seconds:.1f} s)")
        _write_marker(comp.obj, "miss", key, seconds)
        _stats_line(root, "miss", comp.source, seconds)
    if own_depfile:
        Path(own_depfile).unlink(missing_ok=True)
    return returncode


def main(argv: list[str]) -> int:
    if argv[:1] == ["--cxx"]:
        if len(argv) < 2:
            sys.stderr.write("nvcc_wrapper: --cxx needs the compiler\n")
            return 2
        compiler, args = argv[1].split(), argv[2:]
    else:
        compiler, args = [_real_nvcc()], argv
    comp = Compile.parse(args)
    if comp is not None and compiler == [_real_nvcc()]:
        args = arch_override(args, comp.source)
        comp = Compile.parse(args)
    root = cache_dir()
    if comp is None or root is None:
        return run_compiler(compiler, args, comp.obj if comp else _option_value(args, "-o"))[0]
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _log(f"off ({root}: {exc})")
        return run_compiler(compiler, args, comp.obj)[0]
    return compile_cached(compiler, comp, root)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
