"""Code generation of the backward: one .cu file per backward config, plus the backward
registry the operator reads (src/csrc/backward_registry.h), in their own directory
(src/csrc/generated/backward), so the forward's generator and this one never remove each
other's files. Unchanged files are not rewritten; files of configs no longer selected are
removed.

    python -m flash_attention.codegen_bwd --kernels ci --out src/csrc/generated/backward
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterable
from pathlib import Path

from .codegen import ELEM_TYPES, HEADER, _write_if_changed
from .config_bwd import FLAGS, BwdConfig, resolve

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
REGISTRY = "bwd_registry.cu"


def template_args(cfg: BwdConfig) -> str:
    """Template arguments of flash::BwdConfig, in its parameter order."""
    args = [ELEM_TYPES[cfg.dtype], str(cfg.d_head), str(cfg.block_c), str(cfg.block_r),
            str(cfg.warps)]
    args += [f"/*{name}=*/{'true' if getattr(cfg, name) else 'false'}" for name in FLAGS]
    return ", ".join(args)


def kernel_source(cfg: BwdConfig) -> str:
    name = cfg.short
    return (
        f"{HEADER}// {cfg.describe()}\n"
        '#include "sm80/backward_launch.cuh"\n\n'
        "namespace flash {\n\n"
        f"using Cfg_{name} = BwdConfig<{template_args(cfg)}>;\n\n"
        f"extern const BwdKernelEntry entry_{name} = make_bwd_entry<Cfg_{name}>(\"{name}\");\n\n"
        "}  // namespace flash\n"
    )


def registry_source(configs: Iterable[BwdConfig]) -> str:
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


def kernel_filename(cfg: BwdConfig) -> str:
    return f"{cfg.short}.cu"


def generate(configs: Iterable[BwdConfig], out_dir: Path) -> list[Path]:
    """Write the per-config sources and the backward registry into out_dir; return the .cu
    paths to compile (kernels first, registry last). An empty selection still writes the
    registry (no kernels: the backward operator then refuses every call)."""
    configs = list(dict.fromkeys(configs))
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = {kernel_filename(c) for c in configs} | {REGISTRY, MANIFEST}
    for stale in out_dir.glob("*"):
        if stale.is_file() and stale.name not in wanted:
            stale.unlink()
    paths = []
    changed = 0
    for cfg in configs:
        path = out_dir / kernel_filename(cfg)
        changed += _write_if_changed(path, kernel_source(cfg))
        paths.append(path)
    registry = out_dir / REGISTRY
    changed += _write_if_changed(registry, registry_source(configs))
    paths.append(registry)
    _write_if_changed(out_dir / MANIFEST,
                      json.dumps({"configs": [c.short for c in configs]}, indent=1) + "\n")
    log.info("codegen_bwd: %d backward configs, %d files rewritten in %s", len(configs), changed,
             out_dir)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="default",
                        help="backward set names and/or short forms, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("src/csrc/generated/backward"))
    parser.add_argument("--list", action="store_true", help="only print the selected configs")
    args = parser.parse_args(argv)
    configs = resolve(args.kernels)
    if args.list:
        for cfg in configs:
            print(cfg.describe())
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in generate(configs, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
