"""The C++ template of each kernel kind: what a generated translation unit includes, the config
type it instantiates with which of the config's fields (in the template's parameter order),
the function that makes its registry entry and the registry that lists it. Adding a kernel kind
adds one entry here (and its config module in flash_attention.kernels)."""

from __future__ import annotations

from dataclasses import dataclass

from ..kernels import KINDS, KernelConfig

ELEM_TYPES = {"fp16": "__half", "bf16": "__nv_bfloat16", "e4m3": "__nv_fp8_e4m3",
              "e5m2": "__nv_fp8_e5m2"}


@dataclass(frozen=True)
class Template:
    header: str  # the launcher header the unit includes (plain CUDA, no torch)
    config: str  # the C++ config template
    # config fields in the template's parameter order (dtype: the Elem; cache: the K/V element,
    # q's Elem when the field is "")
    args: tuple[str, ...]
    entry: str  # the function template that makes the registry entry of a config
    registry: str  # "fwd", "bwd" or "dec": the registry (and entry type) that lists the kernel
    sm90a: bool  # the unit compiles for sm_90a alone (nvcc_wrapper.ARCH_MARKER)


def _flags(kind: str) -> tuple[str, ...]:
    return tuple(KINDS[kind].FLAGS)


TEMPLATES: dict[str, Template] = {
    "fwd_sm80": Template("sm80/forward_launch.cuh", "sm80::FwdConfig",
                         ("dtype", "d_head", "block_r", "block_c", "warps", *_flags("fwd_sm80")),
                         "sm80::make_fwd_entry", "fwd", sm90a=False),
    "fwd_sm90": Template("sm90/forward_launch.cuh", "sm90::FwdConfig",
                         ("dtype", "d_head", "block_r", "block_c", "stages", *_flags("fwd_sm90")),
                         "sm90::make_fwd_entry", "fwd", sm90a=True),
    "bwd_sm80": Template("sm80/backward_launch.cuh", "sm80::BwdConfig",
                         ("dtype", "d_head", "block_r", "block_c", "warps", *_flags("bwd_sm80")),
                         "sm80::make_bwd_entry", "bwd", sm90a=False),
    "bwd_sm90": Template("sm90/backward_launch.cuh", "sm90::BwdConfig",
                         ("dtype", "d_head", "block_r", "block_c", *_flags("bwd_sm90")),
                         "sm90::make_bwd_entry", "bwd", sm90a=True),
    "dec_sm80": Template("sm80/decode_launch.cuh", "sm80::DecConfig",
                         ("dtype", "d_head", "block_r", "block_c", "warps", "cache"),
                         "sm80::make_dec_entry", "dec", sm90a=False),
}
assert set(TEMPLATES) == set(KINDS), "every kernel kind needs a template"

# registry -> (its entry type, the function the binding calls), both in registry.h
REGISTRIES = {"fwd": ("FwdKernelEntry", "fwd_kernel_registry"),
              "bwd": ("BwdKernelEntry", "bwd_kernel_registry"),
              "dec": ("DecKernelEntry", "dec_kernel_registry")}


def template_args(cfg: KernelConfig) -> str:
    """The config's C++ template arguments, in the template's parameter order (flags as
    ``/*name=*/true``)."""
    out = []
    for field in TEMPLATES[cfg.KIND].args:
        value = getattr(cfg, field)
        if field == "dtype":
            out.append(ELEM_TYPES[value])
        elif field == "cache":
            out.append(ELEM_TYPES[value or cfg.dtype])
        elif isinstance(value, bool):
            out.append(f"/*{field}=*/{'true' if value else 'false'}")
        else:
            out.append(str(value))
    return ", ".join(out)
