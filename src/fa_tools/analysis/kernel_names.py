"""Kernel symbol names <-> config short forms. The kernels are instantiations of
flash::fwd_kernel<flash::FwdConfig<Elem, D, B_r, B_c, warps, flags...>> (sm80 family) and
flash::sm90::fwd_sm90_kernel<flash::sm90::Sm90Config<Elem, D, B_c, WGs, stages, flags...>>
(sm90 family); the backward's are flash::bwd::bwd_kernel<flash::BwdConfig<...>> and its two
helpers flash::bwd::bwd_preprocess_kernel<Elem> and bwd_convert_dq_kernel<Elem> (short forms
bwd_preprocess_bf16, bwd_convert_dq_fp16). Their mangled names carry every template argument,
so any ptxas or disassembler output can be named by config."""

from __future__ import annotations

import re

from flash_attention.codegen import ELEM_TYPES
from flash_attention.config import FLAGS, KernelConfig, parse_config
from flash_attention.config_bwd import FLAGS as BWD_FLAGS
from flash_attention.config_bwd import BwdAuxKernel, BwdConfig
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


def _sm90_config_of(mangled: str) -> Sm90Config | None:
    m = _MANGLED_SM90.search(mangled)
    if m is None:
        return None
    bits = re.findall(r"Lb([01])E", m["flags"])
    if len(bits) != len(SM90_FLAGS):
        return None
    flags = {name: bit == "1" for name, bit in zip(SM90_FLAGS, bits)}
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
    bits = re.findall(r"Lb([01])E", m["flags"])
    if len(bits) != len(BWD_FLAGS):
        return None
    flags = {name: bit == "1" for name, bit in zip(BWD_FLAGS, bits)}
    return BwdConfig(_ELEM[m["elem"]], int(m["d"]), int(m["bc"]), int(m["br"]), int(m["w"]),
                     **flags)


_MANGLED_BWD_AUX = re.compile(
    r"_ZN5flash3bwd\d+bwd_(?P<kind>preprocess|convert_dq)_kernelI(?P<elem>6__half|13__nv_bfloat16)"
    r"EEvNS_9BwdParamsE"
)

AnyKernel = KernelConfig | Sm90Config | BwdConfig | BwdAuxKernel


def _bwd_aux_of(mangled: str) -> BwdAuxKernel | None:
    m = _MANGLED_BWD_AUX.search(mangled)
    return BwdAuxKernel(m["kind"], _ELEM[m["elem"]]) if m else None


def config_of(mangled: str) -> AnyKernel | None:
    """The config of a mangled kernel symbol of either forward family or the backward (a
    helper kernel's kind and dtype for the preprocess and the dQ conversion), None for any
    other symbol."""
    m = _MANGLED.search(mangled)
    if m is None:
        return _sm90_config_of(mangled) or _bwd_config_of(mangled) or _bwd_aux_of(mangled)
    bits = re.findall(r"Lb([01])E", m["flags"])
    if len(bits) != len(FLAGS):
        return None
    flags = {name: bit == "1" for name, bit in zip(FLAGS, bits)}
    return KernelConfig(_ELEM[m["elem"]], int(m["d"]), int(m["br"]), int(m["bc"]), int(m["w"]),
                        **flags)


def short_of(mangled: str) -> str | None:
    """The short form of a mangled kernel symbol, None for any other symbol."""
    cfg = config_of(mangled)
    return cfg.short if cfg is not None else None


def parse_kernel(short: str) -> AnyKernel:
    """Any kernel's short form: forward (sm80 or sm90 family), backward, backward helper."""
    if short.strip().startswith("bwd_"):
        return parse_bwd_kernel(short)
    return parse_config(short)


def archs_of(cfg: AnyKernel, build_archs: list[str]) -> list[str]:
    """The architectures a build holds code of cfg for: an sm90 kernel compiles for sm_90a
    alone (whatever the build's list), an sm80 one for each of the build's."""
    return ["90a"] if cfg.family == "sm90" else [str(a) for a in build_archs]
