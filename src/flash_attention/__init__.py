"""FlashAttention-2 forward kernels written from scratch.

    import flash_attention as fa
    out = fa.attention(q, k, v)                      # q, k, v: (batch, seq, heads, d_head)
    out, lse = fa.attention(q, k, v, return_lse=True)
    fa.forward("bf16_d128_r128_c64_w4_fseqkvbor", q, k, v)
    fa.available_configs()

Importing works without the compiled extension; a call then says how to build it.
"""

from ._extension import ExtensionNotBuilt, build_info, is_built
from .api import attention, available_configs, forward
from .config import ConfigError, KernelConfig
from .config_sets import SETS, resolve
from .reference import attention_reference, emulate_blocks

__all__ = [
    "SETS",
    "ConfigError",
    "ExtensionNotBuilt",
    "KernelConfig",
    "attention",
    "attention_reference",
    "available_configs",
    "build_info",
    "emulate_blocks",
    "forward",
    "is_built",
    "resolve",
]
