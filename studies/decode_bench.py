"""Decode steps on a GPU, side by side in one process: flash_attn_with_kvcache against SDPA (each
of its backends forced in turn, and the one it picks), torch's FlexAttention (compiled; its
paged-attention path over a block mask, and a contiguous cache) and the GPU's copy bandwidth.

Every sequence is at the cache's full length; no append unless the row says so. A timed step
goes through several layers, each with its own q and cache (--layers; by default enough that
the caches together exceed four times the L2 cache), as a model's decode step does, so every
layer reads its cache from memory: with one cache replayed over and over, a cache smaller than
L2 (one sequence of 8k keys is 32 MiB against an H200's 60 MiB) would be read from L2, which
serving never sees. The layers of a step are one graph (as a model's decode graph is), times
per layer. Rows (all replayed from CUDA graphs, the GPU's time without the host's, as serving
engines run decode steps, except the "eager" rows, called from Python):

    ours                 contiguous cache (batch, seq, kv_heads, d), the split heuristic
    ours 1 split         num_splits=1 (--one-split); ours N splits: num_splits=N (--splits)
    ours bhsd            the cache in SDPA's (batch, kv_heads, seq, d) storage, read in place
    ours paged N         N-row pages through a shuffled block table (--pages); each kernel
                         named in --kernels over the same pages too ("NAME paged N");
                         --ordered-pages adds "ours paged N ordered": the same pages in the
                         pool's order (the table an identity), which separates the kernel's
                         cost of paging from the cost of scattered pages in memory
    ours q4, ours q8     speculative decoding: 4 or 8 queries per sequence, causal (--spec);
                         "ours q8 r16" the same on the 16-row kernel, named (the table runs
                         32-row tiles from 17 packed rows)
    ours append+rotary   the step with its new k, v appended and rotary on q and k (--append)
    ours e4m3, e5m2      the same values in an FP8 cache with per-(batch, KV head) descales
                         (--fp8 e4m3,e5m2), contiguous and paged (--pages); the summary gives
                         "ours" over each (the FP8 cache's speedup), the KV fraction counts
                         the FP8 bytes
    sdpa <backend>       SDPA forced to cudnn, flash, efficient (enable_gqa=True, (b, h, s, d));
                         "sdpa best" in the summary is the fastest that ran
    flex, flex paged N   FlexAttention compiled, contiguous and through PagedAttention (--flex)
    copy                 a device-to-device copy of 2 GiB (the GPU's copy rate)

Each contender is timed at steady clocks (time_sustained_ms: 20 calls after about 300 ms of the
same calls); --rounds N rotates the order per round and the table gives the median and the
spread (min-max) over rounds. The KV fraction is the cache bytes read per second over the
copy's (bytes read + written per second). Each round also times 20 calls between one pair of
events (span_us in the JSON); a row whose per-call median falls under 0.9x that is flagged "!".
--host also times the host's cost of one eager call
(microseconds of Python + launch per call, 200 calls queued without a sync) of ours and SDPA.

    PYTHONPATH=src python3 studies/decode_bench.py [--shapes 1x4096,16x32768] [--rounds 2]
        [--heads 32/8] [--d 128] [--dtype bf16] [--pages 16,256] [--spec] [--append]
        [--flex] [--host] [--one-split] [--fp8 e4m3,e5m2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

from fa_tools.gpu.perfcases import time_sustained_ms
from flash_attention import kvcache
from flash_attention.interface import flash_attn_with_kvcache
from flash_attention.kernels import Call, dec_sm80

SHAPES = "1x4096,1x32768,1x131072,16x4096,16x32768,64x4096,64x16384"
SDPA_BACKENDS = ("cudnn", "flash", "efficient")
FP8_NAMES = ("e4m3", "e5m2")


def cache_bytes(name: str, kv_bytes: int) -> int:
    """The K and V bytes a row reads: half the 16-bit cache's for an FP8 cache's rows."""
    return kv_bytes // 2 if any(name.startswith(f"ours {f}") for f in FP8_NAMES) else kv_bytes


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up call on a side stream): its replay, and what
    fn returned in the capture (the graph's outputs, rewritten by each replay). The graph reads
    fn's tensors (its closures' and default arguments') at their captured addresses, so the
    replay holds fn: with only the graph held, a tensor that nothing else referenced (a paged
    copy of the cache, a speculative row's q) was freed, its memory handed to later tensors,
    and the replays computed over whatever those held (NaN and garbage outputs, caught by the
    check against the eager step)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()

    def replay(graph=graph, inputs=fn):  # inputs: kept alive as long as the replay
        graph.replay()
    return replay, outs


def _sdpa(qs, kt, vt, backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def fn():
        with sdpa_kernel([which]):
            return F.scaled_dot_product_attention(qs, kt, vt, enable_gqa=True)
    return fn


def _paged(kc, vc, page: int, ordered: bool = False):
    """The caches as pages of `page` rows in a shuffled pool (`ordered`: in the cache's own
    order), and the block table."""
    batch, seqlen = kc.shape[:2]
    per = seqlen // page
    perm = (torch.arange(batch * per, device="cuda") if ordered
            else torch.randperm(batch * per, device="cuda"))
    table = perm.view(batch, per).to(torch.int32)
    pools = []
    for c in (kc, vc):
        pool = torch.empty(batch * per, page, *c.shape[2:], device="cuda", dtype=c.dtype)
        pool[perm] = c.view(batch * per, page, *c.shape[2:])
        pools.append(pool)
    return pools[0], pools[1], table


def _page_layouts(opts) -> list[tuple[int, str]]:
    """(page size, row-name suffix) of every paged row: shuffled pools, and with
    --ordered-pages the same pages in order (" ordered")."""
    orders = ["", " ordered"] if opts.ordered_pages else [""]
    return [(page, order) for page in opts.pages for order in orders]


def _flex(qs, kt, vt, page: int = 0):
    """FlexAttention (compiled) on the (b, h, s, d) cache; page > 0: torch's PagedAttention
    (pool (1, kv_heads, pages x page, d), its converted block mask and score mod)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention, noop_mask

    flex = torch.compile(flex_attention, dynamic=False)
    batch, kv_heads, seqlen, d = kt.shape
    if not page:
        return lambda: flex(qs, kt, vt, enable_gqa=True)
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    n_pages = batch * seqlen // page
    pa = PagedAttention(n_pages, page, batch)
    kpool = torch.zeros(1, kv_heads, n_pages * page, d, device="cuda", dtype=kt.dtype)
    vpool = torch.zeros_like(kpool)
    for b in range(batch):
        pa.reserve(torch.tensor(b, device="cuda"), torch.tensor(seqlen, device="cuda"))
    pos = torch.arange(seqlen, device="cuda").expand(batch, seqlen)
    pa.assign(torch.arange(batch, device="cuda"), pos, kt, vt, kpool, vpool)
    mask = create_block_mask(noop_mask, batch, None, qs.shape[2], seqlen,
                             BLOCK_SIZE=(128, page))
    paged_mask = pa.convert_logical_block_mask(mask)
    score_mod = pa.get_score_mod(None)
    return lambda: flex(qs, kpool, vpool, block_mask=paged_mask, score_mod=score_mod,
                        enable_gqa=True)


def layer_count(opts, kv_bytes: int) -> int:
    """How many layers (each its own q and cache) a timed call steps through: --layers, or
    (0) the fewest whose K/V bytes together exceed four times the GPU's L2 cache, at most 64, so
    no layer's cache is still in L2 when its turn comes again (as in a model's decode step,
    where each layer reads its own cache once)."""
    if opts.layers:
        return opts.layers
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(64, -(-4 * l2 // kv_bytes)))


def contenders(batch, seqlen, heads, kv_heads, d, dtype, opts
               ) -> tuple[dict, int, dict, int, dict]:
    """name -> callable (graph replays but for the eager rows), each stepping through the
    layers (layer_count: every layer its own q and cache, so the caches are read from memory,
    not from L2), the bytes of one layer's cache (K and V), name -> error for contenders that
    could not be set up, the layer count, and name -> a check that the graph's outputs (after
    its last replay) still equal the eager step's, for our rows (bitwise: the decode kernels
    are deterministic), so a timing of a graph that did not compute its step is caught. A
    row's time is per layer."""
    kv_bytes = 2 * batch * seqlen * kv_heads * d * torch.finfo(dtype).bits // 8
    layers = layer_count(opts, kv_bytes)
    per_layer = [layer_contenders(batch, seqlen, heads, kv_heads, d, dtype, opts)
                 for _ in range(layers)]
    errors: dict[str, str] = {}
    for _, errs in per_layer:
        errors.update(errs)
    out, checks = {}, {}
    for name in per_layer[0][0]:
        if name in errors:
            continue
        step = _chain([layer[name] for layer, _ in per_layer])
        try:
            want = [o.clone() for o in step()]
            out[name], got = graphed(step)
            if name.startswith(("ours", "dec_")):  # ours are deterministic (SDPA's may not be)
                checks[name] = (lambda got=got, want=want: _mismatch(got, want))
        except Exception as exc:  # a backend that refuses the shape is reported, not fatal
            errors[name] = _short(exc)
            torch.cuda.synchronize()
    for name in ("ours", "sdpa"):
        out[f"{name} eager"] = _chain([layer[name] for layer, _ in per_layer])
    # the GPU's copy rate, on a buffer far larger than L2 (read + write bytes)
    src = torch.empty(2**29, device="cuda", dtype=torch.int32)
    dst = torch.empty_like(src)
    out["copy"] = lambda: dst.copy_(src)
    return out, kv_bytes, errors, layers, checks


def _mismatch(got, want) -> str:
    """"" when the graph's outputs equal the eager step's bitwise, else which layers differ and
    by how much (the largest |difference|, NaN counts): a race reads as garbage or NaN, an
    order-dependent sum as a few ulps."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if not torch.equal(g, w):
            diff = (g.float() - w.float()).abs()
            bad.append(f"layer {i}: {int((diff > 0).sum())} of {g.numel()} elements, max "
                       f"{diff.nan_to_num(float('inf')).max().item():.3g}, "
                       f"{int(g.isnan().sum())} NaN")
    return "; ".join(bad)


def _chain(fns):
    """One step through the layers: each layer's call in turn, their outputs as a list."""
    return lambda: [fn() for fn in fns]


def layer_contenders(batch, seqlen, heads, kv_heads, d, dtype, opts) -> tuple[dict, dict]:
    """One layer's eager contenders (name -> callable) over its own random q and cache, and
    name -> error for contenders that could not be set up."""
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=dtype)
    kc = torch.randn(batch, seqlen, kv_heads, d, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    eager = {"ours": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)}
    if opts.one_split:
        eager["ours 1 split"] = lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                                num_splits=1)
    for n in opts.splits:
        eager[f"ours {n} splits"] = (lambda n=n: flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens, num_splits=n))
    for spec in opts.kernels:
        name, _, splits = spec.partition("@")
        if any(f"_{fmt}_" in name for fmt in FP8_NAMES):
            continue  # timed on its FP8 cache below
        eager[spec] = (lambda name=name, n=int(splits or 0): flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens, kernel=name, num_splits=n))
    # The cache in SDPA's layout, (batch, kv_heads, seq, d) storage read through a transposed
    # view (flash_attn's (batch, seq, kv_heads, d) is the default): each head's rows contiguous.
    kt, vt = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    eager["ours bhsd"] = lambda: flash_attn_with_kvcache(q, kt.transpose(1, 2),
                                                         vt.transpose(1, 2), cache_seqlens=lens)
    for page, order in _page_layouts(opts):
        kp, vp, table = _paged(kc, vc, page, ordered=bool(order))
        eager[f"ours paged {page}{order}"] = (
            lambda kp=kp, vp=vp, table=table: flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lens, block_table=table))
        for spec in opts.kernels:  # the kernels named, over the same pages
            name, _, splits = spec.partition("@")
            if not any(f"_{fmt}_" in name for fmt in FP8_NAMES):
                eager[f"{spec} paged {page}{order}"] = (
                    lambda kp=kp, vp=vp, table=table, name=name, n=int(splits or 0):
                    flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                            kernel=name, num_splits=n))
    for fmt in opts.fp8:
        fp8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
        top = torch.finfo(fp8).max
        kd = (kc.float().abs().amax(dim=(1, 3)) / top).clamp_min(1e-12)  # (batch, kv_heads)
        vd = (vc.float().abs().amax(dim=(1, 3)) / top).clamp_min(1e-12)
        k8 = (kc.float() / kd[:, None, :, None]).to(fp8)
        v8 = (vc.float() / vd[:, None, :, None]).to(fp8)
        eager[f"ours {fmt}"] = (lambda k8=k8, v8=v8, kd=kd, vd=vd: flash_attn_with_kvcache(
            q, k8, v8, cache_seqlens=lens, k_descale=kd, v_descale=vd))
        for name in (n for n in opts.kernels if f"_{fmt}_" in n):
            eager[f"ours {fmt} {name}"] = (
                lambda k8=k8, v8=v8, kd=kd, vd=vd, name=name: flash_attn_with_kvcache(
                    q, k8, v8, cache_seqlens=lens, k_descale=kd, v_descale=vd, kernel=name))
        for page, order in _page_layouts(opts):
            kp, vp, table = _paged(k8.view(torch.uint8), v8.view(torch.uint8), page,
                                   ordered=bool(order))
            kp, vp = kp.view(fp8), vp.view(fp8)
            eager[f"ours {fmt} paged {page}{order}"] = (
                lambda kp=kp, vp=vp, table=table, kd=kd, vd=vd: flash_attn_with_kvcache(
                    q, kp, vp, cache_seqlens=lens, block_table=table, k_descale=kd,
                    v_descale=vd))
            for name in (n for n in opts.kernels if f"_{fmt}_" in n):
                eager[f"ours {fmt} {name} paged {page}{order}"] = (
                    lambda kp=kp, vp=vp, table=table, kd=kd, vd=vd, name=name:
                    flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                            k_descale=kd, v_descale=vd, kernel=name))
    if opts.spec:
        # the 16-row kernel named, beside the table's choice (32-row tiles from 17 packed rows)
        narrow = dec_sm80.select(Call(opts.dtype, d), kvcache.built())
        for n in (4, 8):
            qn = torch.randn(batch, n, heads, d, device="cuda", dtype=dtype)
            eager[f"ours q{n}"] = (lambda qn=qn: flash_attn_with_kvcache(
                qn, kc, vc, cache_seqlens=lens, causal=True))
            if n * (heads // kv_heads) >= dec_sm80.WIDE_FROM and narrow is not None:
                eager[f"ours q{n} r16"] = (lambda qn=qn: flash_attn_with_kvcache(
                    qn, kc, vc, cache_seqlens=lens, causal=True, kernel=narrow.name))
    if opts.append:
        # one new token per sequence written at row seqlen - 1 (the same row every call), rotary
        # on it and on q: attention then covers seqlen keys, as the "ours" row does
        kn, vn = (torch.randn(batch, 1, kv_heads, d, device="cuda", dtype=dtype)
                  for _ in range(2))
        angles = torch.arange(seqlen, device="cuda")[:, None] * torch.rand(d // 2, device="cuda")
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        before = lens - 1
        ka, va = kc.clone(), vc.clone()  # its own cache: the other rows read kc, vc unchanged
        eager["ours append+rotary"] = lambda: flash_attn_with_kvcache(
            q, ka, va, k=kn, v=vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=before,
            causal=True)
    qs = q.transpose(1, 2).contiguous()
    for backend in SDPA_BACKENDS:
        eager[f"sdpa {backend}"] = _sdpa(qs, kt, vt, backend)
    eager["sdpa"] = lambda: F.scaled_dot_product_attention(qs, kt, vt, enable_gqa=True)
    errors: dict[str, str] = {}
    if opts.flex:
        for page in (0, *opts.flex_pages):
            name = f"flex paged {page}" if page else "flex"
            try:
                eager[name] = _flex(qs, kt, vt, page)
            except Exception as exc:
                errors[name] = _short(exc)
    return eager, errors


def _short(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:140] if text else ''}"


def span_us(fn, calls: int = 20) -> float:
    """Microseconds per call of `calls` calls queued back to back between one pair of CUDA
    events: the end-to-end rate, against which a per-call median (events around each call) is
    checked (they disagreed on some rows of the 2026-11-28 runs, see docs/results)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per eager call: calls queued back to back with no sync between them
    (the GPU runs behind; the launch queue holds them), the first after a sync."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def profile_kernels(fns, layers: int = 1) -> None:
    """Each CUDA kernel's mean time per layer over 20 calls of each fn, `layers` layers a call
    (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / 20 / layers) for e in prof.key_averages()
                if e.device_time_total > 0]
        print(f"  profile {name}: " + "; ".join(f"{k[:60]} {us:.1f} us" for k, us in
                                                 sorted(rows, key=lambda r: -r[1])))


def summary(med: dict[str, float]) -> dict:
    """The target ratios of one shape: SDPA's best backend over ours (graph replays), the
    paged and the speculative rows over the contiguous one, append+rotary's cost."""
    sdpa = {n: t for n, t in med.items() if n.startswith("sdpa ") and n != "sdpa eager"}
    best = min(sdpa, key=sdpa.get) if sdpa else None
    out: dict = {"sdpa_best": best}
    ours = med["ours"]
    if best:
        out["sdpa_best_over_ours"] = med[best] / ours
    flex = {n: t for n, t in med.items() if n.startswith("flex")}
    for n, t in flex.items():
        out[f"{n}_over_ours"] = t / ours
    for n, t in med.items():
        if n.startswith("ours paged") or n.startswith("ours q") or n == "ours append+rotary":
            out[f"{n}_over_ours"] = t / ours
        for fmt in FP8_NAMES:  # the FP8 cache's speedup over the 16-bit one, same layout
            if n.startswith(f"ours {fmt}"):
                same = n.replace(f"ours {fmt}", "ours")
                if same in med:
                    out[f"{same}_over_{n}"] = med[same] / t
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pages", default="16,256", help="page sizes of the paged rows")
    ap.add_argument("--ordered-pages", action="store_true",
                    help="paged rows over pages in the pool's order as well (identity table)")
    ap.add_argument("--spec", action="store_true", help="rows of 4 and 8 queries, causal")
    ap.add_argument("--append", action="store_true", help="a row appending k, v with rotary")
    ap.add_argument("--flex", action="store_true", help="FlexAttention rows (compiled)")
    ap.add_argument("--flex-pages", default="64,256", help="page sizes of the flex paged rows")
    ap.add_argument("--host", action="store_true", help="host us per eager call, first shape")
    ap.add_argument("--one-split", action="store_true", help="a num_splits=1 row")
    ap.add_argument("--fp8", default="", help="FP8 cache rows: e4m3, e5m2 (comma-separated)")
    ap.add_argument("--splits", default="", help="rows with these num_splits (comma-separated)")
    ap.add_argument("--kernels", default="", help="decode kernels to time by name as well "
                    "(comma-separated; built ones; name@N forces N splits)")
    ap.add_argument("--profile", action="store_true",
                    help="also print each CUDA kernel's time per layer of the graph replays "
                         "(torch.profiler over 20 replays)")
    ap.add_argument("--layers", type=int, default=0,
                    help="layers a timed step goes through, each its own q and cache (0: enough "
                         "that their caches exceed 4x the L2 cache, so reads come from memory)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.kernels = [k for k in args.kernels.split(",") if k]
    args.pages = [int(p) for p in args.pages.split(",") if p]
    args.splits = [int(n) for n in args.splits.split(",") if n]
    args.flex_pages = [int(p) for p in args.flex_pages.split(",") if p]
    args.fp8 = [f for f in args.fp8.split(",") if f]
    heads, kv_heads = (int(x) for x in args.heads.split("/"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"# decode step, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.dtype}, heads {heads}/{kv_heads}, d_head {args.d}; us per call, median over "
          f"{args.rounds} rounds [min-max]; graph replays but for the eager rows", flush=True)
    rows = []
    for i, shape in enumerate(args.shapes.split(",")):
        batch, seqlen = (int(x) for x in shape.split("x"))
        fns, kv_bytes, errors, layers, checks = contenders(batch, seqlen, heads, kv_heads,
                                                           args.d, dtype, args)
        per = {n: (1 if n == "copy" else layers) for n in fns}  # calls of one timed step
        names = list(fns)
        times: dict[str, list[float]] = {n: [] for n in names}
        spans: dict[str, list[float]] = {n: [] for n in names}
        wrong: dict[str, list[int]] = {}  # rounds after which a graph's outputs were wrong
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                try:
                    times[n].append(
                        statistics.median(time_sustained_ms(fns[n], reps=20)) * 1e3 / per[n])
                    spans[n].append(span_us(fns[n]) / per[n])
                    torch.cuda.synchronize()
                    if n in checks and (how := checks[n]()):
                        wrong.setdefault(n, []).append(r)
                        print(f"  ! {n} round {r}: graph outputs differ from eager: {how}",
                              flush=True)
                except Exception:
                    traceback.print_exc()
                    errors[n] = "failed while timed"
        times = {n: t for n, t in times.items() if t and n not in errors}
        med = {n: statistics.median(t) for n, t in times.items()}
        if args.profile:
            profile_kernels({n: fns[n] for n in med
                             if n == "sdpa cudnn" or (n.startswith(("ours", "dec_"))
                                                      and not n.endswith("eager"))},
                            layers)
        copy_bw = 2 * 2**31 / (med["copy"] * 1e-6)
        row = {"batch": batch, "seqlen_k": seqlen, "heads": heads, "kv_heads": kv_heads,
               "d": args.d, "dtype": args.dtype, "kv_bytes": kv_bytes, "layers": layers,
               "us": med,
               "spread": {n: (min(t), max(t)) for n, t in times.items()},
               "span_us": {n: spans[n] for n in med},
               "copy_GBps": copy_bw / 1e9,
               "kv_fraction": {n: cache_bytes(n, kv_bytes) / (med[n] * 1e-6) / copy_bw
                               for n in med if n != "copy" and not n.startswith("ours q")},
               "errors": errors, "wrong_outputs_after_rounds": wrong, **summary(med)}
        if args.host and i == 0:
            row["host_us"] = {n: host_us(fns[n]) / layers for n in ("ours eager", "sdpa eager")}
        rows.append(row)
        best = row.get("sdpa_best")
        print(f"b{batch} kv{seqlen} ({kv_bytes / 2**20:.0f} MiB a layer, {layers} layers), copy "
              f"{copy_bw / 1e9:.0f} GB/s, SDPA's best backend {best}:")
        for n in med:
            lo, hi = row["spread"][n]
            frac = row["kv_fraction"].get(n)
            ratio = (f"  {best}/this {med[best] / med[n]:.2f}x"
                     if best and n.startswith(("ours", "dec_")) and not n.endswith("eager") else "")
            # a round whose per-call median is well under its end-to-end rate is not a figure
            odd = any(t < 0.9 * sp for t, sp in zip(times[n], spans[n]))
            print(f"  {n:20s} {med[n]:9.1f} us [{lo:.1f}-{hi:.1f}]"
                  + (f"  KV at {frac:.2f} of copy" if frac is not None else "") + ratio
                  + (f"  ! WRONG OUTPUTS after rounds {wrong[n]}" if n in wrong else "")
                  + ("  ! per-call under end-to-end: " + ", ".join(f"{sp:.1f}" for sp in spans[n])
                     if odd else ""), flush=True)
        speedups = {k: v for k, v in row.items() if any(k.endswith(f) or f" {f} " in k
                                                         for f in FP8_NAMES)}
        if speedups:
            print("  16-bit cache time / FP8 cache time: " + ", ".join(
                f"{k.split('_over_')[1]} {v:.2f}x" for k, v in speedups.items()))
        for n, err in errors.items():
            print(f"  {n:20s} not timed: {err}")
        if "host_us" in row:
            print("  host us per eager call: " + ", ".join(
                f"{n} {us:.1f}" for n, us in row["host_us"].items()))
        del fns
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
