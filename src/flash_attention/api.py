"""The Python API: attention(), forward() and available_configs().

attention() checks its arguments in Python (clear errors, and the same checks run when
torch.compile or torch.export trace it with fake tensors), then calls the operator
``flash_attention::fwd`` (see ops.py), whose CUDA implementation picks the kernel from the
dispatch table, checks the tensors again and launches. The code between the checks and the
operator call is plain tensor metadata and allocation, so a compiled graph has no break.
"""

from __future__ import annotations

import torch

from . import ops
from ._extension import BUILD_HINT
from .config import ConfigError, KernelConfig
from .masks import canonical_window
from .validation import (
    Problem,
    check_inputs,
    check_no_grad,
    check_out,
    check_scale,
    check_softcap,
    check_window,
)

ops.load()


def available_configs() -> list[KernelConfig]:
    """The kernel configs compiled into this build, in build order."""
    ops.require()
    return list(ops.BUILT)


def _as_config(config: KernelConfig | str) -> KernelConfig:
    if isinstance(config, KernelConfig):
        return config
    if isinstance(config, str):
        return KernelConfig.parse(config)
    raise TypeError(f"config must be a KernelConfig or a short form string, got "
                    f"{type(config).__name__}")


def _explicit_kernel(config: KernelConfig | str, prob: Problem, mask: bool,
                     softcap: bool) -> str:
    """The short form of a config the caller named, after checking it can serve the call."""
    cfg = _as_config(config)
    if cfg.dtype != prob.dtype or cfg.d_head != prob.d_head:
        raise ConfigError(
            f"config {cfg.short} is for {cfg.dtype} with d_head={cfg.d_head}, but the inputs "
            f"are {prob.dtype} with d_head={prob.d_head}"
        )
    if mask and not cfg.mask:
        raise ConfigError(f"config {cfg.short} has no masks (flag m): it cannot run causal or "
                          "windowed attention")
    if cfg.softcap != softcap:
        raise ConfigError(f"config {cfg.short} " + ("applies a softcap (flag t): call it with "
                          "softcap > 0" if cfg.softcap else "has no softcap (flag t)"))
    if cfg.short not in ops.BUILT_NAMES:
        raise ConfigError(
            f"config {cfg.short} is not in this build (it has {len(ops.BUILT_NAMES)} kernels); "
            f"rebuild with FLASH_ATTENTION_KERNELS={cfg.short} (comma-separate to add more): "
            f"{BUILD_HINT}"
        )
    return cfg.short


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    config: KernelConfig | str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(scores) v, FlashAttention-2 forward, scores = q k^T * softmax_scale.

    q: (batch, seqlen_q, heads, d_head); k, v: (batch, seqlen_k, kv_heads, d_head) with
    heads % kv_heads == 0 (GQA/MQA: query head h reads kv head h // (heads // kv_heads)).
    fp16 or bf16 CUDA tensors, d_head 64 or 128, any strides with a contiguous last dimension.

    causal: query i sees keys j <= i + seqlen_k - seqlen_q (aligned bottom-right).
    window_size (left, right): query i sees keys in [i + seqlen_k - seqlen_q - left,
    i + seqlen_k - seqlen_q + right]; -1 leaves a side unbounded; with causal, right = 0.
    softcap > 0: scores become softcap * tanh(scores / softcap) before the softmax.
    A query row that sees no key gives out 0 and lse -inf.
    softmax_scale defaults to 1/sqrt(d_head). With return_lse, also returns the fp32
    log-sum-exp of the scores, shape (batch, heads, seqlen_q). out, if given, receives the
    result. config picks a kernel (KernelConfig or short form); by default dispatch chooses.
    Forward only: inputs that require grad (with grad mode on) are refused.
    """
    prob = check_inputs(q, k, v)
    scale = check_scale(softmax_scale, prob.d_head)
    causal, window = check_window(causal, window_size)
    cap = check_softcap(softcap)
    if out is not None:
        check_out(out, q)
    check_no_grad(q, k, v)
    left, right = canonical_window(causal, window, prob.seqlen_q, prob.seqlen_k)
    kernel = "" if config is None else _explicit_kernel(config, prob, (left, right) != (-1, -1),
                                                         cap > 0)
    ops.require()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = (torch.empty((prob.batch, prob.heads, prob.seqlen_q), dtype=torch.float32,
                       device=q.device) if return_lse else None)
    torch.ops.flash_attention.fwd(q, k, v, out, lse, kernel, scale, left, right, cap)
    return (out, lse) if return_lse else out


def forward(
    config: KernelConfig | str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None = None,
    **options: object,
) -> torch.Tensor:
    """Run one named kernel config (KernelConfig or short form); options are attention()'s
    (causal, window_size, softcap, softmax_scale)."""
    return attention(q, k, v, out=out, config=_as_config(config), **options)  # type: ignore
