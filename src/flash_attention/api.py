"""The Python API: attention(), attention_varlen(), forward() and available_configs().

A call is one operator call, ``flash_attention::attention`` (see ops.py), whose CUDA
implementation checks every argument, allocates the outputs, picks the kernel from the dispatch
table and launches: no per-call Python work beyond the call itself. When it fails, the Python
checks run to raise the error that names the argument (TypeError / ValueError); under
torch.compile, torch.export or FakeTensorMode the same checks run in the operator's fake
implementation, so tracing fails where running would, and the graph has no break.
"""

from __future__ import annotations

import logging

import torch

from . import ops
from ._extension import BUILD_HINT
from .kernels import ConfigError, KernelConfig, parse
from .masks import canonical_window
from .validation import (
    Problem,
    check_inputs,
    check_no_grad,
    check_out,
    check_scale,
    check_softcap,
    check_varlen_inputs,
    check_window,
    needs_grad,
)

ops.load()
log = logging.getLogger(__name__)


def available_configs() -> list[KernelConfig]:
    """The kernel configs compiled into this build, in build order."""
    ops.require()
    return list(ops.BUILT)


def _as_config(config: KernelConfig | str) -> KernelConfig:
    """A forward kernel's config, from a config or its name."""
    if isinstance(config, str):
        config = parse(config)
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a kernel config or a kernel name, got "
                        f"{type(config).__name__}")
    if config.direction != "fwd":
        raise ConfigError(f"{config.name} is a {config.KIND} kernel; attention() and forward() "
                          "run forward kernels (fwd_sm80_..., fwd_sm90_...)")
    return config


def _explicit_kernel(config: KernelConfig | str, prob: Problem, mask: bool,
                     softcap: bool) -> str:
    """The name of a kernel the caller named, after checking it can serve the call."""
    cfg = _as_config(config)
    if cfg.dtype != prob.dtype or cfg.d_head < prob.d_head:
        raise ConfigError(
            f"config {cfg.name} is for {cfg.dtype} with d_head up to {cfg.d_head}, but the "
            f"inputs are {prob.dtype} with d_head={prob.d_head}"
        )
    if mask and not cfg.mask:
        raise ConfigError(f"config {cfg.name} has no masks (flag m): it cannot run causal or "
                          "windowed attention")
    if cfg.softcap != softcap:
        raise ConfigError(f"config {cfg.name} " + ("applies a softcap (flag t): call it with "
                          "softcap > 0" if cfg.softcap else "has no softcap (flag t)"))
    if cfg.name not in ops.BUILT_NAMES:
        raise ConfigError(
            f"config {cfg.name} is not in this build (it has {len(ops.BUILT_NAMES)} kernels); "
            f"rebuild with FLASH_ATTENTION_KERNELS={cfg.name} (comma-separate to add more): "
            f"{BUILD_HINT}"
        )
    return cfg.name


def _check_call(q: object, k: object, v: object, causal: object, window_size: object,
                softcap: object, softmax_scale: object, out: object = None) -> Problem:
    """Every check of a fixed-length call in Python, each error naming the argument."""
    prob = check_inputs(q, k, v)
    check_scale(softmax_scale, prob.d_head)
    check_window(causal, window_size)
    check_softcap(softcap)
    if out is not None:
        check_out(out, q)  # type: ignore[arg-type]
        check_no_grad(q, k, v, call="a call with out=")  # type: ignore[arg-type]
    ops.require()
    return prob


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
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(scores) v, FlashAttention's algorithm, scores = q k^T * softmax_scale.

    q: (batch, seqlen_q, heads, d_head); k, v: (batch, seqlen_k, kv_heads, d_head) with
    heads % kv_heads == 0 (GQA/MQA: query head h reads kv head h // (heads // kv_heads)).
    fp16 or bf16 CUDA tensors, d_head a multiple of 8 up to 256, any strides (a tensor the
    kernels cannot load in 16-byte vectors is copied first; see README "layout").

    causal: query i sees keys j <= i + seqlen_k - seqlen_q (aligned bottom-right).
    window_size (left, right): query i sees keys in [i + seqlen_k - seqlen_q - left,
    i + seqlen_k - seqlen_q + right]; -1 leaves a side unbounded; with causal, right = 0.
    softcap > 0: scores become softcap * tanh(scores / softcap) before the softmax.
    A query row that sees no key gives out 0 and lse -inf.
    softmax_scale defaults to 1/sqrt(d_head). With return_lse, also returns the fp32
    log-sum-exp of the scores, shape (batch, heads, seqlen_q). out, if given, receives the
    result. config picks a forward kernel (a config or its name); by default dispatch chooses.
    Inputs that require grad (with grad mode on) get gradients through autograd (the
    FlashAttention-2 backward; the forward keeps out and the LSE, nothing of size seqlen^2);
    deterministic=True makes that backward bitwise reproducible. A call with out= has no
    backward.

    The common call (no out, no config) is one operator call that checks everything in C++;
    the Python checks run only when it fails (to raise the error that names the argument) and
    when torch.compile traces the call.
    """
    if (out is None and config is None and not deterministic and type(causal) is bool
            and type(window_size) is tuple and len(window_size) == 2
            and not torch.compiler.is_compiling()):
        try:
            grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                or v.requires_grad)
            o, lse = torch.ops.flash_attention.attention.default(
                q, k, v, None, None, 0, 0, softmax_scale, causal, window_size[0],
                window_size[1], softcap, return_lse or grad, "")
        except Exception:
            _check_call(q, k, v, causal, window_size, softcap, softmax_scale)
            raise  # the Python checks pass: the operator's own error stands
        else:
            if log.isEnabledFor(logging.DEBUG):
                _log_choice(q, k, v, causal, window_size, softcap)
            return (o, lse) if return_lse else o

    # The checked path: everything in Python first (also what the operator's schema would
    # coerce, such as an int for causal), then the operator.
    prob = _check_call(q, k, v, causal, window_size, softcap, softmax_scale, out)
    if out is None:
        kernel = "" if config is None else _explicit_kernel(
            config, prob, masks_needed(causal, window_size, prob), softcap > 0)
        left, right = window_size
        grad = needs_grad(q, k, v)
        o, lse = _attention_op(grad and deterministic)(
            q, k, v, None, None, 0, 0, softmax_scale, causal, left, right, float(softcap),
            return_lse or grad, kernel)
        return (o, lse) if return_lse else o
    scale = check_scale(softmax_scale, prob.d_head)
    left, right = canonical_window(causal, tuple(window_size), prob.seqlen_q, prob.seqlen_k)
    kernel = "" if config is None else _explicit_kernel(config, prob, (left, right) != (-1, -1),
                                                         softcap > 0)
    lse = (torch.empty((prob.batch, prob.heads, prob.seqlen_q), dtype=torch.float32,
                       device=q.device) if return_lse else None)
    torch.ops.flash_attention.fwd(q, k, v, out, lse, kernel, scale, left, right, float(softcap))
    return (out, lse) if return_lse else out


def _attention_op(deterministic: bool):
    """flash_attention::attention, or attention_det (the same arguments) whose backward adds dQ
    in a fixed order."""
    return (torch.ops.flash_attention.attention_det.default if deterministic
            else torch.ops.flash_attention.attention.default)


def _log_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                window_size: tuple[int, int], softcap: float) -> None:
    """Debug log of the kernel dispatch ran, with the reason when a Hopper kernel fell back."""
    left, right = canonical_window(causal, tuple(window_size), q.shape[1], k.shape[1])
    log.debug("attention %s %s: %s", q.dtype, tuple(q.shape),
              ops.extension().explain(q, k, v, left, right, softcap > 0))


def explain_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, causal: bool = False,
                   window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0) -> str:
    """The kernel a varlen call of these tensors runs (the dispatch table's varlen kernel on
    sm_90, else its row's kernel), with the reason where a Hopper kernel cannot run it."""
    left, right = canonical_window(causal, tuple(window_size), max_seqlen_q, max_seqlen_k)
    return ops.extension().explain_varlen(q, k, v, max_seqlen_q, left, right, softcap > 0)


def _log_varlen_choice(q, k, v, max_seqlen_q, max_seqlen_k, causal, window_size,
                       softcap) -> None:
    """Debug log of the kernel a varlen call ran, with the reason when a Hopper kernel fell
    back."""
    log.debug("attention_varlen %s %s (max_seqlen_q %d): %s", q.dtype, tuple(q.shape),
              max_seqlen_q, explain_varlen(q, k, v, max_seqlen_q, max_seqlen_k, causal,
                                           window_size, softcap))


def masks_needed(causal: bool, window_size: tuple[int, int], prob: Problem) -> bool:
    return canonical_window(causal, tuple(window_size), prob.seqlen_q,
                            prob.seqlen_k) != (-1, -1)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """attention() over a packed batch of sequences of different lengths (varlen).

    q: (total_q, heads, d_head), k, v: (total_k, kv_heads, d_head); sequence b is rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v
    (int32 CUDA tensors of batch + 1 entries, 0 first, non-decreasing, the totals last);
    max_seqlen_q/k: at least the longest sequence. Masks align per sequence (causal
    bottom-right in each). Returns out (total_q, heads, d_head) and, with return_lse, lse
    (heads, total_q) fp32. The values of cu_seqlens are checked before any launch (one
    device-to-host copy per new or modified cu_seqlens tensor; none during CUDA graph capture,
    where the kernel clamps offsets into the tensors instead, and the backward cuts a sequence
    longer than max_seqlen_q/k to them: such input is invalid, the cut only keeps the call
    from hanging or addressing outside its buffers). Inputs that require grad get
    gradients through autograd; deterministic=True makes that backward bitwise reproducible.
    """
    if (not deterministic and type(causal) is bool and type(window_size) is tuple
            and len(window_size) == 2 and not torch.compiler.is_compiling()):
        try:
            grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                or v.requires_grad)
            o, lse = torch.ops.flash_attention.attention.default(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                causal, window_size[0], window_size[1], softcap, return_lse or grad, "")
        except Exception:
            _check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, window_size, softcap, softmax_scale)
            raise
        else:
            if log.isEnabledFor(logging.DEBUG):
                _log_varlen_choice(q, k, v, max_seqlen_q, max_seqlen_k, causal, window_size,
                                   softcap)
            return (o, lse) if return_lse else o
    _check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       window_size, softcap, softmax_scale)
    left, right = window_size
    grad = needs_grad(q, k, v)
    o, lse = _attention_op(grad and deterministic)(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        left, right, float(softcap), return_lse or grad, "")
    return (o, lse) if return_lse else o


def _check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                       window_size, softcap, softmax_scale) -> None:
    vp = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    check_scale(softmax_scale, vp.d_head)
    check_window(causal, window_size)
    check_softcap(softcap)
    ops.require()


def forward(
    config: KernelConfig | str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None = None,
    **options: object,
) -> torch.Tensor:
    """Run one named forward kernel (a config or its name); options are attention()'s
    (causal, window_size, softcap, softmax_scale)."""
    return attention(q, k, v, out=out, config=_as_config(config), **options)  # type: ignore
