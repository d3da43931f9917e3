"""FlashAttention forward and backward written from scratch, in two kernel families: the sm80
family (mma.sync, cp.async, ldmatrix; any GPU from sm_80) and the Hopper family (wgmma, TMA,
warp specialization; sm_90a). Fixed-length and varlen (packed) batches; the backward runs
through autograd when q, k or v requires grad; decoding over a KV cache (contiguous or paged,
split-KV) runs on the sm80 family's decode kernels (flash_attention.kvcache).

    import flash_attention as fa
    out = fa.attention(q, k, v)                      # q, k, v: (batch, seq, heads, d_head)
    out = fa.attention(q, k, v, causal=True)         # or window_size=(left, right), softcap=c
    out, lse = fa.attention(q, k, v, return_lse=True)
    from flash_attention.interface import flash_attn_func   # flash_attn's API
    from flash_attention.interface import flash_attn_with_kvcache   # decoding, a KV cache
    fa.forward("fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor", q, k, v)  # a named kernel
    fa.forward("fwd_sm90_bf16_d128_r128_c128_s2_fwpia", q, k, v)     # a Hopper one (sm_90a)
    fa.available_configs()

Importing works without the compiled extension (a call then says how to build it) and without
importing torch: the kernel configs (flash_attention.kernels), dispatch and the build's code
generation (flash_attention.codegen) are plain Python, and the torch-facing names below load on
first use.
"""

from importlib import import_module

from .kernels import ConfigError, KernelConfig, parse, resolve

_LAZY = {
    "attention": "api",
    "attention_varlen": "api",
    "forward": "api",
    "available_configs": "api",
    "flash_attn_func": "interface",
    "flash_attn_qkvpacked_func": "interface",
    "flash_attn_kvpacked_func": "interface",
    "flash_attn_varlen_func": "interface",
    "flash_attn_with_kvcache": "interface",
    "check_kvcache": "kvcache",
    "kvcache_errors": "kvcache",
    "attention_reference": "reference",
    "emulate_blocks": "reference",
    "kvcache_reference": "reference",
    "ExtensionNotBuilt": "_extension",
    "build_info": "_extension",
    "is_built": "_extension",
    "dispatch": None,
    "kernels": None,
    "api": None,
}

__all__ = ["ConfigError", "KernelConfig", "kernels", "parse", "resolve", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'flash_attention' has no attribute {name!r}")
    module = _LAZY[name]
    value = (import_module(f".{name}", __name__) if module is None
             else getattr(import_module(f".{module}", __name__), name))
    globals()[name] = value
    return value
