"""Named sets of kernel configs.

- ``ci``: what CI builds: at most 6 sm80-family kernels, which together switch every flag on
  and off at least once (masks with both KV orders) and cover both dtypes, d_head 64, 128 and a
  padded variant (160: smem rows of 256, 8 warps), every B_c and both warp counts; and two
  Hopper kernels for sm_90a (every technique with ping-pong; the persistent grid with the dynamic
  tile schedule, dispatched for causal d_head 128), which together switch on every Hopper flag
  but softcap.
- ``default``: what dispatch uses (see :mod:`flash_attention.dispatch`).
- ``tune``: the autotune space: every valid tile shape per dtype and d_head with all
  optimisations on, plus the resident-Q variant where it fits the register budget.
- ``prog``: one config per step of the original 16-step progression (steps that were code-level
  changes with no flag here share the config of the step before; see PROG_STEPS).
- ``all``: the union of the above.

A build selects sets by name or explicit short forms, comma-separated (FLASH_ATTENTION_KERNELS).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

from .config import (
    BLOCK_C,
    BLOCK_R,
    D_HEADS,
    DTYPES,
    WARPS,
    ConfigError,
    KernelConfig,
    parse_config,
)
from .config_sm90 import BLOCK_C as SM90_BLOCK_C
from .config_sm90 import D_HEADS as SM90_D_HEADS
from .config_sm90 import Sm90Config
from .dispatch import DEFAULT_TABLE, SM90_TABLE

P = KernelConfig.parse

CI: tuple[KernelConfig, ...] = (
    P("bf16_d128_r128_c64_w4_fseqkvbor"),  # default long-sequence kernel, bf16
    P("fp16_d128_r128_c64_w4_fseqkvbor"),  # ... and fp16
    P("fp16_d64_r64_c32_w4_fqkv"),  # plain: no swizzle, eager, double buffer, opt softmax, reverse
    P("bf16_d128_r64_c128_w4_fsekvom"),  # resident Q, forward iteration, no double buffer; masks
    P("bf16_d64_r128_c64_w8_fseqbrmt"),  # whole-block K, V, 8 warps, plain softmax; masks, softcap
    P("fp16_d160_r128_c64_w8_fsqkvbo"),  # no eager prefetch; a padded d_head variant, 8 warps
    parse_config("sm90_bf16_d128_c128_g2_s2_fwpoem"),  # Hopper: every technique, masks
    parse_config("sm90_bf16_d128_c128_g2_s2_fwesdqrm"),  # persistent, dynamic schedule, Q in
    # registers, lazy rescale
    parse_config("sm90_bf16_d128_c128_g2_s2_fwesxqr"),  # persistent, CTA pairs multicasting K/V
    parse_config("sm90_bf16_d64_c96_g3_s3_fwesn"),  # 3 consumer warpgroups, tile hand-over
)


def _unique(configs: list[KernelConfig] | tuple[KernelConfig, ...]) -> tuple[KernelConfig, ...]:
    return tuple(dict.fromkeys(configs))


DEFAULT: tuple[KernelConfig | Sm90Config, ...] = _unique(
    [P(short) for rows in DEFAULT_TABLE.values() for _, short in rows]
    + [Sm90Config.parse(short) for rows in SM90_TABLE.values() for _, short in rows]
)


def _tune_space() -> tuple[KernelConfig, ...]:
    out: list[KernelConfig] = []
    for dtype, d, br, bc, w in itertools.product(DTYPES, D_HEADS, BLOCK_R, BLOCK_C, WARPS):
        for slice_q in (True, False):
            with contextlib.suppress(ConfigError):  # the space holds only valid configs
                out.append(KernelConfig(dtype, d, br, bc, w, slice_q=slice_q))
    return tuple(out)


TUNE: tuple[KernelConfig, ...] = _tune_space()


@dataclass(frozen=True)
class ProgStep:
    step: int
    title: str
    config: KernelConfig
    note: str = ""


_BUILT_IN = "code-level change that this kernel always has; same config as the step before"

PROG_STEPS: tuple[ProgStep, ...] = (
    ProgStep(1, "base kernel (resident Q, K/V fragments per slice)", P("bf16_d128_r64_c64_w4_fkv")),
    ProgStep(2, "swizzled shared memory", P("bf16_d128_r64_c64_w4_fskv")),
    ProgStep(3, "eager K/V loading", P("bf16_d128_r64_c64_w4_fsekv")),
    ProgStep(4, "Q fragments interleaved with the MMAs", P("bf16_d128_r64_c64_w4_fseqkv")),
    ProgStep(5, "double-buffered smem->register loads", P("bf16_d128_r64_c64_w4_fseqkvb")),
    ProgStep(6, "fp32 throughput: optimised softmax", P("bf16_d128_r64_c64_w4_fseqkvbo")),
    ProgStep(7, "autotuned tile: B_r=128, B_c=64", P("bf16_d128_r128_c64_w4_fseqkvbo")),
    ProgStep(8, "fewer address instructions", P("bf16_d128_r128_c64_w4_fseqkvbo"), _BUILT_IN),
    ProgStep(9, "fewer register moves", P("bf16_d128_r128_c64_w4_fseqkvbo"), _BUILT_IN),
    ProgStep(10, "peeled first softmax iteration", P("bf16_d128_r128_c64_w4_fseqkvbo"),
             "part of opt_softmax here"),
    ProgStep(11, "precomputed swizzle offsets", P("bf16_d128_r128_c64_w4_fseqkvbo"), _BUILT_IN),
    ProgStep(12, "streamed output stores", P("bf16_d128_r128_c64_w4_fseqkvbo"), _BUILT_IN),
    ProgStep(13, "iterating KV blocks backwards", P("bf16_d128_r128_c64_w4_fseqkvbor")),
    ProgStep(14, "cache configuration", P("bf16_d128_r128_c64_w4_fseqkvbor"), _BUILT_IN),
    ProgStep(15, "64-wide d_head smem tiling", P("bf16_d128_r128_c64_w4_fseqkvbor"), _BUILT_IN),
    ProgStep(16, "runtime strides for any layout", P("bf16_d128_r128_c64_w4_fseqkvbor"), _BUILT_IN),
)


PROG: tuple[KernelConfig, ...] = _unique([s.config for s in PROG_STEPS])

S9 = Sm90Config.parse

# The Hopper progression (FA3's milestones), bf16 d_head 128, B_r 128 (2 consumer warpgroups),
# B_c 128: each step adds one technique flag.
SM90_PROG_STEPS: tuple[ProgStep, ...] = (
    ProgStep(1, "wgmma + TMA, one K/V stage, no warp roles", S9("sm90_bf16_d128_c128_g2_s1_f")),
    ProgStep(2, "+ 2-stage K/V pipeline", S9("sm90_bf16_d128_c128_g2_s2_f")),
    ProgStep(3, "+ producer warpgroup, setmaxnreg", S9("sm90_bf16_d128_c128_g2_s2_fw")),
    ProgStep(4, "+ ping-pong between consumer warpgroups", S9("sm90_bf16_d128_c128_g2_s2_fwp")),
    ProgStep(5, "+ softmax overlapped with P V in a warpgroup",
             S9("sm90_bf16_d128_c128_g2_s2_fwpo")),
    ProgStep(6, "+ epilogue through smem and a TMA store", S9("sm90_bf16_d128_c128_g2_s2_fwpoe")),
)
SM90_PROG: tuple[Sm90Config, ...] = _unique([s.config for s in SM90_PROG_STEPS])


def _sm90_tune_space() -> tuple[Sm90Config, ...]:
    """Hopper tiles per dtype and d_head: every valid (B_c, consumer warpgroups, stages) with
    warp specialisation and the epilogue; each plain, with ping-pong and overlap, with overlap
    alone, and on a persistent grid with and without overlap; each of those as it is and with Q
    in registers and the lazy rescale (the lazy rescale alone where Q does not fit)."""
    combos = ((False, False, False), (True, True, False), (False, True, False),
              (False, False, True), (False, True, True))
    out: list[Sm90Config] = []
    for dtype, d, bc, wgs, stages in itertools.product(DTYPES, SM90_D_HEADS, SM90_BLOCK_C,
                                                      (2, 3), (2, 3)):
        for pingpong, overlap, persistent in combos:
            try:
                base = Sm90Config(dtype, d, bc, wgs, stages, pingpong=pingpong,
                                  overlap=overlap, persistent=persistent)
            except ConfigError:
                continue
            out.append(base)
            try:
                out.append(base.replace(q_regs=True, lazy_rescale=True))
            except ConfigError:
                out.append(base.replace(lazy_rescale=True))
    return tuple(out)


SM90_TUNE: tuple[Sm90Config, ...] = _sm90_tune_space()

SETS: dict[str, tuple[KernelConfig, ...]] = {
    "ci": CI,
    "default": DEFAULT,
    "tune": TUNE,
    "prog": PROG,
    "sm90prog": SM90_PROG,
    "sm90tune": SM90_TUNE,
}
SETS["all"] = _unique(list(itertools.chain.from_iterable(SETS.values())))


def resolve(spec: str) -> tuple[KernelConfig, ...]:
    """Configs named by a comma-separated list of set names and/or short forms, in order,
    without duplicates. Raises ConfigError naming the bad item."""
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise ConfigError("empty kernel selection: name a set "
                          f"({', '.join(SETS)}) or config short forms")
    out: list[KernelConfig] = []
    for item in items:
        if item in SETS:
            out.extend(SETS[item])
        else:
            try:
                out.append(parse_config(item))
            except ConfigError as exc:
                raise ConfigError(f"{exc}; or name a set: {', '.join(SETS)}") from None
    return _unique(out)
