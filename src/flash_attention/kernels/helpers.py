"""The helper kernels a main kernel's launch runs around it: templates on the element type alone,
instantiated by every unit of that dtype whose kind launches them.

- The backward (common/backward_common.cuh): both kinds run the preprocess (D, LSE * log2 e,
  the zeroed dQ accumulator); the dQ conversion reads the fp32 accumulator in the order the
  kind's main kernel writes it: bwd_sm80's (``flash::bwd::bwd_convert_dq_kernel``, rows or
  tiles) or bwd_sm90's (``bwd_convert_dq_tiles_kernel``, wgmma-ordered 64-row blocks, sm_90a
  code alone). The Hopper varlen kernels (flag j) run their own pair over the varlen layout
  (``bwd_preprocess_varlen_kernel``, ``bwd_convert_dq_varlen_kernel``: each sequence from a
  multiple of 128 rows of the buffers).
- The decode (sm80/decode_combine.cuh): the split-KV combine (``flash::sm80::
  dec_combine_kernel``), run after a decode kernel whose keys were split over CTAs.

Names: ``<direction>_<family>_<job>_<dtype>``, e.g. ``bwd_sm80_preprocess_bf16``,
``bwd_sm90_convert_dq_bf16``, ``bwd_sm90_preprocess_varlen_bf16``, ``dec_sm80_combine_fp16``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .base import DTYPES, ConfigError, KernelConfig, occupancy

# (family, job) -> threads per CTA; a helper's family is whose code it is compiled as: sm90 for
# a helper of Hopper units alone (sm_90a code, as their main kernels), else sm80 (every arch of
# the build; the preprocess, which Hopper units hold too, among them).
JOBS: dict[tuple[str, str], int] = {("sm80", "preprocess"): 128, ("sm80", "convert_dq"): 256,
                                    ("sm90", "convert_dq"): 256,
                                    ("sm90", "preprocess_varlen"): 128,
                                    ("sm90", "convert_dq_varlen"): 256, ("sm80", "combine"): 128}
# the direction of each job: whose launches run it
DIRECTION_OF_JOB = {"preprocess": "bwd", "convert_dq": "bwd", "combine": "dec",
                    "preprocess_varlen": "bwd", "convert_dq_varlen": "bwd"}
# a main kernel's kind -> the helpers its units hold and its launch runs, in launch order
HELPERS_OF_KIND: dict[str, tuple[tuple[str, str], ...]] = {
    "bwd_sm80": (("sm80", "preprocess"), ("sm80", "convert_dq")),
    "bwd_sm90": (("sm80", "preprocess"), ("sm90", "convert_dq")),
    "dec_sm80": (("sm80", "combine"),),
}
# ... and those of a Hopper varlen backward kernel (flag j), which runs the varlen layout's pair
HELPERS_OF_VARLEN: tuple[tuple[str, str], ...] = (("sm90", "preprocess_varlen"),
                                                  ("sm90", "convert_dq_varlen"))
# the C++ template of each helper (flash::bwd::<name><Elem>, flash::sm80::dec_combine_kernel
# <Elem>), for the SASS tools
TEMPLATES: dict[tuple[str, str], str] = {("sm80", "preprocess"): "bwd_preprocess_kernel",
                                         ("sm80", "convert_dq"): "bwd_convert_dq_kernel",
                                         ("sm90", "convert_dq"): "bwd_convert_dq_tiles_kernel",
                                         ("sm80", "combine"): "dec_combine_kernel",
                                         ("sm90", "preprocess_varlen"):
                                             "bwd_preprocess_varlen_kernel",
                                         ("sm90", "convert_dq_varlen"):
                                             "bwd_convert_dq_varlen_kernel"}
_NAME = re.compile(r"(?P<direction>bwd|dec)_(?P<family>sm80|sm90)"
                   r"_(?P<job>preprocess_varlen|convert_dq_varlen|preprocess|convert_dq|combine)"
                   r"_(?P<dtype>fp16|bf16)")


@dataclass(frozen=True, order=True)
class HelperKernel:
    """One helper kernel of one dtype (see the module docstring)."""

    family: str
    job: str
    dtype: str

    smem_bytes = 0  # no dynamic shared memory

    def __post_init__(self) -> None:
        if (self.family, self.job) not in JOBS or self.dtype not in DTYPES:
            raise ConfigError(f"invalid helper kernel {self.family}/{self.job}/"
                              f"{self.dtype}: helpers {sorted(JOBS)}, dtypes {DTYPES}")

    @property
    def direction(self) -> str:
        return DIRECTION_OF_JOB[self.job]

    @property
    def name(self) -> str:
        return f"{self.direction}_{self.family}_{self.job}_{self.dtype}"

    def __str__(self) -> str:
        return self.name

    @property
    def threads(self) -> int:
        return JOBS[(self.family, self.job)]

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def template(self) -> str:
        return TEMPLATES[(self.family, self.job)]

    @classmethod
    def parse(cls, text: str) -> HelperKernel:
        m = _NAME.fullmatch(text.strip())
        if (m is None or (m["family"], m["job"]) not in JOBS
                or DIRECTION_OF_JOB[m["job"]] != m["direction"]):
            raise ConfigError(f"cannot parse helper kernel {text!r}: expected one of "
                              + ", ".join(f"{DIRECTION_OF_JOB[j]}_{f}_{j}_<fp16|bf16>"
                                          for f, j in JOBS))
        return cls(m["family"], m["job"], m["dtype"])

    @staticmethod
    def matches(text: str) -> bool:
        m = _NAME.fullmatch(text.strip())
        return m is not None and DIRECTION_OF_JOB.get(m["job"]) == m["direction"]

    def occupancy(self, arch: int = 90, regs_per_thread: int | None = None,
                  static_smem: int = 0) -> dict[str, int]:
        """Resident CTAs per SM (no dynamic shared memory; without a measured register count,
        255)."""
        return occupancy(self.threads, regs_per_thread or 255, static_smem, arch)


def helpers_of(config: KernelConfig) -> tuple[HelperKernel, ...]:
    """The helper kernels of a main kernel: what its unit holds beside it and its launch runs
    around it, of its dtype (a backward's preprocess and its kind's dQ conversion, a decode
    kernel's combine; none for a forward kernel; a Hopper varlen backward kernel's varlen
    pair)."""
    jobs = (HELPERS_OF_VARLEN if config.KIND == "bwd_sm90" and getattr(config, "varlen", False)
            else HELPERS_OF_KIND.get(config.KIND, ()))
    return tuple(HelperKernel(f, j, config.dtype) for f, j in jobs)


def helpers(configs: tuple[KernelConfig, ...] | list[KernelConfig]) -> tuple[HelperKernel, ...]:
    """The helper kernels a build of these configs holds: those of each main kernel
    (helpers_of), once, by dtype and then JOBS' order."""
    held = {h for c in configs if isinstance(c, KernelConfig) for h in helpers_of(c)}
    return tuple(h for h in (HelperKernel(f, j, d) for d in DTYPES for f, j in JOBS) if h in held)
