"""The backward pass in torch: the fake implementation of ``flash_attention::bwd`` (defined
and implemented for CUDA in src/csrc/binding/backward.cpp) and the autograd formula of the
forward operator ``flash_attention::attention``, registered with
``torch.library.register_autograd`` so that eager autograd, ``torch.compile`` (AOTAutograd)
and ``torch.library.opcheck`` all see one operator per direction.

The forward saves q, k, v, out and the LSE (nothing of size seqlen^2); the public functions ask
the operator for the LSE whenever an input requires grad. ``flash_attention::attention_det``
takes the same arguments and runs the same forward, and its backward is deterministic
(``deterministic=True`` of the public functions, fixed-length and varlen): the dQ
contributions of the KV blocks are added in a fixed order, so gradients are bitwise identical
run to run.

At debug level (logger ``flash_attention.backward``) each eager backward logs the kernel it
runs and, when it falls back to the sm80 family, why the Hopper kernel cannot run the call
(``flash_attention::bwd_explain``; the forward logs its own choice the same way).
"""

from __future__ import annotations

import functools
import logging

import torch

from . import validation
from .kernels import Call, KernelConfig, bwd_sm80, bwd_sm90, fwd_sm80, parse
from .kernels.base import DTYPES

_REGISTERED = False
log = logging.getLogger(__name__)


def register() -> None:
    """Fake implementation of bwd, the deterministic forward op, and both autograd formulas
    (once per process, after the extension defined the operators)."""
    global _REGISTERED
    if _REGISTERED:
        return
    torch.library.register_fake("flash_attention::bwd")(_bwd_fake)
    torch.library.register_autograd("flash_attention::attention", _attention_backward,
                                    setup_context=_setup_context)
    _define_deterministic_op()
    _REGISTERED = True


# ---- the backward operator's fake -------------------------------------------------------------

def _bwd_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
              deterministic, kernel):
    """dq, dk, dv like q, k, v (contiguous), after the checks that need no GPU."""
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        vp = validation.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k)
        dtype, d_head, lse_shape = vp.dtype, vp.d_head, (vp.heads, vp.total_q)
    else:
        prob = validation.check_inputs(q, k, v)
        dtype, d_head = prob.dtype, prob.d_head
        lse_shape = (prob.batch, prob.heads, prob.seqlen_q)
    validation.check_scale(softmax_scale, d_head)
    validation.check_window(causal, (window_left, window_right))
    validation.check_softcap(softcap)
    for name, t in (("out", out), ("dout", dout)):
        if t.shape != q.shape or t.dtype != q.dtype:
            raise ValueError(f"{name} must have the shape and dtype of q {tuple(q.shape)}, got "
                             f"{tuple(t.shape)} {t.dtype}")
    _check_kernel(kernel, dtype, d_head, softcap > 0)
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None and (tuple(t.shape) != lse_shape or t.dtype != torch.float32):
            raise ValueError(f"{name} must be fp32 of shape {lse_shape} (the forward's LSE), got "
                             f"{tuple(t.shape)} {t.dtype}")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@functools.cache
def built() -> tuple[KernelConfig, ...]:
    """The backward kernels of this build (from the extension's backward registry)."""
    names = torch.ops.flash_attention.bwd_kernels()
    return tuple(parse(n) for n in names.split(",") if n)


def dispatch_rows(built: tuple[KernelConfig, ...]
                  ) -> list[tuple[str, int, int, bool, bool, bool, str, str, str, str, str]]:
    """The backward's dispatch table as the extension takes it (the forward's row shape: dtype,
    d_head variant, bucket, mask, local, softcap, kernel, fallback, varlen kernel, one-wave
    and fewer-padded-keys kernels: none in the backward): per dtype,
    d_head variant and softcap, bucket 64 and no mask (masks are run-time arguments of every
    backward kernel), the kernel bwd_sm90.select picks where a Hopper kernel is built, else
    bwd_sm80's, bwd_sm80's as the fallback, and bwd_sm90.select_varlen's kernel for varlen calls
    ("" where the build has none: they run the kernel, or its fallback)."""
    rows = []
    for dtype in DTYPES:
        for softcap in (False, True):
            for d_head in fwd_sm80.D_HEADS:
                call = Call(dtype, d_head, softcap=softcap)
                fallback = bwd_sm80.select(call, built)
                kernel = bwd_sm90.select(call, built) or fallback
                varlen = bwd_sm90.select_varlen(call, built)
                if kernel is not None:
                    rows.append((dtype, d_head, 64, False, False, softcap, kernel.name,
                                 fallback.name if fallback is not None else "",
                                 varlen.name if varlen is not None else "", "", ""))
    return rows


def _check_kernel(kernel: str, dtype: str, d_head: int, softcap: bool) -> None:
    """The named backward kernel is built, or the build has one for the call (as the operator
    picks it)."""
    configs = built()
    if kernel:
        if kernel not in {c.name for c in configs}:
            raise RuntimeError(f"backward kernel {kernel} is not in this build; rebuild with "
                               f"FLASH_ATTENTION_KERNELS=default,{kernel}")
        return
    call = Call(dtype, d_head, softcap=softcap)
    if bwd_sm80.select(call, configs) is None and bwd_sm90.select(call, configs) is None:
        raise RuntimeError(f"this build has no backward kernel for {dtype} with d_head={d_head}"
                           + (" with a softcap" if softcap else "")
                           + "; rebuild with FLASH_ATTENTION_KERNELS=default")


# ---- autograd of flash_attention::attention ---------------------------------------------------

def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
     window_left, window_right, softcap, return_lse, _kernel) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.return_lse = return_lse
    ctx.features = (softmax_scale, causal, window_left, window_right, softcap)
    ctx.deterministic = False


def _attention_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    if not ctx.return_lse:
        raise RuntimeError(
            "flash_attention::attention ran without return_lse, so its LSE was not kept for the "
            "backward; call it with return_lse=True (fa.attention does when an input requires "
            "grad)")
    softmax_scale, causal, window_left, window_right, softcap = ctx.features
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
        log.debug("attention backward %s %s: %s", q.dtype, tuple(q.shape),
                  torch.ops.flash_attention.bwd_explain(dout, q, k, v, cu_seqlens_q is not None,
                                                        softcap > 0))
    dq, dk, dv = torch.ops.flash_attention.bwd.default(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens,
        softmax_scale, causal, window_left, window_right, softcap, ctx.deterministic, "")
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


# ---- the deterministic variant ------------------------------------------------------------------

def _define_deterministic_op() -> None:
    @torch.library.custom_op("flash_attention::attention_det", mutates_args=())
    def attention_det(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                      max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None,
                      causal: bool, window_left: int, window_right: int, softcap: float,
                      return_lse: bool, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
        """flash_attention::attention (same arguments) whose backward adds dQ in a fixed
        order."""
        return torch.ops.flash_attention.attention.default(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, window_left, window_right, softcap, return_lse, kernel)

    @attention_det.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
          window_left, window_right, softcap, return_lse, kernel):
        return torch.ops.flash_attention.attention.default(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, window_left, window_right, softcap, return_lse, kernel)

    attention_det.register_autograd(_attention_backward,
                                    setup_context=_setup_deterministic_context)


def _setup_deterministic_context(ctx, inputs, output) -> None:
    """attention_det's inputs are attention's: the same context, with the fixed dQ order."""
    _setup_context(ctx, inputs, output)
    ctx.deterministic = True
