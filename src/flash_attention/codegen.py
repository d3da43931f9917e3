"""Code generation: one .cu file per kernel config, plus the registry the binding reads.

Each generated file instantiates ``flash::FwdConfig`` from a :class:`KernelConfig` and exports
its registry entry; ``registry.cu`` lists the entries of the build. Files whose content is
unchanged are not rewritten, so an unchanged config is not recompiled. Files of configs no
longer selected are removed.

    python -m flash_attention.codegen --kernels ci --out src/csrc/generated
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from . import codegen_common
from .codegen_common import ELEM_TYPES, HEADER
from .config import FLAGS, KernelConfig
from .config_sets import resolve
from .config_sm90 import FLAGS as SM90_FLAGS
from .config_sm90 import Sm90Config
from .nvcc_wrapper import ARCH_MARKER


def template_args(cfg: KernelConfig | Sm90Config) -> str:
    """Template arguments of flash::FwdConfig (or flash::sm90::Sm90Config), in its parameter
    order."""
    if isinstance(cfg, Sm90Config):
        return sm90_template_args(cfg)
    args = [ELEM_TYPES[cfg.dtype], str(cfg.d_head), str(cfg.block_r), str(cfg.block_c),
            str(cfg.warps)]
    args += [f"/*{name}=*/{'true' if getattr(cfg, name) else 'false'}" for name in FLAGS]
    return ", ".join(args)


def sm90_template_args(cfg: Sm90Config) -> str:
    """Template arguments of flash::sm90::Sm90Config, in its parameter order."""
    args = [ELEM_TYPES[cfg.dtype], str(cfg.d_head), str(cfg.block_c), str(cfg.consumer_wgs),
            str(cfg.stages)]
    args += [f"/*{name}=*/{'true' if getattr(cfg, name) else 'false'}" for name in SM90_FLAGS]
    return ", ".join(args)


def kernel_source(cfg: KernelConfig | Sm90Config) -> str:
    name = cfg.short
    if isinstance(cfg, Sm90Config):
        return (
            f"{HEADER}{ARCH_MARKER}\n// {cfg.describe()}\n"
            '#include "sm90/launch.cuh"\n\n'
            "namespace flash {\n\n"
            f"using Cfg_{name} = sm90::Sm90Config<{sm90_template_args(cfg)}>;\n\n"
            f"extern const KernelEntry entry_{name} = sm90::make_entry<Cfg_{name}>(\"{name}\");\n\n"
            "}  // namespace flash\n"
        )
    return (
        f"{HEADER}// {cfg.describe()}\n"
        '#include "sm80/launch.cuh"\n\n'
        "namespace flash {\n\n"
        f"using Cfg_{name} = FwdConfig<{template_args(cfg)}>;\n\n"
        f"extern const KernelEntry entry_{name} = make_entry<Cfg_{name}>(\"{name}\");\n\n"
        "}  // namespace flash\n"
    )


def registry_source(configs: Iterable[KernelConfig]) -> str:
    names = [c.short for c in configs]
    decls = "".join(f"extern const KernelEntry entry_{n};\n" for n in names)
    items = "".join(f"        &entry_{n},\n" for n in names)
    return (
        f"{HEADER}// The kernels of this build, in selection order.\n"
        '#include "registry.h"\n\n'
        "namespace flash {\n\n"
        f"{decls}\n"
        "const KernelEntry* const* kernel_registry(int* count) {\n"
        "    static const KernelEntry* const entries[] = {\n"
        f"{items}"
        "    };\n"
        f"    *count = {len(names)};\n"
        "    return entries;\n"
        "}\n\n"
        "}  // namespace flash\n"
    )


def kernel_filename(cfg: KernelConfig) -> str:
    return f"fwd_{cfg.short}.cu"


def generate(configs: Iterable[KernelConfig | Sm90Config], out_dir: Path) -> list[Path]:
    """Write the per-config sources and the registry into out_dir; return the .cu paths to
    compile (kernels first, registry last)."""
    configs = list(dict.fromkeys(configs))
    if not configs:
        raise ValueError("no kernel configs selected")
    return codegen_common.generate(configs, out_dir, kernel_source=kernel_source,
                                   kernel_filename=kernel_filename,
                                   registry_source=registry_source, registry_name="registry.cu",
                                   what="codegen")


def main(argv: list[str] | None = None) -> int:
    return codegen_common.main(argv, description=__doc__.splitlines()[0],
                               kernels_help="set names and/or config short forms, comma-separated",
                               default_out=Path("src/csrc/generated"), resolve=resolve,
                               generate=generate)


if __name__ == "__main__":
    raise SystemExit(main())
