"""Kernel symbol names <-> kernel names. Each kind's kernels are instantiations of one kernel
template over its config template (flash_attention.codegen.templates says which config fields
the config template takes, in order); their mangled names carry every template argument, so
any ptxas or disassembler output can be named by config. The backward's helper kernels are
``flash::bwd::<template><Elem>`` (kernels.helpers.TEMPLATES). Symbols of builds from before
the one name scheme (an older base the gate's SASS diff compares with) are named by their
current names too."""

from __future__ import annotations

import re
from collections.abc import Iterable

from flash_attention.codegen.templates import ELEM_TYPES, TEMPLATES
from flash_attention.kernels import KINDS, HelperKernel, KernelConfig, parse_kernel
from flash_attention.kernels.helpers import TEMPLATES as HELPER_TEMPLATES
from flash_attention.kernels.helpers import helpers_of

_ELEM = {"6__half": "fp16", "13__nv_bfloat16": "bf16", "13__nv_fp8_e4m3": "e4m3",
         "13__nv_fp8_e5m2": "e5m2"}
assert set(_ELEM.values()) == set(ELEM_TYPES)

# The mangled kernel template applied to each kind's config template, up to the config's
# template arguments: (prefix, kind, the config fields of those arguments in order). The kernel
# of kind <direction>_<family> is flash::<family>::<direction>_kernel<flash::<family>::
# <Direction>Config<...>>.
_SYMBOLS: tuple[tuple[str, str, tuple[str, ...]], ...] = tuple(
    (f"_ZN5flash4{kind[4:]}10{kind[:3]}_kernelINS0_9{kind[:3].title()}ConfigI", kind, t.args)
    for kind, t in TEMPLATES.items())
# The same before the one name scheme (commit 71ab9ec and earlier): an older base build.
_OLD_SYMBOLS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("_ZN5flash10fwd_kernelINS_9FwdConfigI", "fwd_sm80", TEMPLATES["fwd_sm80"].args),
    ("_ZN5flash4sm9015fwd_sm90_kernelINS0_10Sm90ConfigI", "fwd_sm90",
     ("dtype", "d_head", "block_c", "consumer_wgs", "stages",
      *(f for f in KINDS["fwd_sm90"].FLAGS if f not in ("varlen", "exp2_fma")))),
    ("_ZN5flash3bwd10bwd_kernelINS_9BwdConfigI", "bwd_sm80",
     ("dtype", "d_head", "block_c", "block_r", "warps", *KINDS["bwd_sm80"].FLAGS)),
    ("_ZN5flash4sm9015bwd_sm90_kernelINS0_13Sm90BwdConfigI", "bwd_sm90",
     ("dtype", "d_head", "softcap", "block_r")),
)
# Flags a kind's config template gained after builds the gate's SASS diff may still compare
# with, newest first: a symbol n arguments short is of a build from before the newest n.
_LATER_FLAGS = {"fwd_sm90": ("exp2_fma", "varlen"), "bwd_sm90": ("varlen",)}
# A type argument that repeats an earlier one is a substitution (S<n>_): the decode kernels'
# cache element when it is q's (DecConfig<__nv_bfloat16, ..., __nv_bfloat16>).
_ARG = re.compile(r"(?P<elem>6__half|13__nv_bfloat16|13__nv_fp8_e4m3|13__nv_fp8_e5m2)"
                  r"|Li(?P<int>\d+)E|Lb(?P<bool>[01])E|(?P<sub>S\d*_)")
SAME_TYPE = "="  # _args' value of a substitution
_HELPER = re.compile(r"_ZN5flash(?:3bwd|4sm80)\d+(?P<template>\w+?_kernel)"
                     r"I(?P<elem>6__half|13__nv_bfloat16)EEvNS_9(?:Bwd|Dec)ParamsE")


def _args(mangled: str, start: int) -> list[str | int | bool] | None:
    """The template arguments of the config from `start` up to its closing E, None if they do
    not parse."""
    out: list[str | int | bool] = []
    pos = start
    while pos < len(mangled) and mangled[pos] != "E":
        m = _ARG.match(mangled, pos)
        if m is None:
            return None
        out.append(_ELEM[m["elem"]] if m["elem"] else int(m["int"]) if m["int"] is not None
                   else SAME_TYPE if m["sub"] else m["bool"] == "1")
        pos = m.end()
    return out


def _fields(kind: str, names: tuple[str, ...], values: list) -> dict | None:
    """Config fields from template arguments; an old build's derived arguments (the Hopper
    forward's consumer warpgroups, the Hopper backward's B_c) turned into fields."""
    old_bwd_sm90 = kind == "bwd_sm90" and "block_c" not in names
    later = _LATER_FLAGS.get(kind, ())
    for n in range(1, len(later) + 1):  # a build from before flag u (and j)
        if len(values) == len(names) - n and set(later[:n]) <= set(names):
            names = tuple(f for f in names if f not in later[:n])
            break
    fixed = {}
    if kind == "dec_sm80" and len(values) < len(names):
        # a decode build from before B_r was an argument (16 packed rows), and before that
        # from before FP8 caches
        names = tuple(n for n in names if n != "block_r")[:len(values)]
        fixed = {"block_r": 16}
    if len(values) not in (len(names), len(names) - old_bwd_sm90):  # a template of another
        return None
    fields = {**fixed, **dict(zip(names, values))}
    if "cache" in fields and fields["cache"] in (SAME_TYPE, fields.get("dtype")):
        fields["cache"] = ""  # K and V of q's dtype
    if "consumer_wgs" in fields:
        fields["block_r"] = 64 * fields.pop("consumer_wgs")
    if old_bwd_sm90:
        fields.setdefault("block_r", 64)  # builds whose template had no B_r ran B_r 64
        fields["block_c"] = KINDS[kind].Config.block_c_for(fields["d_head"])
    if set(fields) - {"dtype", *KINDS[kind].Config.__dataclass_fields__}:
        return None
    return fields


def config_of(mangled: str) -> KernelConfig | HelperKernel | None:
    """The config of a mangled kernel symbol of any kind (a helper kernel's for the backward's
    helpers), None for any other symbol."""
    for prefix, kind, names in (*_SYMBOLS, *_OLD_SYMBOLS):
        at = mangled.find(prefix)
        if at < 0:
            continue
        values = _args(mangled, at + len(prefix))
        fields = _fields(kind, names, values) if values is not None else None
        if fields is None:
            return None
        try:
            return KINDS[kind].Config(**fields)
        except (TypeError, ValueError):
            return None
    m = _HELPER.search(mangled)
    if m is None:
        return None
    job = next((k for k, t in HELPER_TEMPLATES.items() if t == m["template"]), None)
    return HelperKernel(*job, _ELEM[m["elem"]]) if job else None


def short_of(mangled: str) -> str | None:
    """The kernel name of a mangled kernel symbol, None for any other symbol."""
    cfg = config_of(mangled)
    return cfg.name if cfg is not None else None


AnyKernel = KernelConfig | HelperKernel
# Kernels compiled for sm_90a alone (wgmma, TMA, setmaxnreg), whatever the build's architecture
# list: the Hopper kinds and the Hopper backward's dQ conversion, by their names' prefix.
HOPPER_PREFIXES = ("fwd_sm90_", "bwd_sm90_")


def is_hopper(cfg: AnyKernel) -> bool:
    """Whether cfg's kernel exists as sm_90a code alone."""
    return cfg.family == "sm90"


def is_hopper_name(name: str) -> bool:
    """is_hopper by the name's prefix alone: also for a name this commit's configs do not parse
    (a kernel of the base build the SASS diff compares with)."""
    return name.startswith(HOPPER_PREFIXES)


def archs_of(cfg: AnyKernel, build_archs: list[str],
             mains: Iterable[KernelConfig] | None = None) -> list[str]:
    """The architectures a build holds code of cfg for: a Hopper kernel compiles for sm_90a
    alone (whatever the build's list), an sm80-family one for each of the build's. A helper
    kernel is compiled in every unit that holds it (helpers.helpers_of: the preprocess in the
    backward units of its dtype of both kinds, a dQ conversion in those of its kind, the
    combine in the decode units of its dtype), so it has the architectures of those units'
    main kernels: with mains (the build's main kernels) those of the mains that hold it, in
    the build's order and then sm_90a (where a Hopper kernel holding it is built); without,
    its family's (the build's, or sm_90a alone for the Hopper one's)."""
    build = [str(a) for a in build_archs]
    if isinstance(cfg, HelperKernel) and mains is not None:
        have = {a for m in mains if cfg in helpers_of(m) for a in archs_of(m, build)}
        return [a for a in dict.fromkeys([*build, "90a"]) if a in have]
    if is_hopper(cfg):
        return ["90a"]
    return build


__all__ = ["AnyKernel", "archs_of", "config_of", "is_hopper", "is_hopper_name", "parse_kernel",
           "short_of"]
