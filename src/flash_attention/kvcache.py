"""Decoding over a KV cache: :func:`flash_attn_with_kvcache` (flash_attn's name, arguments,
defaults and returns) on the ``flash_attention::kvcache`` operator, the decode kernels'
dispatch table, and the device's status word of bad cache metadata.

    out = flash_attn_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new,
                                  cache_seqlens=lengths, block_table=pages, causal=True)

The operator (src/csrc/binding/decode.cpp) appends k and v to the caches in place at each
sequence's length (rotating the new keys, and q, when rotary_cos/sin are given), then runs a
decode kernel (kind ``dec_sm80``) over the updated caches: packed GQA, paged caches of any page
size through the block table, keys split over CTAs when the batch is too small to fill the GPU
(``num_splits=0``: a heuristic; ``n``: n splits; 1: one pass, no combine).

FP8 KV caches: k_cache and v_cache (or the pages) in torch.float8_e4m3fn or torch.float8_e5m2
with a 16-bit q, and fp32 descales ``k_descale``, ``v_descale`` of shape (batch, kv_heads) (a
per-tensor scale as an expanded view; None: 1): the cache holds k / k_descale, the kernels
dequantise K and V as their tiles arrive (FP8 in shared memory, half the bytes of a 16-bit
cache), and new k and v (q's dtype) are quantised into the cache with the same descales,
rounded to nearest and saturated at the format's largest finite value.

Checks without a device-to-host sync: shapes, dtypes, devices and host-side lengths (an int or
a CPU tensor for cache_seqlens) are checked before any launch. Lengths, block tables and
cache_batch_idx that live on the GPU are not read back each decode step; the kernels never
access memory outside the caches by them, write NaN for a sequence whose metadata is bad, and
OR what was wrong into the device's status word: :func:`kvcache_errors` reads it (one sync, when
you ask) and :func:`check_kvcache` raises on it.
"""

from __future__ import annotations

import logging

import torch

from ._extension import extension
from .kernels import Call, KernelConfig, dec_sm80, parse
from .kernels.base import D_HEADS, DTYPES

log = logging.getLogger(__name__)

# decode::kStatus* (src/csrc/common/params.h)
STATUS_BITS = {
    1: "a cache length (cache_seqlens, or it plus the new rows) outside the cache",
    2: "a block_table entry outside [0, num_pages)",
    4: "a cache_batch_idx entry outside the cache's batch",
    8: "a rotary position past the rows of rotary_cos / rotary_sin",
    16: "a cache_leftpad entry outside [0, its sequence's keys]",
}


def built() -> tuple[KernelConfig, ...]:
    """The decode kernels of this build, in build order."""
    return tuple(parse(e["name"]) for e in extension().kernels("dec"))


# torch's FP8 dtypes a cache may have, by the names kernels use (dec_sm80.CACHES)
FP8_CACHES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def dispatch_rows(built: tuple[KernelConfig, ...]
                  ) -> list[tuple[str, int, int, bool, bool, bool, str, str, str, str, str]]:
    """The decode table as the extension takes it (the forward's row shape): per dtype (q's,
    or ``<q>_<cache>`` over an FP8 cache, e.g. ``bf16_e4m3``) and d_head variant (multiples of
    32), no mask and no softcap (both run-time arguments of every decode kernel), a row per
    tile height in the bucket column: 16 (dec_sm80.select's kernel) and, where one is built, 32
    (its wide kernel, for calls of dec_sm80.WIDE_FROM packed rows or more: choose_decode in
    src/csrc/binding/decode.cpp). A 16-row row's one-wave column names its deep kernel where
    one is built (dec_sm80.DEEP_ROWS: calls whose tiles fill one CTA per SM, on sm_90). Rows
    of bucket dec_sm80.SMALL_PAGE_BUCKET name the small-page kernel where one is built
    (dec_sm80.SMALL_PAGE_ROWS: pages of a multiple of 16 rows that the row kernel's B_c does
    not divide). A row's kernel is also its fallback (no varlen or fewer-padded-keys kernel:
    ""). An FP8 row's variant serves the multiples of 16 up to it."""
    rows = []
    for cache in ("", *dec_sm80.CACHES):
        for dtype in DTYPES:
            for d_head in D_HEADS:
                key = f"{dtype}_{cache}" if cache else dtype
                for wide in (False, True):
                    cfg = dec_sm80.select(Call(dtype, d_head), built, cache, wide)
                    deep = None if wide else dec_sm80.select_deep(Call(dtype, d_head), built,
                                                                  cache)
                    if cfg is not None:
                        rows.append((key, d_head, cfg.block_r, False, False, False, cfg.name,
                                     cfg.name, "", deep.name if deep else "", ""))
                small = dec_sm80.select_small_page(Call(dtype, d_head), built, cache)
                if small is not None:
                    rows.append((key, d_head, dec_sm80.SMALL_PAGE_BUCKET, False, False, False,
                                 small.name, small.name, "", "", ""))
    return rows


def explain(dtype: torch.dtype, d_head: int, kernel: str = "", num_splits: int = 0,
            cache_dtype: torch.dtype | None = None, rows: int = 1, kv_bytes: int = 0,
            tiles: int = 0, keys: int = 0, device: torch.device | None = None,
            page_size: int = 0) -> str:
    """Which decode kernel a call of this dtype (over a cache of cache_dtype, None: q's),
    d_head and `rows` packed rows (seqlen_q x query heads per KV head) reading up to
    `kv_bytes` of K and V (`tiles` 16-row tiles, `keys` per sequence; pages of `page_size`
    rows, 0: contiguous) on `device` runs, and why (for the debug log): dec_sm80.select_for's
    choice, as choose_decode makes it."""
    if kernel:
        return f"decode kernel {kernel} (named by the call)"
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    cache = FP8_CACHES.get(cache_dtype, "")
    over = f" over an {cache} cache" if cache else ""
    sms = optin = 0
    if device is not None and device.type == "cuda" and not num_splits:
        props = torch.cuda.get_device_properties(device)
        sms = props.multi_processor_count
        optin = getattr(props, "shared_memory_per_block_optin", 0)
    cfg = dec_sm80.select_for(Call(name, d_head), built(), rows, kv_bytes, cache, tiles=tiles,
                              keys=keys, sms=sms, smem=optin, page_size=page_size)
    if cfg is None:
        return f"no decode kernel for {name}{over} d_head {d_head} in this build"
    splits = (f"{num_splits} key splits (num_splits)" if num_splits else
              "key splits chosen on the launch from the SM count and the work (num_splits=0)")
    how = f"{rows} packed rows in tiles of {cfg.block_r}"
    if rows >= dec_sm80.WIDE_FROM and cfg.block_r == 16:
        how += (" (32-row tiles are for 16-bit caches up to d_head 128)" if cache or
                d_head > 128 else
                f" ({kv_bytes / 2**20:.0f} MiB of K and V: 32-row tiles from "
                f"{dec_sm80.WIDE_MIN_BYTES >> 20} MiB)" if kv_bytes < dec_sm80.WIDE_MIN_BYTES
                else " (this build has no 32-row decode kernel)")
    if cfg.name in {n for _, n in dec_sm80.table_rows(Call(name, d_head), cache,
                                                      small_page=True)}:
        how += (f" (pages of {page_size} rows: the row's small-page kernel, {cfg.block_c}-key "
                "blocks each inside one page)")
    if cfg.sm90_only:
        n = dec_sm80.deep_splits(tiles, keys, sms)
        how += (f" ({tiles} tiles on {sms} SMs, one CTA per SM: the row's deep kernel, "
                f"{cfg.warps} warps)")
        splits = f"{n} key split{'s' * (n > 1)} (the deep kernel's, num_splits=0)"
    return (f"decode kernel {cfg.name} (the dec_sm80 row for {name}{over} d_head {d_head}, "
            f"{how}: masks and softcap are run-time arguments), {splits}")


def _shape(q: torch.Tensor, cache: torch.Tensor, batch: int, seqlen_q: int, keys: int,
           paged: bool) -> dict:
    """explain's description of a call (the heads as given; the kernel checks them): its
    packed rows, the K and V bytes it reads at most, its 16-row tiles, keys per sequence,
    device and page size (a paged cache's rows per page, else 0)."""
    kv_heads = max(int(cache.shape[-2]), 1)
    rows = dec_sm80.packed_rows(int(seqlen_q), q.shape[-2], kv_heads)
    fp8 = FP8_CACHES.get(cache.dtype, "")
    return {"rows": rows, "tiles": dec_sm80.row_tiles(rows, kv_heads, batch), "keys": int(keys),
            "kv_bytes": dec_sm80.kv_bytes(batch, kv_heads, int(keys), cache.shape[-1], fp8),
            "device": q.device, "page_size": int(cache.shape[1]) if paged else 0}


def _keys(cache_seqlens, k, k_cache: torch.Tensor, block_table) -> int:
    """The keys per sequence the extension plans a flash_attn_with_kvcache call for: the
    longest cache length plus the new rows where the host knows it (an int, a CPU tensor),
    else the cache's capacity (as kvcache_cuda does, without a sync)."""
    new = k.shape[1] if k is not None else 0
    if isinstance(cache_seqlens, int):
        return cache_seqlens + new
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.device.type == "cpu" \
            and cache_seqlens.numel():
        return int(cache_seqlens.max()) + new
    return (block_table.shape[-1] * k_cache.shape[1] if block_table is not None
            else k_cache.shape[1])


def _check_q_descale(q: torch.Tensor, q_descale: torch.Tensor | None) -> None:
    if q_descale is not None:
        raise ValueError(f"q_descale is for an FP8 q; q is {q.dtype} (the decode kernels take an "
                         "fp16/bf16 q, over a cache of its dtype or an FP8 one with k_descale "
                         "and v_descale)")


def register() -> None:
    """The operators' fake implementations (ops.load calls it; ops.refresh_dispatch sets the
    decode table from dispatch_rows)."""
    torch.library.register_fake("flash_attention::kvcache")(_kvcache_fake)
    torch.library.register_fake("flash_attention::varlen_paged")(_varlen_paged_fake)


def _kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
                  cache_batch_idx, block_table, softmax_scale, causal, window_left, window_right,
                  softcap, rotary_interleaved, num_splits, return_lse, kernel, k_descale=None,
                  v_descale=None, cache_leftpad=None):
    """out like q and lse (batch, heads, seqlen_q) or empty; the caches are written in place
    (the schema says so: Tensor(a!) k_cache, Tensor(b!) v_cache)."""
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (batch, seqlen_q, heads, d_head), got {q.dim()}-D")
    out = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]) if return_lse else (0,),
                      dtype=torch.float32)
    return out, lse


def _varlen_paged_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, max_seqlen_q,
                       max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                       num_splits, return_lse, kernel, k_descale=None, v_descale=None):
    """out like q (total_q, heads, d_head) and lse (heads, total_q) or empty."""
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D (total_q, heads, d_head), got {q.dim()}-D")
    out = q.new_empty(q.shape)
    lse = q.new_empty((q.shape[1], q.shape[0]) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def varlen_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  return_lse=False, block_table=None, seqused_k=None, num_splits=0,
                  kernel="", k_descale=None, v_descale=None):
    """flash_attn_varlen_func's call over a paged cache (block_table (batch, max_pages) int32,
    k and v (num_pages, page_size, kv_heads, d_head), any page size) and/or per-sequence key
    counts (seqused_k (batch,) int32: sequence b attends to its first seqused_k[b] keys), or
    over FP8 k and v (with k_descale, v_descale (batch, kv_heads) fp32), on the decode kernels.
    Inference only: no backward."""
    from . import ops, validation

    causal, window = validation.check_window(causal, window_size)
    validation.check_softcap(softcap)
    if softmax_scale is not None:
        validation.check_scale(softmax_scale, 1)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("block_table / seqused_k calls have no backward (the decode "
                                  "kernels serve inference); run them under torch.no_grad()")
    ops.require()
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
        log.debug("flash_attn_varlen_func %s q %s, k %s%s: %s", q.dtype, tuple(q.shape),
                  tuple(k.shape), " paged" if block_table is not None else "",
                  explain(q.dtype, q.shape[-1], kernel, num_splits, k.dtype,
                          **_shape(q, k, cu_seqlens_q.numel() - 1, max_seqlen_q,
                                   block_table.shape[-1] * k.shape[1]
                                   if block_table is not None else max_seqlen_k,
                                   block_table is not None)))
    return torch.ops.flash_attention.varlen_paged.default(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, int(max_seqlen_q),
        int(max_seqlen_k), softmax_scale, causal, window[0], window[1], float(softcap),
        num_splits, return_lse, kernel, k_descale, v_descale)


def kvcache_errors(device: torch.device | int | None = None, clear: bool = True) -> list[str]:
    """What bad cache metadata the decode kernels met on a device since the last clear (a
    synchronous read of one int), as sentences; [] when none."""
    from . import ops

    ops.require()
    index = torch.device("cuda", device).index if isinstance(device, int) else None
    if isinstance(device, torch.device):
        index = device.index
    if index is None:
        index = torch.cuda.current_device()
    bits = extension().kvcache_status(index, clear)
    return [text for bit, text in STATUS_BITS.items() if bits & bit]


def check_kvcache(device: torch.device | int | None = None) -> None:
    """Raise ValueError if the decode kernels met bad cache metadata on the device since the
    last check (the rows of those sequences were written as NaN); clears the record."""
    errors = kvcache_errors(device, clear=True)
    if errors:
        raise ValueError("flash_attn_with_kvcache met bad cache metadata (those sequences' "
                         "outputs are NaN): " + "; ".join(errors))


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    kernel: str = "",
):
    """flash_attn's flash_attn_with_kvcache. q (batch, seqlen_q, heads, d_head); k_cache,
    v_cache (batch_cache, seqlen_cache, kv_heads, d_head), or with block_table (batch,
    max_pages) int32 (num_pages, page_size, kv_heads, d_head), any page size; k, v (batch,
    seqlen_new, kv_heads, d_head) appended in place at cache_seqlens (an int or (batch,) int32
    on the GPU or the CPU; None: every sequence is its whole cache). Causal masks align
    bottom-right to each sequence's cache length. Returns out (batch, seqlen_q, heads, d_head),
    and with return_softmax_lse (out, lse (batch, heads, seqlen_q) fp32). An FP8 cache
    (float8_e4m3fn or float8_e5m2) takes k_descale and v_descale (fp32 (batch, kv_heads),
    FlashAttention 3's names; None: 1); new k and v are quantised into it with them.
    cache_leftpad ((batch,) int32 on q's device, contiguous caches): sequence b's keys are its
    cache rows cache_leftpad[b] up to its length (cache_seqlens[b] plus the new rows, counted
    from row 0); masks align to those keys, the append and rotary positions stay the rows'
    indices (flash_attn's). Not supported, refused by name: alibi_slopes, q_descale (q is
    fp16/bf16)."""
    from . import ops, validation

    if alibi_slopes is not None:
        raise NotImplementedError("alibi_slopes: flash_attention has no ALiBi bias; pass None")
    _check_q_descale(q, q_descale)
    causal, window = validation.check_window(causal, window_size)
    validation.check_softcap(softcap)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen by a heuristic), got "
                         f"{num_splits!r}")
    if softmax_scale is not None:
        validation.check_scale(softmax_scale, 1)
    seqlens_tensor, seqlen_int = None, -1
    if isinstance(cache_seqlens, torch.Tensor):
        seqlens_tensor = cache_seqlens
    elif cache_seqlens is not None:
        if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int) \
                or cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be an int >= 0 or an int32 tensor, got "
                             f"{cache_seqlens!r}")
        seqlen_int = cache_seqlens
    ops.require()
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
        log.debug("flash_attn_with_kvcache %s q %s, cache %s%s: %s", q.dtype, tuple(q.shape),
                  tuple(k_cache.shape), " paged" if block_table is not None else "",
                  explain(q.dtype, q.shape[-1], kernel, num_splits, k_cache.dtype,
                          **_shape(q, k_cache, q.shape[0], q.shape[1],
                                   _keys(cache_seqlens, k, k_cache, block_table),
                                   block_table is not None)))
    out, lse = torch.ops.flash_attention.kvcache.default(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens_tensor, seqlen_int,
        cache_batch_idx, block_table, softmax_scale, causal, window[0], window[1], float(softcap),
        rotary_interleaved, num_splits, return_softmax_lse, kernel, k_descale, v_descale,
        cache_leftpad)
    return (out, lse) if return_softmax_lse else out
