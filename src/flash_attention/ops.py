"""The torch operators ``flash_attention::attention`` and ``flash_attention::fwd`` and what they
need from Python.

Both are defined and implemented for CUDA in the extension (src/csrc/binding.cpp):

    attention(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k,
              int max_seqlen_q, int max_seqlen_k, float? softmax_scale, bool causal,
              int window_left, int window_right, float softcap, bool return_lse, str kernel)
              -> (Tensor out, Tensor lse)
    fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!)? lse, str kernel,
        float softmax_scale, int window_left, int window_right, float softcap) -> ()

``attention`` is the whole call in C++ (default scale, window, allocation, every check,
dispatch, launch; lse is empty unless return_lse; with cu_seqlens a varlen batch), so the
public functions are one operator call; ``fwd`` writes into a given out. With ``kernel=""``
both run the kernel of a dispatch table that :func:`load` computes once per process from
:mod:`flash_attention.dispatch` (``dispatch.reload_tuning()`` recomputes it). Here they get
their fake (meta) implementations, which run the Python checks, so ``torch.compile``,
``torch.export`` and ``FakeTensorMode`` trace them without a GPU and fail where running would.
"""

from __future__ import annotations

import itertools
import logging

import torch

from . import dispatch
from ._extension import ExtensionNotBuilt, extension
from .kernels import ConfigError, KernelConfig, base, fwd_sm90, parse

log = logging.getLogger(__name__)

BUILT: tuple[KernelConfig, ...] = ()  # the kernels of this build, in build order
BUILT_NAMES: frozenset[str] = frozenset()
LOADED = False  # the extension is loaded and the operator registered
LOAD_ERROR: str | None = None


def load() -> bool:
    """Load the extension (registers the operator), read its kernels, register the fake
    implementation and set the dispatch table; False (with LOAD_ERROR) if it is not built."""
    global BUILT, BUILT_NAMES, LOADED, LOAD_ERROR
    if LOADED:
        return True
    try:
        ext = extension()
    except ExtensionNotBuilt as exc:
        LOAD_ERROR = str(exc)
        return False
    BUILT = tuple(parse(entry["name"]) for entry in ext.kernels("fwd"))
    BUILT_NAMES = frozenset(c.name for c in BUILT)
    torch.library.register_fake("flash_attention::fwd")(_fwd_fake)
    torch.library.register_fake("flash_attention::attention")(_attention_fake)
    from . import fp8  # the FP8 operator's fake
    torch.library.register_fake("flash_attention::attention_fp8")(fp8.attention_fp8_fake)
    from . import backward  # the backward operator's fake and attention's autograd

    backward.register()
    from . import kvcache  # the decode operators' fakes

    kvcache.register()
    # ring attention's in-place operators (flash_attention.distributed) return nothing
    for op in ("flash_attention::bwd_accumulate", "flash_attention::merge_partials_"):
        torch.library.register_fake(op)(_returns_nothing)
    LOADED = True
    refresh_dispatch()
    return True


def _returns_nothing(*args, **kwargs) -> None:
    """The fake implementation of an operator that only writes into its arguments."""
    return None


def require() -> None:
    if not LOADED and not load():
        raise ExtensionNotBuilt(LOAD_ERROR or "the flash_attention extension is not loaded")


def refresh_dispatch() -> None:
    """Give the extension the dispatch tables: the forward's for every (dtype, d_head, bucket,
    features) this build serves, the backward's for every (dtype, d_head, softcap), the
    decode's for every (dtype, d_head)."""
    if LOADED:
        from . import backward, kvcache

        extension().set_dispatch("fwd", dispatch_rows(BUILT))
        extension().set_dispatch("bwd", backward.dispatch_rows(backward.built()))
        extension().set_dispatch("dec", kvcache.dispatch_rows(kvcache.built()))


def dispatch_rows(
        built: tuple[KernelConfig, ...]
) -> list[tuple[str, int, int, bool, bool, bool, str, str, str, str, str]]:
    """Rows (dtype, d_head variant, bucket, mask, local, softcap, kernel, fallback, varlen
    kernel, one-wave kernels, fewer-padded-keys kernel): the fallback (an sm80-family kernel)
    runs where the kernel (a Hopper one) cannot; else both are the same; the varlen kernel (a
    Hopper one with flag j, "" when none is built) runs the row's varlen calls; the one-wave
    kernels (Hopper ones, comma-separated in tier order, "" for none) run a fixed-length call
    whose tiles fit in one wave (fwd_sm90.ONE_WAVE_ROWS); else the fewer-padded-keys kernel
    ("" for none) one whose keys it pads at least 1/8 less (fwd_sm90.KEY_PAD_ROWS). ``local``
    rows (a window bounded on the left) differ from the masked ones only in their Hopper
    kernels."""
    rows = []
    kinds = [(mask, softcap, local) for mask, softcap in dispatch.FEATURES
             for local in ((False, True) if mask else (False,))]
    for dtype, d_head in dict.fromkeys((c.dtype, c.d_head) for c in built
                                       if c.dtype != fwd_sm90.FP8):
        # the varlen and one-wave kernels of a kind, whatever the bucket (a pack holds many
        # lengths; one wave depends on the whole call's size, checked per call)
        varlen = {k: dispatch.select_sm90_varlen(dtype, d_head, built, *k) for k in kinds}
        wave = {k: ",".join(c.name for c in dispatch.select_sm90_one_wave(dtype, d_head, built,
                                                                          *k)) for k in kinds}
        for bucket in dispatch.BUCKETS:
            for mask, softcap, local in kinds:
                try:
                    cfg = dispatch.select(dtype, d_head, bucket, built, mask, softcap)
                except ConfigError:
                    continue
                fast = dispatch.select_sm90(dtype, d_head, bucket, built, mask, softcap, local)
                packed = varlen[mask, softcap, local]
                pad = dispatch.select_sm90_key_pad(dtype, d_head, bucket, built, mask, softcap,
                                                   local) if fast else None
                rows.append((dtype, d_head, bucket, mask, local, softcap, (fast or cfg).name,
                             cfg.name, packed.name if packed else "",
                             wave[mask, softcap, local] if fast else "", pad.name if pad else ""))
    # FP8 calls: a Hopper kernel with no fallback (the sm80 family has no FP8 kernels), at every
    # d_head variant one serves (96 runs the 128 kernel), and its kind's varlen kernel.
    fp8 = [c for c in built if c.dtype == fwd_sm90.FP8]
    for d_head, (mask, softcap, local) in itertools.product(base.D_HEADS if fp8 else (), kinds):
        packed = dispatch.select_sm90_varlen(fwd_sm90.FP8, d_head, fp8, mask, softcap, local)
        for bucket in dispatch.BUCKETS:
            fast = dispatch.select_sm90(fwd_sm90.FP8, d_head, bucket, fp8, mask, softcap, local)
            if fast is not None:
                rows.append((fwd_sm90.FP8, d_head, bucket, mask, local, softcap, fast.name, "",
                             packed.name if packed else "", "", ""))
    log.debug("dispatch table: %d rows for %d kernels", len(rows), len(built))
    return rows


def _check_kernel(q, kernel: str, seqlen_q, mask: bool, softcap: float) -> None:
    """The kernel must be in this build, or the dispatch table must have one for the call."""
    if kernel and kernel not in BUILT_NAMES:
        raise RuntimeError(f"kernel {kernel} is not in this build")
    static = all(isinstance(n, int) for n in q.shape) and isinstance(seqlen_q, int)
    if not kernel and static and q.dtype in (torch.float16, torch.bfloat16):  # else: at run time
        dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
        if not extension().choice(dtype, q.shape[-1], seqlen_q, mask, softcap > 0):
            raise RuntimeError(
                f"this build has no kernel for {dtype} with d_head={q.shape[-1]}"
                + (" with masks" if mask else "") + (" with a softcap" if softcap > 0 else "")
                + "; rebuild with FLASH_ATTENTION_KERNELS=default")


def _fwd_fake(q, k, v, out, lse, kernel, softmax_scale, window_left, window_right, softcap):
    """The operator returns nothing and writes out and lse in place, so there is no shape to
    produce; what can be known without a GPU is checked, so that tracing fails where running
    would."""
    _check_kernel(q, kernel, q.shape[1], window_left != -1 or window_right != -1, softcap)
    return None


def _attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_left, window_right, softcap, return_lse,
                    kernel):
    """out like q and lse ((batch, heads, seqlen_q), varlen (heads, total_q), or empty), after
    the checks the Python API would run."""
    from . import masks, validation

    validation.check_scale(softmax_scale, 1)  # checked only: the value matters on the GPU
    causal, window = validation.check_window(causal, (window_left, window_right))
    validation.check_softcap(softcap)
    if cu_seqlens_q is None and cu_seqlens_k is None:
        prob = validation.check_inputs(q, k, v)
        seqlen_q, seqlen_k = prob.seqlen_q, prob.seqlen_k
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    else:
        vp = validation.check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k)
        seqlen_q, seqlen_k = vp.max_seqlen_q, vp.max_seqlen_k
        lse_shape = (q.shape[1], q.shape[0])
    left, right = masks.canonical_window(causal, window, seqlen_q, seqlen_k)
    _check_kernel(q, kernel, seqlen_q, (left, right) != (-1, -1), softcap)
    out = q.new_empty(q.shape)
    lse = q.new_empty(lse_shape if return_lse else (0,), dtype=torch.float32)
    return out, lse
