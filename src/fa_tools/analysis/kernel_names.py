"""Kernel symbol names <-> config short forms. The kernels are instantiations of
flash::fwd_kernel<flash::FwdConfig<Elem, D, B_r, B_c, warps, flags...>> (sm80 family) and
flash::sm90::fwd_sm90_kernel<flash::sm90::Sm90Config<Elem, D, B_c, WGs, stages, flags...>>
(sm90 family); the backward's are flash::bwd::bwd_kernel<flash::BwdConfig<...>> (sm80-bwd
family), flash::sm90::bwd_sm90_kernel<flash::sm90::Sm90BwdConfig<Elem, D, softcap, B_r>>
(sm90-bwd family, the Hopper backward) and their helpers: flash::bwd::bwd_preprocess_kernel<Elem> of
both, and the dQ conversion, bwd_convert_dq_kernel<Elem> of the sm80 family and
bwd_convert_dq_tiles_kernel<Elem> of the Hopper one (short forms bwd_preprocess_bf16,
bwd_convert_dq_fp16, bwd_convert_dq_tiles_bf16). Their mangled names carry every template
argument, so any ptxas or disassembler output can be named by config."""

from __future__ import annotations

import re
from collections.abc import Iterable

from flash_attention.codegen import ELEM_TYPES
from flash_attention.config import FLAGS, KernelConfig, parse_config
from flash_attention.config_bwd import FLAGS as BWD_FLAGS
from flash_attention.config_bwd import SM90_FLAGS as SM90_BWD_FLAGS
from flash_attention.config_bwd import (
    AnyBwdConfig,
    BwdAuxKernel,
    BwdConfig,
    Sm90BwdConfig,
    aux_kernels_of,
)
from flash_attention.config_bwd import parse_kernel as parse_bwd_kernel
from flash_attention.config_sm90 import FLAGS as SM90_FLAGS
from flash_attention.config_sm90 import Sm90Config

_ELEM = {"6__half": "fp16", "13__nv_bfloat16": "bf16"}
_MANGLED = re.compile(
    r"_ZN5flash10fwd_kernelINS_9FwdConfigI(?P<elem>6__half|13__nv_bfloat16)"
    r"Li(?P<d>\d+)ELi(?P<br>\d+)ELi(?P<bc>\d+)ELi(?P<w>\d+)E(?P<flags>(?:Lb[01]E)+)EEEEvNS_9FwdParamsE"
)
_MANGLED_SM90 = re.compile(
    r"_ZN5flash4sm9015fwd_sm90_kernelINS0_10Sm90ConfigI(?P<elem>6__half|13__nv_bfloat16)"
    r"Li(?P<d>\d+)ELi(?P<bc>\d+)ELi(?P<wgs>\d+)ELi(?P<stages>\d+)E(?P<flags>(?:Lb[01]E)+)"
    r"EEEEvNS0_10Sm90ParamsE"
)
assert set(_ELEM.values()) == set(ELEM_TYPES)


def _flags(m: re.Match, names: tuple[str, ...]) -> dict[str, bool] | None:
    """The bool template arguments of a matched symbol (group "flags": Lb0E/Lb1E, in order)
    as config fields, None if their number is not the config's."""
    bits = re.findall(r"Lb([01])E", m["flags"])
    if len(bits) != len(names):
        return None
    return {name: bit == "1" for name, bit in zip(names, bits)}


def _sm90_config_of(mangled: str) -> Sm90Config | None:
    m = _MANGLED_SM90.search(mangled)
    if m is None:
        return None
    flags = _flags(m, SM90_FLAGS)
    if flags is None:
        return None
    return Sm90Config(_ELEM[m["elem"]], int(m["d"]), int(m["bc"]), int(m["wgs"]),
                      int(m["stages"]), **flags)


_MANGLED_BWD = re.compile(
    r"_ZN5flash3bwd10bwd_kernelINS_9BwdConfigI(?P<elem>6__half|13__nv_bfloat16)"
    r"Li(?P<d>\d+)ELi(?P<bc>\d+)ELi(?P<br>\d+)ELi(?P<w>\d+)E(?P<flags>(?:Lb[01]E)+)"
    r"EEEEvNS_9BwdParamsE"
)


def _bwd_config_of(mangled: str) -> BwdConfig | None:
    """flash::bwd::bwd_kernel<flash::BwdConfig<Elem, D, B_c, B_r, warps, flags...>>."""
    m = _MANGLED_BWD.search(mangled)
    if m is None:
        return None
    flags = _flags(m, BWD_FLAGS)
    if flags is None:
        return None
    return BwdConfig(_ELEM[m["elem"]], int(m["d"]), int(m["bc"]), int(m["br"]), int(m["w"]),
                     **flags)


_MANGLED_SM90_BWD = re.compile(
    r"_ZN5flash4sm9015bwd_sm90_kernelINS0_13Sm90BwdConfigI(?P<elem>6__half|13__nv_bfloat16)"
    r"Li(?P<d>\d+)E(?P<flags>(?:Lb[01]E)+)(?:Li(?P<br>\d+)E)?EEEEvNS0_13Sm90BwdParamsE"
)


def _sm90_bwd_config_of(mangled: str) -> Sm90BwdConfig | None:
    """flash::sm90::bwd_sm90_kernel<flash::sm90::Sm90BwdConfig<Elem, D, softcap, B_r>> (B_c is
    fixed by d_head, not a template argument: Sm90BwdConfig.block_c_for; B_r defaults to 64
    in older builds' names)."""
    m = _MANGLED_SM90_BWD.search(mangled)
    if m is None:
        return None
    flags = _flags(m, SM90_BWD_FLAGS)
    if flags is None:
        return None
    d = int(m["d"])
    return Sm90BwdConfig(_ELEM[m["elem"]], d, block_c=Sm90BwdConfig.block_c_for(d),
                         block_r=int(m["br"] or 64), **flags)


_MANGLED_BWD_AUX = re.compile(
    r"_ZN5flash3bwd\d+bwd_(?P<kind>preprocess|convert_dq_tiles|convert_dq)_kernel"
    r"I(?P<elem>6__half|13__nv_bfloat16)EEvNS_9BwdParamsE"
)

AnyKernel = KernelConfig | Sm90Config | BwdConfig | Sm90BwdConfig | BwdAuxKernel
# The families whose kernels compile for sm_90a alone (wgmma, TMA, setmaxnreg), whatever the
# build's architecture list: the Hopper forward and the Hopper backward (its main kernels and
# the dQ conversion of its units), and the prefixes of their short forms (the main kernels':
# what config.parse_config and config_bwd.parse_config dispatch on).
HOPPER_FAMILIES = ("sm90", "sm90-bwd")
HOPPER_PREFIXES = ("sm90_", "bwd_sm90_", "bwd_convert_dq_tiles_")


def _bwd_aux_of(mangled: str) -> BwdAuxKernel | None:
    m = _MANGLED_BWD_AUX.search(mangled)
    return BwdAuxKernel(m["kind"], _ELEM[m["elem"]]) if m else None


def config_of(mangled: str) -> AnyKernel | None:
    """The config of a mangled kernel symbol of either forward family or the backward (a
    helper kernel's kind and dtype for the preprocess and either family's dQ conversion), None
    for any other symbol."""
    m = _MANGLED.search(mangled)
    if m is None:
        return (_sm90_config_of(mangled) or _bwd_config_of(mangled)
                or _sm90_bwd_config_of(mangled) or _bwd_aux_of(mangled))
    flags = _flags(m, FLAGS)
    if flags is None:
        return None
    return KernelConfig(_ELEM[m["elem"]], int(m["d"]), int(m["br"]), int(m["bc"]), int(m["w"]),
                        **flags)


def short_of(mangled: str) -> str | None:
    """The short form of a mangled kernel symbol, None for any other symbol."""
    cfg = config_of(mangled)
    return cfg.short if cfg is not None else None


def parse_kernel(short: str) -> AnyKernel:
    """Any kernel's short form: forward (sm80 or sm90 family), backward (sm80-bwd or sm90-bwd
    family), backward helper."""
    if short.strip().startswith("bwd_"):
        return parse_bwd_kernel(short)
    return parse_config(short)


def is_hopper(cfg: AnyKernel) -> bool:
    """Whether cfg's kernel exists as sm_90a code alone (HOPPER_FAMILIES)."""
    return cfg.family in HOPPER_FAMILIES


def is_hopper_name(short: str) -> bool:
    """is_hopper by the short form's prefix alone: also for a name this commit's configs do
    not parse (a kernel of the base build the SASS diff compares with)."""
    return short.startswith(HOPPER_PREFIXES)


def archs_of(cfg: AnyKernel, build_archs: list[str],
             bwd_mains: Iterable[AnyBwdConfig] | None = None) -> list[str]:
    """The architectures a build holds code of cfg for: a Hopper-family kernel (forward or
    backward) compiles for sm_90a alone (whatever the build's list), an sm80-family one for
    each of the build's. A backward helper is compiled in every backward unit that holds it
    (config_bwd.aux_kernels_of: the preprocess in the units of its dtype of both families, a
    dQ conversion in those of its family), so it has the architectures of those units' main
    kernels: with bwd_mains (the build's backward main kernels) those of the mains that hold
    it, in the build's order and then sm_90a (where a Hopper backward kernel holding it is
    built); without, its family's (the build's, or sm_90a alone for the Hopper one's)."""
    build = [str(a) for a in build_archs]
    if isinstance(cfg, BwdAuxKernel) and bwd_mains is not None:
        have = {a for m in bwd_mains if cfg in aux_kernels_of(m) for a in archs_of(m, build)}
        return [a for a in dict.fromkeys([*build, "90a"]) if a in have]
    if is_hopper(cfg):
        return ["90a"]
    return build
