"""The device code inside the built extension: which kernels it holds per architecture, their
cubins and PTX, extracted with cuobjdump into a directory kept for the session.

A translation unit is named after its kernel (<name>.cu). A forward one holds one kernel; a
backward one three: the main kernel and the two helpers of its kind and dtype
(helpers.helpers_of): a bwd_sm80 unit bwd_sm80_preprocess_<dtype> and
bwd_sm80_convert_dq_<dtype>, a bwd_sm90 one bwd_sm80_preprocess_<dtype> and
bwd_sm90_convert_dq_<dtype>; a decode one two: the main kernel and dec_sm80_combine_<dtype>; a
helper is the same code in every unit of that dtype and arch
holding it, listed once per arch, from the first such unit in name order. A Hopper backward unit
compiles for sm_90a alone, so it adds its helpers under 90a. Units of a build from before the
one name scheme (fwd_<old name>.cu, <old bwd name>.cu) are listed by their current names."""

from __future__ import annotations

import contextlib
import hashlib
import re
import struct
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .binaries import ToolError, run_tool
from .kernel_names import is_hopper_name, parse_kernel

_UNIT = r"(?P<unit>(?:fwd|bwd|dec)_\w+?)\.sm_(?P<arch>\w+)"
_ELF_NAME = re.compile(r"ELF file\s+\d+:\s+(?P<file>" + _UNIT + r"\.cubin)")
_PTX_NAME = re.compile(r"PTX file\s+\d+:\s+(?P<file>" + _UNIT + r"\.ptx)")


@dataclass(frozen=True)
class Member:
    kernel: str  # kernel name
    arch: str
    file: str  # name cuobjdump gives it


def _members(listing: str, pattern: re.Pattern) -> list[Member]:
    """The kernels of every forward, backward and decode unit in cuobjdump's listing."""
    from flash_attention.kernels import ConfigError
    from flash_attention.kernels.helpers import helpers_of
    from flash_attention.kernels.legacy import current_name, old_form

    members: list[Member] = []
    for m in pattern.finditer(listing):
        unit = m["unit"]
        if unit.startswith("fwd_") and old_form(unit[4:]):  # an old build's forward unit
            unit = unit[4:]
        try:
            cfg = parse_kernel(current_name(unit))
        except ConfigError:  # a registry: no kernels
            continue
        members.append(Member(cfg.name, m["arch"], m["file"]))
        members += [Member(h.name, m["arch"], m["file"]) for h in helpers_of(cfg)]
    seen: dict[tuple[str, str], Member] = {}
    for member in sorted(members, key=lambda m: m.file):
        seen.setdefault((member.kernel, member.arch), member)
    return sorted(seen.values(), key=lambda m: (m.kernel, m.arch))


def _file_state(binary: Path) -> tuple[str, int, int, int, int]:
    """What the listings and the content stamp are cached by: the binary's path and the
    inode, size and change times of its file, so a rebuilt binary is never served stale."""
    try:
        st = binary.stat()
    except OSError as exc:
        raise ToolError(f"cannot read {binary}: {exc}") from exc
    return str(binary.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@lru_cache(maxsize=16)
def _listing(option: str, pattern: re.Pattern, path: str, *state: int) -> tuple[Member, ...]:
    """cuobjdump's listing of the binary (it reads the whole file: ~0.5 s for the 150 MB of a
    ci,default build), once per file state."""
    return tuple(_members(run_tool("cuobjdump", option, path), pattern))


def list_cubins(binary: Path) -> list[Member]:
    return list(_listing("--list-elf", _ELF_NAME, *_file_state(binary)))


def list_ptx(binary: Path) -> list[Member]:
    return list(_listing("--list-ptx", _PTX_NAME, *_file_state(binary)))


@lru_cache(maxsize=4)
def _extracted(binary: str, stamp: str) -> Path:
    """All cubins and PTX of the binary, extracted once per binary content."""
    out = Path(tempfile.gettempdir()) / f"fa_tools-{stamp}"
    if not (out / ".done").exists():
        out.mkdir(parents=True, exist_ok=True)
        run_tool("cuobjdump", "-xelf", "all", binary, cwd=out)
        with contextlib.suppress(ToolError):  # no PTX: asked-for PTX is reported missing later
            run_tool("cuobjdump", "-xptx", "all", binary, cwd=out)
        (out / ".done").write_text("ok")
    return out


def _stamp(binary: Path) -> str:
    return _content_stamp(*_file_state(binary))


@lru_cache(maxsize=16)
def _content_stamp(path: str, *state: int) -> str:
    """The binary's content hash, once per file state."""
    h = hashlib.sha1()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _find(binary: Path, kernel: str, arch: str, suffix: str, members: list[Member]) -> Path:
    mine = [m for m in members if m.kernel == kernel]
    if not mine:
        raise ToolError(f"kernel {kernel} is not in {binary.name}; it has: "
                        f"{', '.join(sorted({m.kernel for m in members})) or 'none'}")
    if arch == "90" and is_hopper_name(kernel):
        arch = "90a"  # Hopper-family kernels exist as sm_90a code only: sm_90 names the GPU
    match = [m for m in mine if m.arch == arch]
    if not match:
        what = "PTX" if suffix == "ptx" else "code"
        raise ToolError(f"{binary.name} has no sm_{arch} {what} for {kernel}; it has "
                        f"{', '.join('sm_' + m.arch for m in mine)}")
    return _extracted(str(binary), _stamp(binary)) / match[0].file


def cubin(binary: Path, kernel: str, arch: str) -> Path:
    return _find(binary, kernel, arch, "cubin", list_cubins(binary))


def ptx(binary: Path, kernel: str, arch: str) -> Path:
    return _find(binary, kernel, arch, "ptx", list_ptx(binary))


def extracted_dir(binary: Path) -> Path:
    """The directory holding every cubin and PTX of the binary (cuobjdump, once per content);
    members' `file` names are relative to it."""
    return _extracted(str(binary), _stamp(binary))


def elf_sections(path: Path) -> dict[str, bytes]:
    """{section name: raw contents} of a 64-bit little-endian ELF file, in header order."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ToolError(f"{path} is not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        base = shoff + i * shentsize
        sh_name, = struct.unpack_from("<I", data, base)
        sh_offset, sh_size = struct.unpack_from("<QQ", data, base + 0x18)
        return sh_name, sh_offset, sh_size

    _, str_off, str_size = header(shstrndx)
    names = data[str_off:str_off + str_size]
    out: dict[str, bytes] = {}
    for i in range(shnum):
        sh_name, off, size = header(i)
        end = names.index(b"\0", sh_name)
        out.setdefault(names[sh_name:end].decode(), data[off:off + size])
    return out


def elf_section(path: Path, name: str) -> bytes | None:
    """Raw contents of one section of a 64-bit little-endian ELF file (None if absent)."""
    return elf_sections(path).get(name)


def embedded_ptx(cubin_path: Path) -> str | None:
    """The PTX text ptxas embedded for line info (.nv_debug_ptx_txt, one NUL-terminated line
    after another; line numbers in the SASS line table count these); None if not kept."""
    raw = elf_section(cubin_path, ".nv_debug_ptx_txt")
    if not raw:
        return None
    return "\n".join(part.decode() for part in raw.split(b"\0")[:-1])
