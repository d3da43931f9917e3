"""Input checks of the Python API. Every problem is reported with what is wrong and what is
allowed, before anything runs on the GPU. Strides are free: the operator copies what the
kernels cannot address (src/csrc/binding/input_layout.h). Structural checks (types, ranks,
shapes, dtypes) come first, then devices, so that each can be exercised on a machine without a
GPU (the GPU's compute capability is checked by the operator, which needs one)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .kernels.base import D_HEADS, MAX_D_HEAD, variant_for

TORCH_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPE_NAMES = {**TORCH_DTYPES, torch.float8_e4m3fn: "e4m3"}  # kernel name segments
MAX_GRID_YZ = 65535  # batch and heads map to grid dimensions z and y
MAX_SEQLEN = 2**31 - 1 - 256  # the operator's kMaxSeqlen


@dataclass(frozen=True)
class Problem:
    """The shape facts of a validated call."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    d_head: int
    dtype: str  # "fp16" | "bf16"
    device: torch.device


def _check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(
            f"{name} must be 4-D (batch, seqlen, heads, d_head), got shape {tuple(t.shape)}"
        )
    return t


def check_inputs(q: object, k: object, v: object,
                 dtypes: tuple[torch.dtype, ...] | None = None) -> Problem:
    """q, k, v of a fixed-length call (dtypes: those allowed, default fp16 and bf16)."""
    q = _check_tensor(q, "q")
    k = _check_tensor(k, "k")
    v = _check_tensor(v, "v")
    dtypes = tuple(TORCH_DTYPES) if dtypes is None else dtypes
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in dtypes:
            hint = ("; float8_e4m3fn inputs take flash_attn_func / flash_attn_varlen_func(..., "
                    "q_descale=, k_descale=, v_descale=) or flash_attention.fp8.attention_fp8"
                    if t.dtype == torch.float8_e4m3fn else "")
            raise TypeError(f"{name} has dtype {t.dtype}; supported: "
                            + ", ".join(map(str, dtypes)) + hint)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, seqlen_q, heads, d_head = q.shape
    if variant_for(d_head) is None:
        raise ValueError(
            f"d_head={d_head} is not supported; supported: every multiple of 8 up to "
            f"{MAX_D_HEAD} (compiled variants {', '.join(map(str, D_HEADS))}; a d_head between "
            "two runs on the larger one)"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"batch of k/v ({k.shape[0]}) differs from batch of q ({batch})")
    if k.shape[3] != d_head:
        raise ValueError(f"d_head of k/v ({k.shape[3]}) differs from d_head of q ({d_head})")
    kv_heads, seqlen_k = k.shape[2], k.shape[1]
    if (kv_heads == 0 and heads != 0) or (kv_heads and heads % kv_heads != 0):
        raise ValueError(
            f"heads of q ({heads}) must be a multiple of heads of k/v ({kv_heads}) "
            "(equal for MHA, a divisor for GQA/MQA)"
        )
    if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ:
        raise ValueError(f"batch ({batch}) and heads ({heads}) must each be at most {MAX_GRID_YZ}")
    if seqlen_q > MAX_SEQLEN or seqlen_k > MAX_SEQLEN:
        raise ValueError(f"sequence lengths must be at most {MAX_SEQLEN}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on the same device, got {q.device}, {k.device}, {v.device}"
        )
    if q.device.type != "cuda":
        raise ValueError(
            f"q, k and v are on {q.device}; flash_attention runs on CUDA tensors (use .cuda())"
        )
    return Problem(batch, seqlen_q, seqlen_k, heads, kv_heads, d_head, DTYPE_NAMES[q.dtype],
                   q.device)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Grad mode is on and an input requires grad: the call must keep what its backward needs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def check_no_grad(*tensors: torch.Tensor, call: str = "this call") -> None:
    """Calls without a backward (out=, varlen): an input that requires grad, with grad mode on,
    would silently get no gradient."""
    if needs_grad(*tensors):
        raise RuntimeError(
            f"flash_attention has no backward for {call}: an input requires grad; call it "
            "under torch.no_grad() or torch.inference_mode(), or detach the inputs"
        )


def check_out(out: object, q: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != q.shape:
        raise ValueError(f"out must have the shape of q {tuple(q.shape)}, got {tuple(out.shape)}")
    if out.dtype != q.dtype:
        raise TypeError(f"out must have dtype {q.dtype}, got {out.dtype}")
    if out.device != q.device:
        raise ValueError(f"out must be on {q.device}, got {out.device}")
    if any(stride == 0 and size > 1 for size, stride in zip(out.shape, out.stride())):
        raise ValueError(f"out has elements that share memory (an expanded tensor, strides "
                         f"{tuple(out.stride())}); pass a tensor whose elements are distinct, "
                         "e.g. torch.empty_like(q)")
    return out


def check_scale(softmax_scale: object, d_head: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(d_head)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale}")
    return scale


MAX_WINDOW = 2**31 - 1


def check_window(causal: object, window_size: object) -> tuple[bool, tuple[int, int]]:
    """causal a bool; window_size a pair of ints, each -1 (unbounded) or in [0, 2^31)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    for name, w in (("left", left), ("right", right)):
        if not -1 <= w <= MAX_WINDOW:
            raise ValueError(f"window_size {name} must be -1 (unbounded) or in [0, {MAX_WINDOW}],"
                             f" got {w}")
    return causal, (left, right)


def check_softcap(softcap: object) -> float:
    """softcap: 0 (off) or a finite positive float."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap must be 0 (off) or finite and positive, got {softcap}")
    return value



@dataclass(frozen=True)
class VarlenProblem:
    """The shape facts of a validated varlen call (values of cu_seqlens are checked by the
    operator, which reads them)."""

    batch: int
    total_q: int
    total_k: int
    heads: int
    kv_heads: int
    d_head: int
    max_seqlen_q: int
    max_seqlen_k: int
    dtype: str
    device: torch.device


def _check_packed(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D (total_tokens, heads, d_head) for varlen, got "
                         f"shape {tuple(t.shape)}")
    return t


def _check_cu_seqlens(cu: object, name: str, device: torch.device) -> int:
    """Metadata of cu_seqlens (int32, 1-D, >= 2 entries, contiguous, on q's device); returns the
    batch size."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (torch.int32), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape "
                         f"{tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device} (q's device), got {cu.device}")
    if not cu.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return cu.shape[0] - 1


def check_varlen_inputs(q: object, k: object, v: object, cu_seqlens_q: object,
                        cu_seqlens_k: object, max_seqlen_q: object,
                        max_seqlen_k: object, dtypes=None) -> VarlenProblem:
    """Everything about a varlen call that metadata shows; the operator checks the values of
    cu_seqlens (0 first, non-decreasing, total last, no sequence over max_seqlen) before any
    launch. dtypes: as check_inputs' (FP8 passes float8_e4m3fn)."""
    q = _check_packed(q, "q")
    k = _check_packed(k, "k")
    v = _check_packed(v, "v")
    # The same dtype, d_head, heads, stride and device rules as fixed-length batches.
    prob = check_inputs(q[None], k[None], v[None], dtypes)
    batch = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", prob.device)
    if _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", prob.device) != batch:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
                         f"got {batch + 1} and {cu_seqlens_k.shape[0]}")  # type: ignore[union-attr]
    if batch > MAX_GRID_YZ:
        raise ValueError(f"batch ({batch}) must be at most {MAX_GRID_YZ}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= value <= MAX_SEQLEN:
            raise ValueError(f"{name} must be in [0, {MAX_SEQLEN}], got {value}")
    return VarlenProblem(batch, q.shape[0], k.shape[0], prob.heads, prob.kv_heads, prob.d_head,
                         int(max_seqlen_q), int(max_seqlen_k),  # type: ignore[arg-type]
                         prob.dtype, prob.device)
