"""The torch operator ``flash_attention::fwd`` and what it needs from Python.

The operator is defined and implemented for CUDA in the extension (src/csrc/binding.cpp):

    fwd(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!)? lse, str kernel,
        float softmax_scale, int window_left, int window_right, float softcap) -> ()

It writes out (and lse) in place; with ``kernel=""`` it runs the kernel of a dispatch table
that :func:`load` computes once per process from :mod:`flash_attention.dispatch` (and that
``dispatch.reload_tuning()`` recomputes), so the call path has no Python after the API's
checks. Here it gets its fake (meta) implementation, so ``torch.compile``, ``torch.export`` and
``FakeTensorMode`` trace it without a GPU, and the set of built kernels is read once.
"""

from __future__ import annotations

import logging

import torch

from . import dispatch
from ._extension import ExtensionNotBuilt, extension
from .config import ConfigError, KernelConfig

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
    BUILT = tuple(KernelConfig.parse(entry["name"]) for entry in ext.kernels())
    BUILT_NAMES = frozenset(c.short for c in BUILT)
    torch.library.register_fake("flash_attention::fwd")(_fwd_fake)
    LOADED = True
    refresh_dispatch()
    return True


def require() -> None:
    if not LOADED and not load():
        raise ExtensionNotBuilt(LOAD_ERROR or "the flash_attention extension is not loaded")


def refresh_dispatch() -> None:
    """Give the extension the dispatch table for every (dtype, d_head, bucket, features) this
    build serves."""
    if LOADED:
        extension().set_dispatch(dispatch_rows(BUILT))


def dispatch_rows(built: tuple[KernelConfig, ...]) -> list[tuple[str, int, int, bool, bool, str]]:
    rows = []
    for dtype, d_head in dict.fromkeys((c.dtype, c.d_head) for c in built):
        for bucket in dispatch.BUCKETS:
            for mask, softcap in dispatch.FEATURES:
                try:
                    cfg = dispatch.select(dtype, d_head, bucket, built, mask, softcap)
                except ConfigError:
                    continue
                rows.append((dtype, d_head, bucket, mask, softcap, cfg.short))
    log.debug("dispatch table: %d rows for %d kernels", len(rows), len(built))
    return rows


def _fwd_fake(q, k, v, out, lse, kernel, softmax_scale, window_left, window_right, softcap):
    """The operator returns nothing and writes out and lse in place, so there is no shape to
    produce; what can be known without a GPU is checked, so that tracing fails where running
    would: the kernel must be in this build or the dispatch table must have one."""
    mask = window_left != -1 or window_right != -1
    if kernel and kernel not in BUILT_NAMES:
        raise RuntimeError(f"kernel {kernel} is not in this build")
    static = all(isinstance(n, int) for n in q.shape)  # symbolic shapes: checked at run time
    if not kernel and static and q.dtype in (torch.float16, torch.bfloat16):
        dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
        if not extension().choice(dtype, q.shape[3], q.shape[1], mask, softcap > 0):
            raise RuntimeError(
                f"this build has no kernel for {dtype} with d_head={q.shape[3]}"
                + (" with masks" if mask else "") + (" with a softcap" if softcap > 0 else "")
                + "; rebuild with FLASH_ATTENTION_KERNELS=default")
    return None
