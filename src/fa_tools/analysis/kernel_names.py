"""Kernel symbol names <-> config short forms. The kernels are instantiations of
flash::fwd_kernel<flash::FwdConfig<Elem, D, B_r, B_c, warps, flags...>>; their mangled names
carry every template argument, so any ptxas or disassembler output can be named by config."""

from __future__ import annotations

import re

from flash_attention.codegen import ELEM_TYPES
from flash_attention.config import FLAGS, KernelConfig

_ELEM = {"6__half": "fp16", "13__nv_bfloat16": "bf16"}
_MANGLED = re.compile(
    r"_ZN5flash10fwd_kernelINS_9FwdConfigI(?P<elem>6__half|13__nv_bfloat16)"
    r"Li(?P<d>\d+)ELi(?P<br>\d+)ELi(?P<bc>\d+)ELi(?P<w>\d+)E(?P<flags>(?:Lb[01]E)+)EEEEvNS_9FwdParamsE"
)
assert set(_ELEM.values()) == set(ELEM_TYPES)


def config_of(mangled: str) -> KernelConfig | None:
    """The config of a mangled fwd_kernel symbol, None for any other symbol."""
    m = _MANGLED.search(mangled)
    if m is None:
        return None
    bits = re.findall(r"Lb([01])E", m["flags"])
    if len(bits) != len(FLAGS):
        return None
    flags = {name: bit == "1" for name, bit in zip(FLAGS, bits)}
    return KernelConfig(_ELEM[m["elem"]], int(m["d"]), int(m["br"]), int(m["bc"]), int(m["w"]),
                        **flags)

