"""Code generation of the backward: one .cu file per backward config, plus the backward
registry the operator reads (src/csrc/backward_registry.h), in their own directory
(src/csrc/generated/backward), so the forward's generator and this one never remove each
other's files. Unchanged files are not rewritten; files of configs no longer selected are
removed.

    python -m flash_attention.codegen_bwd --kernels ci --out src/csrc/generated/backward
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from . import codegen_common
from .codegen_common import ELEM_TYPES, HEADER
from .config_bwd import FLAGS, AnyBwdConfig, BwdConfig, Sm90BwdConfig, resolve
from .nvcc_wrapper import ARCH_MARKER

REGISTRY = "bwd_registry.cu"


def template_args(cfg: BwdConfig) -> str:
    """Template arguments of flash::BwdConfig, in its parameter order."""
    args = [ELEM_TYPES[cfg.dtype], str(cfg.d_head), str(cfg.block_c), str(cfg.block_r),
            str(cfg.warps)]
    args += [f"/*{name}=*/{'true' if getattr(cfg, name) else 'false'}" for name in FLAGS]
    return ", ".join(args)


def kernel_source(cfg: AnyBwdConfig) -> str:
    name = cfg.short
    if isinstance(cfg, Sm90BwdConfig):
        args = (f"{ELEM_TYPES[cfg.dtype]}, {cfg.d_head}, "
                f"/*softcap=*/{'true' if cfg.softcap else 'false'}, /*B_r=*/{cfg.block_r}")
        return (
            f"{HEADER}{ARCH_MARKER}\n// {cfg.describe()}\n"
            '#include "sm90/backward_launch.cuh"\n\n'
            "namespace flash {\n\n"
            f"using Cfg_{name} = sm90::Sm90BwdConfig<{args}>;\n\n"
            f"extern const BwdKernelEntry entry_{name} =\n"
            f"    sm90::make_bwd_entry<Cfg_{name}>(\"{name}\");\n\n"
            "}  // namespace flash\n"
        )
    return (
        f"{HEADER}// {cfg.describe()}\n"
        '#include "sm80/backward_launch.cuh"\n\n'
        "namespace flash {\n\n"
        f"using Cfg_{name} = BwdConfig<{template_args(cfg)}>;\n\n"
        f"extern const BwdKernelEntry entry_{name} = make_bwd_entry<Cfg_{name}>(\"{name}\");\n\n"
        "}  // namespace flash\n"
    )


def registry_source(configs: Iterable[AnyBwdConfig]) -> str:
    names = [c.short for c in configs]
    decls = "".join(f"extern const BwdKernelEntry entry_{n};\n" for n in names)
    items = "".join(f"        &entry_{n},\n" for n in names)
    # A zero-length array is not C++: an empty build lists one null entry and a count of 0.
    items = items or "        nullptr,\n"
    return (
        f"{HEADER}// The backward kernels of this build, in selection order.\n"
        '#include "backward_registry.h"\n\n'
        "namespace flash {\n\n"
        f"{decls}\n"
        "const BwdKernelEntry* const* bwd_kernel_registry(int* count) {\n"
        "    static const BwdKernelEntry* const entries[] = {\n"
        f"{items}"
        "    };\n"
        f"    *count = {len(names)};\n"
        "    return entries;\n"
        "}\n\n"
        "}  // namespace flash\n"
    )


def kernel_filename(cfg: AnyBwdConfig) -> str:
    return f"{cfg.short}.cu"


def generate(configs: Iterable[AnyBwdConfig], out_dir: Path) -> list[Path]:
    """Write the per-config sources and the backward registry into out_dir; return the .cu
    paths to compile (kernels first, registry last). An empty selection still writes the
    registry (no kernels: the backward operator then refuses every call)."""
    return codegen_common.generate(list(dict.fromkeys(configs)), out_dir,
                                   kernel_source=kernel_source, kernel_filename=kernel_filename,
                                   registry_source=registry_source, registry_name=REGISTRY,
                                   what="codegen_bwd")


def main(argv: list[str] | None = None) -> int:
    return codegen_common.main(argv, description=__doc__.splitlines()[0],
                               kernels_help="backward set names and/or short forms, "
                                            "comma-separated",
                               default_out=Path("src/csrc/generated/backward"), resolve=resolve,
                               generate=generate)


if __name__ == "__main__":
    raise SystemExit(main())
