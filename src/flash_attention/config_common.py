"""What the configs of both kernel families share: the dtypes, the error type, the parsing of a
short form's flag letters and the per-architecture limits the validity rules check.

The imports run one way: config_sm90.py (the Hopper family) takes these from here only;
config.py (the sm80 family) takes them from here and Sm90Config from config_sm90.py for
parse_config, which reads a short form of either family.
"""

from __future__ import annotations

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
