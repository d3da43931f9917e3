"""The Python API: attention(), forward() and available_configs()."""

from __future__ import annotations

from functools import lru_cache

import torch

from . import dispatch
from ._extension import BUILD_HINT, extension
from .config import ConfigError, KernelConfig
from .validation import Problem, check_capability, check_inputs, check_out, check_scale


@lru_cache(maxsize=1)
def _built() -> tuple[KernelConfig, ...]:
    return tuple(KernelConfig.parse(entry["name"]) for entry in extension().kernels())


def available_configs() -> list[KernelConfig]:
    """The kernel configs compiled into this build, in build order."""
    return list(_built())


def _as_config(config: KernelConfig | str) -> KernelConfig:
    if isinstance(config, KernelConfig):
        return config
    if isinstance(config, str):
        return KernelConfig.parse(config)
    raise TypeError(f"config must be a KernelConfig or a short form string, got "
                    f"{type(config).__name__}")


def _resolve_config(config: KernelConfig | str | None, prob: Problem) -> KernelConfig:
    built = list(_built())
    if config is None:
        return dispatch.select(prob.dtype, prob.d_head, prob.seqlen_q, built)
    cfg = _as_config(config)
    if cfg.dtype != prob.dtype or cfg.d_head != prob.d_head:
        raise ConfigError(
            f"config {cfg.short} is for {cfg.dtype} with d_head={cfg.d_head}, but the inputs "
            f"are {prob.dtype} with d_head={prob.d_head}"
        )
    if cfg not in built:
        raise ConfigError(
            f"config {cfg.short} is not in this build (it has {len(built)} kernels); "
            f"rebuild with FLASH_ATTENTION_KERNELS={cfg.short} (comma-separate to add more): "
            f"{BUILD_HINT}"
        )
    return cfg


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    config: KernelConfig | str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * softmax_scale) v, non-causal, FlashAttention-2 forward.

    q: (batch, seqlen_q, heads, d_head); k, v: (batch, seqlen_k, kv_heads, d_head) with
    heads % kv_heads == 0 (GQA/MQA: query head h reads kv head h // (heads // kv_heads)).
    fp16 or bf16 CUDA tensors, d_head 64 or 128, any strides with a contiguous last dimension.
    softmax_scale defaults to 1/sqrt(d_head). With return_lse, also returns the fp32
    log-sum-exp of the scaled scores, shape (batch, heads, seqlen_q). out, if given, receives the
    result. config picks a kernel (KernelConfig or short form); by default dispatch chooses.
    An empty key sequence gives out = 0 and lse = -inf.
    """
    prob = check_inputs(q, k, v)
    scale = check_scale(softmax_scale, prob.d_head)
    if out is not None:
        check_out(out, q)
    check_capability(prob.device)
    cfg = _resolve_config(config, prob)

    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = (
        torch.empty((prob.batch, prob.heads, prob.seqlen_q), dtype=torch.float32, device=q.device)
        if return_lse
        else None
    )
    if prob.batch and prob.seqlen_q and prob.heads:
        if prob.seqlen_k == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
        else:
            extension().forward(cfg.short, q, k, v, out, lse, scale)
    return (out, lse) if return_lse else out


def forward(
    config: KernelConfig | str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one named kernel config (KernelConfig or short form) with the default scale."""
    return attention(q, k, v, out=out, config=_as_config(config))  # type: ignore[return-value]
