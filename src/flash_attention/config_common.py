"""What the configs of every kernel family (the sm80 forward, the Hopper forward, the sm80
backward) share: the dtypes, the error type, the per-architecture limits the validity rules
check, the occupancy estimate, and :class:`ShortFormConfig`, the short form (flag letters,
parsing, the error that names the format), the check at construction, the rules on the
allowed values of a field and the listing of the flags that are on.

The imports run one way: config_sm90.py (the Hopper family) takes these from here only;
config.py (the sm80 family) takes them from here and Sm90Config from config_sm90.py for
parse_config, which reads a short form of either family; config_bwd.py takes them from here
and the sm80 tile facts from config.py.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar, TypeVar

DTYPES = ("fp16", "bf16")

# Shared-memory limits per architecture: the most one CTA may opt in to, and what one SM has.
SMEM_PER_BLOCK_OPTIN = {80: 163 * 1024, 90: 227 * 1024}
SMEM_PER_SM = {80: 164 * 1024, 90: 228 * 1024}
THREADS_PER_SM = {80: 2048, 90: 2048}
MAX_CTAS_PER_SM = {80: 32, 90: 32}
REGS_PER_SM = 65536


class ConfigError(ValueError):
    """A kernel config that cannot be built, or a short form that does not parse."""


def parse_flags(text: str, letters: str, flags: dict[str, tuple[str, str]]) -> dict[str, bool]:
    """{flag name: on} from the flag letters of a short form; the letters must be a subset of
    the family's letters, in their order."""
    order = "".join(code for code, _ in flags.values())
    it = iter(order)
    if not all(ch in it for ch in letters):  # subsequence check: known letters, in order
        raise ConfigError(f"cannot parse kernel config {text!r}: flags {letters!r} must be a "
                          f"subset of {order!r} in that order")
    return {name: code in letters for name, (code, _) in flags.items()}


def occupancy(threads: int, regs_per_thread: int, smem_per_cta: int,
              arch: int) -> dict[str, int]:
    """Resident CTAs per SM on sm_<arch> and what limits them: registers (allocated per warp in
    units of 256, 8 per thread rounded up), shared memory (smem_per_cta plus 1 KB reserved per
    CTA), threads and the CTA cap; with the warps they give."""
    if arch not in SMEM_PER_SM:
        raise ConfigError(f"unknown architecture sm_{arch}; known: {sorted(SMEM_PER_SM)}")
    regs_alloc = ((max(regs_per_thread, 1) + 7) // 8) * 8
    limits = {
        "by_regs": REGS_PER_SM // (regs_alloc * threads),
        "by_smem": SMEM_PER_SM[arch] // (smem_per_cta + 1024),
        "by_threads": THREADS_PER_SM[arch] // threads,
        "by_cap": MAX_CTAS_PER_SM[arch],
    }
    ctas = max(0, min(limits.values()))
    return {**limits, "ctas": ctas, "warps": ctas * threads // 32}


_Config = TypeVar("_Config", bound="ShortFormConfig")


class ShortFormConfig:
    """Base of the config dataclasses (frozen; boolean flag fields named in FLAGS). A subclass
    sets the class attributes below and defines the property ``short`` (with
    :attr:`flag_letters`) and ``problems()``, every reason the config cannot be built (from
    :meth:`field_problems`)."""

    FLAGS: ClassVar[dict[str, tuple[str, str]]]  # flag field -> (letter, what it changes)
    KIND: ClassVar[str]  # what the errors call a config, e.g. "kernel config"
    SHORT_RE: ClassVar[re.Pattern[str]]  # the short form, with a group "flags"
    SHORT_FORMAT: ClassVar[str]  # the short form for people, e.g. "<fp16|bf16>_d<d_head>..."
    EXAMPLE: ClassVar[str]  # a valid short form

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(f"invalid {self.KIND} {self.short}: " + "; ".join(problems))

    def __str__(self) -> str:
        return self.short

    @property
    def flag_letters(self) -> str:
        """The short form's letters of the flags that are on, in FLAGS order."""
        return "".join(code for name, (code, _) in self.FLAGS.items() if getattr(self, name))

    @property
    def flags_on(self) -> str:
        """The flags that are on, comma-separated, or ``none`` (for describe())."""
        return ",".join(name for name in self.FLAGS if getattr(self, name)) or "none"

    @classmethod
    def match_short(cls, text: str) -> tuple[re.Match[str], dict[str, bool]]:
        """The match of a short form and its flags; ConfigError naming the format if it does
        not parse."""
        m = cls.SHORT_RE.match(text.strip())
        if m is None:
            letters = "".join(code for code, _ in cls.FLAGS.values())
            raise ConfigError(f"cannot parse {cls.KIND} {text!r}: expected {cls.SHORT_FORMAT}, "
                              f"flags a subset of {letters!r} in that order, e.g. {cls.EXAMPLE}")
        return m, parse_flags(text, m["flags"], cls.FLAGS)

    def replace(self: _Config, **changes: Any) -> _Config:
        return dataclasses.replace(self, **changes)

    def field_problems(self, *rules: tuple[Any, ...]) -> list[str]:
        """Every field outside its allowed values, from rules (label, value, allowed) or
        (label, value, allowed, note: said after the allowed values), and every flag that is
        not a bool."""
        out = []
        for label, value, allowed, *note in rules:
            if value not in allowed:
                out.append(f"{label} must be one of {allowed}{''.join(note)}, got {value!r}")
        out += [f"{name} must be a bool" for name in self.FLAGS
                if not isinstance(getattr(self, name), bool)]
        return out
