"""Kernel names before the one name scheme (commit 71ab9ec and earlier) and the names they have
now. The old scheme named each family its own way (``bf16_d128_r128_c64_w4_fseqkvbor``,
``sm90_bf16_d128_c128_g2_s2_fwpoe``, ``bwd_bf16_d128_c128_r64_w8_fb``,
``bwd_sm90_bf16_d128_c128_r64_f``, ``bwd_convert_dq_tiles_bf16``), with c before r in the
backward's and flag letters that changed meaning between families; every name now starts with
its kind and reads d, r, c (see base.py). :func:`current_name` maps an old name to its new one,
so tuning files, recorded histories and base builds of the gate compare like with like.

Standalone on purpose (the standard library only): the asv benchmarks load this file by path
when the commit they measure predates it. docs/kernel-names.md is the table of old and new
names (tests/test_kernel_name_table.py keeps it current).
"""

from __future__ import annotations

import re

# Hopper forward: old flag letter -> new (same order: the fields' order did not change)
_SM90_FWD_LETTERS = {"w": "w", "p": "p", "o": "i", "e": "a", "s": "l", "d": "d", "x": "x",
                     "n": "n", "q": "g", "r": "z", "m": "m", "t": "t"}
_SM80_BWD_LETTERS = {"b": "h", "t": "t"}

_DT = r"(?P<dt>fp16|bf16)"
_OLD_FORMS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(rf"{_DT}_d(?P<d>\d+)_r(?P<r>\d+)_c(?P<c>\d+)_w(?P<w>\d+)_f(?P<f>[a-z]*)"),
     "fwd_sm80"),
    (re.compile(rf"sm90_{_DT}_d(?P<d>\d+)_c(?P<c>\d+)_g(?P<g>\d+)_s(?P<s>\d+)_f(?P<f>[a-z]*)"),
     "fwd_sm90"),
    (re.compile(rf"bwd_sm90_{_DT}_d(?P<d>\d+)_c(?P<c>\d+)_r(?P<r>\d+)_f(?P<f>[a-z]*)"),
     "bwd_sm90"),
    (re.compile(rf"bwd_{_DT}_d(?P<d>\d+)_c(?P<c>\d+)_r(?P<r>\d+)_w(?P<w>\d+)_f(?P<f>[a-z]*)"),
     "bwd_sm80"),
    (re.compile(rf"bwd_(?P<aux>preprocess|convert_dq_tiles|convert_dq)_{_DT}"), "aux"),
)
_AUX = {"preprocess": "bwd_sm80_preprocess", "convert_dq": "bwd_sm80_convert_dq",
        "convert_dq_tiles": "bwd_sm90_convert_dq"}


def _new(kind: str, m: re.Match[str]) -> str:
    if kind == "fwd_sm80":
        return f"fwd_sm80_{m['dt']}_d{m['d']}_r{m['r']}_c{m['c']}_w{m['w']}_f{m['f']}"
    if kind == "fwd_sm90":
        flags = "".join(_SM90_FWD_LETTERS[ch] for ch in m["f"])
        return (f"fwd_sm90_{m['dt']}_d{m['d']}_r{64 * int(m['g'])}_c{m['c']}_s{m['s']}"
                f"_f{flags}")
    if kind == "bwd_sm80":
        flags = "".join(_SM80_BWD_LETTERS[ch] for ch in m["f"])
        return f"bwd_sm80_{m['dt']}_d{m['d']}_r{m['r']}_c{m['c']}_w{m['w']}_f{flags}"
    if kind == "bwd_sm90":
        return f"bwd_sm90_{m['dt']}_d{m['d']}_r{m['r']}_c{m['c']}_f{m['f']}"
    return f"{_AUX[m['aux']]}_{m['dt']}"


def old_form(name: str) -> tuple[str, re.Match[str]] | None:
    """(kind, match) when name is a whole kernel name of the old scheme, else None."""
    for pattern, kind in _OLD_FORMS:
        m = pattern.fullmatch(name.strip())
        if m is not None and all(ch in _letters(kind) for ch in m.groupdict().get("f") or ""):
            return kind, m
    return None


def _letters(kind: str) -> str:
    if kind == "fwd_sm90":
        return "".join(_SM90_FWD_LETTERS)
    if kind == "bwd_sm80":
        return "".join(_SM80_BWD_LETTERS)
    return "abcdefghijklmnopqrstuvwxyz"


def current_name(name: str) -> str:
    """The name a kernel has now: an old-scheme name translated, any other name as it is."""
    found = old_form(name)
    return _new(*found) if found else name.strip()


_NEW_FORMS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(rf"fwd_sm80_(?P<rest>{_DT}_d\d+_r\d+_c\d+_w\d+_f[a-z]*)"), "fwd_sm80"),
    (re.compile(rf"fwd_sm90_{_DT}_d(?P<d>\d+)_r(?P<r>\d+)_c(?P<c>\d+)_s(?P<s>\d+)_f(?P<f>[a-z]*)"),
     "fwd_sm90"),
    (re.compile(rf"bwd_sm80_{_DT}_d(?P<d>\d+)_r(?P<r>\d+)_c(?P<c>\d+)_w(?P<w>\d+)_f(?P<f>[a-z]*)"),
     "bwd_sm80"),
    (re.compile(rf"bwd_sm90_{_DT}_d(?P<d>\d+)_r(?P<r>\d+)_c(?P<c>\d+)_f(?P<f>[a-z]*)"), "bwd_sm90"),
    (re.compile(rf"(?P<helper>bwd_sm80_preprocess|bwd_sm80_convert_dq|bwd_sm90_convert_dq)_{_DT}"),
     "helper"),
)


def old_name(name: str) -> str | None:
    """The name a kernel had in the old scheme (the inverse of current_name), None for a name
    of neither scheme or with a flag newer than the old scheme (varlen, j)."""
    for pattern, kind in _NEW_FORMS:
        m = pattern.fullmatch(name.strip())
        if m is None:
            continue
        if kind == "fwd_sm80":
            return m["rest"]
        if kind == "fwd_sm90":
            letters = {new: old for old, new in _SM90_FWD_LETTERS.items()}
            if not all(ch in letters for ch in m["f"]):
                return None
            flags = "".join(letters[ch] for ch in m["f"])
            return (f"sm90_{m['dt']}_d{m['d']}_c{m['c']}_g{int(m['r']) // 64}_s{m['s']}"
                    f"_f{flags}")
        if kind == "bwd_sm80":
            letters = {new: old for old, new in _SM80_BWD_LETTERS.items()}
            flags = "".join(letters[ch] for ch in m["f"])
            return f"bwd_{m['dt']}_d{m['d']}_c{m['c']}_r{m['r']}_w{m['w']}_f{flags}"
        if kind == "bwd_sm90":
            if "j" in m["f"]:  # varlen (flag j) came after the old scheme
                return None
            return f"bwd_sm90_{m['dt']}_d{m['d']}_c{m['c']}_r{m['r']}_f{m['f']}"
        return "_".join(["bwd", {v: k for k, v in _AUX.items()}[m["helper"]], m["dt"]])
    return name.strip() if old_form(name) else None


# A word of a text that may be a kernel name (not the tail of a new name: those follow an "_").
_TOKEN = re.compile(r"(?<![A-Za-z0-9_])[a-z0-9_]+(?![A-Za-z0-9_])")


def rename_in_text(text: str) -> str:
    """text with every old kernel name (a whole token) replaced by its current name."""
    return _TOKEN.sub(lambda m: current_name(m[0]) if old_form(m[0]) else m[0], text)


def main(argv: list[str] | None = None) -> int:
    """``python -m flash_attention.kernels rewrite FILE...``: old kernel names in files
    (tuning files, scripts, pins) replaced by their current names, in place; ``name OLD...``:
    the current name of each."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description="kernel names of the old scheme -> now")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("rewrite", help="replace old names in files, in place")
    p.add_argument("files", nargs="+", type=Path)
    p = sub.add_parser("name", help="print the current name of each old one")
    p.add_argument("names", nargs="+")
    args = parser.parse_args(argv)
    if args.cmd == "name":
        for name in args.names:
            print(f"{name} -> {current_name(name)}")
        return 0
    for path in args.files:
        text = path.read_text()
        new = rename_in_text(text)
        if new != text:
            path.write_text(new)
            print(f"{path}: renamed")
    return 0
