"""asv: timings of attention() and of PyTorch SDPA's FLASH_ATTENTION (FA2) and CUDNN_ATTENTION
backends, over dtype x d_head x (batch, seq_len), 16 heads; Backward and TrainingStep time the
backward alone and forward + backward of the three the same way (through autograd, public API
only). All cases are measured once per run in setup_cache, in one process, with CUDA events
(median of 20 calls); the track_ methods report them. Without a GPU every benchmark here is
skipped, and so is every case the build has no kernel for (e.g. a build restricted by
FLASH_ATTENTION_KERNELS), with the reason.

Self-contained on purpose: asv runs the benchmarks of the working tree against every commit
it builds (`asv run A..B`, `asv find`), so this module uses only the package's public API
(flash_attention.attention, available_configs) and torch, and the timing code here is the same
for every commit measured. It mirrors the gate's (fa_tools), which keeps its own copy for the
same reason: the code under test never times itself. The source of the methods below is
unchanged since the first recorded results, so asv's benchmark versions (hashes of that
source) still match them.
"""

import statistics
from dataclasses import dataclass

# (batch, seqlen) pairs of the standard table: 16 heads, batch shrinking as sequences grow.
STANDARD = ((16, 512), (16, 1024), (16, 2048), (16, 4096), (8, 8192), (4, 16384))
CONTENDERS = ("ours", "sdpa_fa2", "sdpa_cudnn")
SHAPES = [f"{b}x{s}" for b, s in STANDARD]


@dataclass(frozen=True)
class Case:
    dtype: str
    d_head: int
    batch: int
    seqlen: int
    heads: int = 16
    causal: bool = False

    @property
    def name(self) -> str:
        return (f"{self.dtype}_d{self.d_head}_b{self.batch}_s{self.seqlen}"
                + ("_causal" if self.causal else ""))


ASV_CASES = tuple(Case(dt, d, b, s) for dt in ("bf16", "fp16") for d in (128, 64)
                  for b, s in STANDARD)
CAUSAL_CASES = tuple(Case(dt, 128, b, s, causal=True) for dt in ("bf16", "fp16")
                     for b, s in STANDARD)


class Measured(dict):
    """{case name: {contender: median ms}}. Looking up a case that was not measured raises
    NotImplementedError with the reason, which asv reports as a skipped benchmark."""

    def __init__(self, measured: dict, skipped: dict[str, str]) -> None:
        super().__init__(measured)
        self.skipped = skipped

    def __missing__(self, key):
        raise NotImplementedError(self.skipped.get(key, f"{key} was not measured"))


def cuda_event_ms(fn, reps: int, warmup: int) -> list[float]:
    """CUDA-event milliseconds of each call, the stream held busy (a device-side sleep) while
    the host queues the calls so host overhead does not open gaps."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    torch.cuda._sleep(2_000_000 + 100_000 * reps)
    for start, end in events:
        start.record(stream)
        fn()
        end.record(stream)
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def contenders(q, k, v, out, names=CONTENDERS, causal=False) -> dict:
    """Zero-argument callables, one per contender, on the same inputs: attention() (dispatch)
    writing into out, and SDPA restricted to one backend on the (B, H, S, D) view of the same
    tensors, causal or not. A backend that cannot run the shape is left out."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flash_attention as fa

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    backends = {"sdpa_fa2": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}

    def make_peer(backend):
        def peer():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return peer

    fns = {}
    if "ours" in names:
        fns["ours"] = ((lambda: fa.attention(q, k, v, out=out, causal=True)) if causal
                       else (lambda: fa.attention(q, k, v, out=out)))
    for name in names:
        if name in backends:
            peer = make_peer(backends[name])
            try:
                peer()
            except RuntimeError:
                continue
            fns[name] = peer
    return fns


def built_kernels() -> set[tuple[str, int]] | None:
    """(dtype, d_head) pairs the installed build has a kernel for, and (dtype, d_head, "mask")
    for kernels with causal masks (None: cannot tell)."""
    import flash_attention as fa

    try:
        configs = fa.available_configs()
    except AttributeError:  # a commit from before available_configs()
        return None
    return ({(c.dtype, c.d_head) for c in configs}
            | {(c.dtype, c.d_head, "mask") for c in configs if getattr(c, "mask", False)})


def measure(cases, contenders_=("ours", "sdpa_fa2"), reps: int = 10,
            warmup: int = 3) -> Measured:
    """Median milliseconds per case and contender. A case the build has no kernel for is
    skipped with the reason; any other failure raises (a broken benchmark must never look like
    a slow one)."""
    import torch

    import flash_attention as fa

    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    built = built_kernels()
    measured, skipped = {}, {}
    for case in cases:
        if case.causal and (built is None or (case.dtype, case.d_head, "mask") not in built):
            skipped[case.name] = (f"this build has no causal {case.dtype} d_head {case.d_head} "
                                  "kernel (masks came in with causal attention)")
            continue
        if built is not None and (case.dtype, case.d_head) not in built:
            info = (getattr(fa, "build_info", dict)() or {}).get("kernels", "?")
            skipped[case.name] = (f"this build has no {case.dtype} d_head {case.d_head} kernel "
                                  f"(FLASH_ATTENTION_KERNELS={info})")
            continue
        shape = (case.batch, case.seqlen, case.heads, case.d_head)
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtypes[case.dtype]) for _ in range(3))
        o = torch.empty_like(q)
        fns = contenders(q, k, v, o, names=contenders_, causal=case.causal)
        missing = set(contenders_) - set(fns)
        if missing:
            raise RuntimeError(f"{case.name}: {', '.join(sorted(missing))} cannot run this case")
        fns["ours"]()
        if not torch.isfinite(o).all():
            raise RuntimeError(f"{case.name}: attention() produced non-finite values")
        measured[case.name] = {name: statistics.median(cuda_event_ms(fn, reps=reps,
                                                                    warmup=warmup))
                               for name, fn in fns.items()}
        del q, k, v, o, fns
    return Measured(measured, skipped)


class Attention:
    params = (["bf16", "fp16"], [128, 64], SHAPES)
    param_names = ["dtype", "d_head", "batch_x_seq"]
    timeout = 600

    def setup_cache(self):
        import torch

        if not torch.cuda.is_available():
            return {"skip": "no CUDA GPU: timings skipped"}  # asv passes no cache for None
        return measure(list(ASV_CASES), CONTENDERS, reps=20)

    setup_cache.timeout = 1200

    def setup(self, cache, dtype, d_head, shape):
        if "skip" in cache:
            raise NotImplementedError(cache["skip"])
        batch, seqlen = (int(x) for x in shape.split("x"))
        self.r = cache[Case(dtype, d_head, batch, seqlen).name]

    def track_ours_ms(self, cache, dtype, d_head, shape):
        return self.r["ours"]

    track_ours_ms.unit = "ms"

    def track_sdpa_fa2_ms(self, cache, dtype, d_head, shape):
        return self.r["sdpa_fa2"]

    track_sdpa_fa2_ms.unit = "ms"

    def track_sdpa_cudnn_ms(self, cache, dtype, d_head, shape):
        return self.r["sdpa_cudnn"]

    track_sdpa_cudnn_ms.unit = "ms"

    def track_ratio_to_sdpa_fa2(self, cache, dtype, d_head, shape):
        """Our time over SDPA FA2's in the same run (lower is better, < 1: we are faster)."""
        return self.r["ours"] / self.r["sdpa_fa2"]

    track_ratio_to_sdpa_fa2.unit = "ratio"


class CausalAttention:
    """Causal d_head 128 (bottom-right mask; Sq == Sk here) against SDPA FA2 causal."""

    params = (["bf16", "fp16"], SHAPES)
    param_names = ["dtype", "batch_x_seq"]
    timeout = 600

    def setup_cache(self):
        import torch

        if not torch.cuda.is_available():
            return {"skip": "no CUDA GPU: timings skipped"}
        return measure(list(CAUSAL_CASES), ("ours", "sdpa_fa2"), reps=20)

    setup_cache.timeout = 1200

    def setup(self, cache, dtype, shape):
        if "skip" in cache:
            raise NotImplementedError(cache["skip"])
        batch, seqlen = (int(x) for x in shape.split("x"))
        self.r = cache[Case(dtype, 128, batch, seqlen, causal=True).name]

    def track_ours_ms(self, cache, dtype, shape):
        return self.r["ours"]

    track_ours_ms.unit = "ms"

    def track_sdpa_fa2_ms(self, cache, dtype, shape):
        return self.r["sdpa_fa2"]

    track_sdpa_fa2_ms.unit = "ms"

    def track_ratio_to_sdpa_fa2(self, cache, dtype, shape):
        """Our time over SDPA FA2 causal's in the same run (< 1: we are faster)."""
        return self.r["ours"] / self.r["sdpa_fa2"]

    track_ratio_to_sdpa_fa2.unit = "ratio"



D256_CASE = Case("bf16", 256, 16, 4096)
VARLEN_CASE = Case("bf16", 128, 16, 4096, causal=True)  # 16 sequences of varlen_lengths()


def varlen_lengths(batch: int, seqlen: int) -> list[int]:
    """Fixed pseudo-random lengths between seqlen / 4 and seqlen, the longest seqlen (the same
    draws as the gate's varlen case)."""
    import random

    rng = random.Random(seqlen * 1000 + batch)
    return [seqlen, *(rng.randint(seqlen // 4, seqlen) for _ in range(batch - 1))]


def measure_varlen(case: Case, reps: int = 20) -> dict:
    """{contender: median ms}: attention_varlen on a packed causal batch against SDPA FA2 on the
    same sequences padded to the longest (what a caller without varlen would run)."""
    import torch

    import flash_attention as fa

    if not hasattr(fa, "attention_varlen"):
        raise NotImplementedError("this build has no varlen entry (attention_varlen)")
    lengths = varlen_lengths(case.batch, case.seqlen)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
    shape = (case.batch, case.seqlen, case.heads, case.d_head)
    padded = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3)]
    q, k, v = (torch.cat([t[b, :n] for b, n in enumerate(lengths)]) for t in padded)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    fns = contenders(*padded, None, names=("sdpa_fa2",), causal=case.causal)
    fns["ours"] = lambda: fa.attention_varlen(q, k, v, cu, cu, case.seqlen, case.seqlen,
                                              causal=case.causal)
    if not torch.isfinite(fns["ours"]()).all():
        raise RuntimeError("attention_varlen produced non-finite values")
    return {name: statistics.median(cuda_event_ms(fn, reps=reps, warmup=3))
            for name, fn in fns.items()}


class FeatureAttention:
    """One non-causal d_head 256 case (bf16 16 x 4096) against SDPA FA2, and one causal varlen
    batch (bf16 d_head 128, 16 sequences of 1024-4096 tokens) against SDPA FA2 causal on the
    same sequences padded to 4096."""

    params = (["d256", "varlen_causal"],)
    param_names = ["case"]
    timeout = 600

    def setup_cache(self):
        import torch

        if not torch.cuda.is_available():
            return {"skip": "no CUDA GPU: timings skipped"}
        results = {}
        d256 = measure([D256_CASE], ("ours", "sdpa_fa2"), reps=20)
        results["d256"] = d256.get(D256_CASE.name, {"skip": d256.skipped.get(D256_CASE.name)})
        try:
            results["varlen_causal"] = measure_varlen(VARLEN_CASE)
        except NotImplementedError as exc:
            results["varlen_causal"] = {"skip": str(exc)}
        return results

    setup_cache.timeout = 1200

    def setup(self, cache, case):
        if "skip" in cache:
            raise NotImplementedError(cache["skip"])
        self.r = cache[case]
        if "skip" in self.r:
            raise NotImplementedError(self.r["skip"])

    def track_ours_ms(self, cache, case):
        return self.r["ours"]

    track_ours_ms.unit = "ms"

    def track_sdpa_fa2_ms(self, cache, case):
        return self.r["sdpa_fa2"]

    track_sdpa_fa2_ms.unit = "ms"

    def track_ratio_to_sdpa_fa2(self, cache, case):
        """Our time over SDPA FA2's in the same run (< 1: we are faster)."""
        return self.r["ours"] / self.r["sdpa_fa2"]

    track_ratio_to_sdpa_fa2.unit = "ratio"


# ---- the backward and the training step -------------------------------------------------------

# (batch, seqlen) pairs of the backward tables: a short, the standard and a long sequence.
BWD_STANDARD = ((16, 1024), (16, 4096), (4, 16384))
BWD_SHAPES = [f"{b}x{s}" for b, s in BWD_STANDARD]
MASKS = ["full", "causal"]
BWD_CASES = tuple(Case(dt, d, b, s, causal=mask == "causal") for dt in ("bf16", "fp16")
                  for d in (128, 64) for mask in MASKS for b, s in BWD_STANDARD)


# A backward kernel that serves every call (varlen too, on any GPU) as its operator lists it:
# bwd_sm80_<dtype>_d<d_head>_..._f<flags>, or bwd_<dtype>_d<d_head>_..._f<flags> in a build from
# before the one name scheme (this module runs against older commits and reads their names).
SM80_BWD_NAME = r"bwd_(?:sm80_)?(fp16|bf16)_d(\d+)_.*_f([a-z]*)"


def backward_kernels() -> set[tuple[str, int]] | None:
    """(dtype, d_head variant) of the installed build's sm80-family backward kernels (those
    that serve every call) without a softcap, as its operator lists them (SM80_BWD_NAME); None
    for a build from before the backward."""
    import re

    import torch

    import flash_attention as fa

    fa.available_configs()  # loads the extension, which defines the operators
    try:
        names = torch.ops.flash_attention.bwd_kernels()
    except (AttributeError, RuntimeError):  # no such operator
        return None
    found = (re.fullmatch(SM80_BWD_NAME, n) for n in names.split(","))
    return {(m[1], int(m[2])) for m in found if m and "t" not in m[3]}


def grad_contenders(q, k, v, dout, kind: str, causal: bool) -> dict:
    """Zero-argument callables, one per contender, on the same tensors, each returning the
    gradients of q, k, v: kind "bwd" times the backward alone (autograd.grad on a graph made
    once and kept), "fwdbwd" a training step (the forward and autograd.grad, a new graph per
    call). Ours is attention() on q, k, v (B, S, H, D); the SDPA backends run on their
    (B, H, S, D) views. A backend that cannot run the case is left out."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flash_attention as fa

    def timed(forward, leaves, grad_out):
        if kind == "bwd":
            out = forward()
            return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
        return lambda: torch.autograd.grad(forward(), leaves, grad_out)

    ours = tuple(t.detach().requires_grad_() for t in (q, k, v))
    fns = {"ours": timed(lambda: fa.attention(*ours, causal=causal), ours, dout)}
    peer_leaves = tuple(t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    for name, backend in (("sdpa_fa2", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def forward(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(*peer_leaves, is_causal=causal)
        try:
            fn = timed(forward, peer_leaves, dout.transpose(1, 2))
            fn()
        except RuntimeError:
            continue
        fns[name] = fn
    return fns


def measure_grads(cases, kind: str, reps: int = 20, warmup: int = 3) -> Measured:
    """Median milliseconds per case and contender (grad_contenders) of the backward (kind
    "bwd") or a training step ("fwdbwd"), on new random tensors per case. A case the build has
    no backward kernel for is skipped with the reason; a peer that cannot run it is absent
    (its tracks give nan); any failure of ours raises (a broken benchmark must never look like
    a slow one)."""
    import torch

    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    built = backward_kernels()
    measured, skipped = {}, {}
    for case in cases:
        if built is None:
            skipped[case.name] = "this build has no backward (no flash_attention::bwd_kernels)"
            continue
        if not any(dt == case.dtype and d >= case.d_head for dt, d in built):
            skipped[case.name] = (f"this build has no {case.dtype} backward kernel for d_head "
                                  f"{case.d_head} (FLASH_ATTENTION_KERNELS)")
            continue
        shape = (case.batch, case.seqlen, case.heads, case.d_head)
        q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtypes[case.dtype])
                         for _ in range(4))
        fns = grad_contenders(q, k, v, dout, kind, case.causal)
        if not all(torch.isfinite(g).all() for g in fns["ours"]()):
            raise RuntimeError(f"{case.name}: the backward produced non-finite gradients")
        measured[case.name] = {name: statistics.median(cuda_event_ms(fn, reps=reps,
                                                                    warmup=warmup))
                               for name, fn in fns.items()}
        del q, k, v, dout, fns
    return Measured(measured, skipped)


class Backward:
    """The backward alone (on the forward's kept graph: what a training step's backward costs)
    of ours, SDPA FA2 and SDPA cuDNN in the same run, d_head 128 and 64, without a mask and
    causal; a peer that cannot run a case records nan."""

    params = (["bf16", "fp16"], [128, 64], MASKS, BWD_SHAPES)
    param_names = ["dtype", "d_head", "mask", "batch_x_seq"]
    timeout = 600

    def setup_cache(self):
        import torch

        if not torch.cuda.is_available():
            return {"skip": "no CUDA GPU: timings skipped"}
        return measure_grads(list(BWD_CASES), "bwd")

    setup_cache.timeout = 1200

    def setup(self, cache, dtype, d_head, mask, shape):
        if "skip" in cache:
            raise NotImplementedError(cache["skip"])
        batch, seqlen = (int(x) for x in shape.split("x"))
        self.r = cache[Case(dtype, d_head, batch, seqlen, causal=mask == "causal").name]

    def track_ours_ms(self, cache, dtype, d_head, mask, shape):
        return self.r["ours"]

    track_ours_ms.unit = "ms"

    def track_sdpa_fa2_ms(self, cache, dtype, d_head, mask, shape):
        return self.r.get("sdpa_fa2", float("nan"))

    track_sdpa_fa2_ms.unit = "ms"

    def track_sdpa_cudnn_ms(self, cache, dtype, d_head, mask, shape):
        return self.r.get("sdpa_cudnn", float("nan"))

    track_sdpa_cudnn_ms.unit = "ms"

    def track_ratio_to_sdpa_fa2(self, cache, dtype, d_head, mask, shape):
        """Our time over SDPA FA2's in the same run (< 1: we are faster)."""
        return self.r["ours"] / self.r.get("sdpa_fa2", float("nan"))

    track_ratio_to_sdpa_fa2.unit = "ratio"

    def track_ratio_to_sdpa_cudnn(self, cache, dtype, d_head, mask, shape):
        """Our time over SDPA cuDNN's in the same run (< 1: we are faster)."""
        return self.r["ours"] / self.r.get("sdpa_cudnn", float("nan"))

    track_ratio_to_sdpa_cudnn.unit = "ratio"


class TrainingStep(Backward):
    """Forward + backward as a training step makes them (a new graph per call), the same cases
    and contenders as Backward."""

    def setup_cache(self):
        import torch

        if not torch.cuda.is_available():
            return {"skip": "no CUDA GPU: timings skipped"}
        return measure_grads(list(BWD_CASES), "fwdbwd")

    setup_cache.timeout = 1200


# ---- decode steps -----------------------------------------------------------------------------

# (batch, cached keys, page size; 0 = contiguous) of the decode rows: GQA 32/8, d_head 128,
# bf16, one query per sequence (issue 44's shapes: split-KV at batch 1, one pass at 64).
DECODE_STEPS = ((1, 8192, 0), (16, 8192, 0), (64, 8192, 0), (16, 8192, 16), (16, 8192, 256))
DECODE_SHAPES = [f"b{b}_k{k}" + (f"_page{p}" if p else "") for b, k, p in DECODE_STEPS]


def paged_cache(k, v, page: int, table=None):
    """(block table, (k, v) as pools of `page`-row pages in a random order, or in `table`'s),
    or (None, (k, v)) with page 0. k, v (batch, keys, kv_heads, d) of any dtype (FP8 ones
    copied as bytes)."""
    import torch
    import torch.nn.functional as F

    if not page:
        return None, (k, v)
    batch, keys = k.shape[:2]
    per_seq = -(-keys // page)
    if table is None:
        table = torch.randperm(batch * per_seq, device=k.device, dtype=torch.int32)
        table = table.view(batch, per_seq)

    def paged(t):
        raw = t.view(torch.uint8) if t.element_size() == 1 else t
        raw = F.pad(raw, (0, 0, 0, 0, 0, per_seq * page - keys))
        pool = torch.empty(batch * per_seq, page, *t.shape[2:], device=t.device,
                           dtype=raw.dtype)
        pool[table.flatten().long()] = raw.reshape(-1, page, *t.shape[2:])
        return pool.view(t.dtype)

    return table, (paged(k), paged(v))


def measure_decode(batch: int, keys: int, page: int, reps: int = 50) -> dict:
    """{contender: median ms} of one decode step: flash_attn_with_kvcache over a full cache of
    `keys` keys (contiguous, or in pages of `page` rows placed in a random order), and SDPA
    restricted to cuDNN and to FA2 (enable_gqa) on the contiguous cache. Each timed call goes
    through enough layers, each its own q and cache, that their caches exceed 4x the L2 (a
    cache smaller than L2 would otherwise be read from it, which a model's decode step never
    sees; docs/results/2026-12-02-h200-decode-per-layer-caches.md): times are per layer. A
    build from before the KV-cache API is skipped with the reason."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        from flash_attention.interface import flash_attn_with_kvcache
    except ImportError as exc:
        raise NotImplementedError(f"this build has no flash_attn_with_kvcache ({exc})") from None
    heads, kv_heads, d = 32, 8, 128
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    layers = max(1, min(64, -(-4 * l2 // (2 * batch * keys * kv_heads * d * 2))))
    seqlens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    ours, peers = [], {"sdpa_cudnn": [], "sdpa_fa2": []}
    for _ in range(layers):
        q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, keys, kv_heads, d, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        table, (k_cache, v_cache) = paged_cache(k, v, page)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        ours.append(lambda q=q, kc=k_cache, vc=v_cache, table=table: flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens, block_table=table))
        for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("sdpa_fa2", SDPBackend.FLASH_ATTENTION)):
            def peer(qt=qt, kt=kt, vt=vt, backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            peers[name].append(peer)

    def steps(fns):
        return lambda: [fn() for fn in fns]

    fns = {"ours": steps(ours)}
    for name, layer_fns in peers.items():
        try:
            layer_fns[0]()
        except RuntimeError:
            continue
        fns[name] = steps(layer_fns)
    if not all(torch.isfinite(out).all() for out in fns["ours"]()):
        raise RuntimeError("flash_attn_with_kvcache produced non-finite values")
    return {name: statistics.median(cuda_event_ms(fn, reps=reps, warmup=5)) / layers
            for name, fn in fns.items()}


class Decode:
    """Decode steps (DECODE_STEPS) of ours against SDPA's cuDNN and FA2 backends on the same
    cache, and the ratio to cuDNN, SDPA's fastest backend for decode on Hopper
    (docs/results/2026-11-28-h200-decode-targets.md); a peer that cannot run a step records
    nan."""

    params = (DECODE_SHAPES,)
    param_names = ["step"]
    timeout = 600

    def setup_cache(self):
        import torch

        if not torch.cuda.is_available():
            return {"skip": "no CUDA GPU: timings skipped"}
        results = {}
        for shape, (batch, keys, page) in zip(DECODE_SHAPES, DECODE_STEPS):
            try:
                results[shape] = measure_decode(batch, keys, page)
            except NotImplementedError as exc:
                results[shape] = {"skip": str(exc)}
        return results

    setup_cache.timeout = 1200

    def setup(self, cache, step):
        if "skip" in cache:
            raise NotImplementedError(cache["skip"])
        self.r = cache[step]
        if "skip" in self.r:
            raise NotImplementedError(self.r["skip"])

    def track_ours_ms(self, cache, step):
        return self.r["ours"]

    track_ours_ms.unit = "ms"

    def track_sdpa_cudnn_ms(self, cache, step):
        return self.r.get("sdpa_cudnn", float("nan"))

    track_sdpa_cudnn_ms.unit = "ms"

    def track_ratio_to_sdpa_cudnn(self, cache, step):
        """Our time over SDPA cuDNN's in the same run (< 1: we are faster; nan where cuDNN
        does not run the step)."""
        return self.r["ours"] / self.r.get("sdpa_cudnn", float("nan"))

    track_ratio_to_sdpa_cudnn.unit = "ratio"


# ---- FP8 forward ------------------------------------------------------------------------------

# (batch, seqlen, causal) of the FP8 rows: 16 heads, d_head 128 (issue 46's targets from 4096).
FP8_STEPS = ((16, 4096, False), (4, 16384, False), (16, 4096, True), (4, 16384, True))
FP8_SHAPES = [f"{b}x{s}" + ("_causal" if c else "") for b, s, c in FP8_STEPS]


def measure_fp8(batch: int, seqlen: int, causal: bool, reps: int = 20) -> dict:
    """{contender: median ms}: flash_attention.fp8.attention_fp8 on float8_e4m3fn q, k, v
    (quantised per (batch, head)) and ours in bf16 on the same values. A build from before the
    FP8 forward, or a GPU without it (not sm_90), is skipped with the reason."""
    import torch

    try:
        from flash_attention import attention, fp8
    except ImportError as exc:
        raise NotImplementedError(f"this build has no FP8 forward ({exc})") from None
    if torch.cuda.get_device_capability() != (9, 0):
        raise NotImplementedError("the FP8 forward runs on sm_90 GPUs alone")
    q, k, v = (torch.randn(batch, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v)
    fns = {"fp8": lambda: fp8.attention_fp8(q8, k8, v8, qd, kd, vd, causal=causal),
           "bf16": lambda: attention(q, k, v, causal=causal)}
    if not torch.isfinite(fns["fp8"]()).all():
        raise RuntimeError("the FP8 forward produced non-finite values")
    return {name: statistics.median(cuda_event_ms(fn, reps=reps, warmup=5))
            for name, fn in fns.items()}


class Fp8Forward:
    """The FP8 (e4m3) forward (FP8_STEPS) against ours in bf16 on the same values, and the
    speedup FP8 gives (bf16 time over FP8 time; > 1: FP8 is faster)."""

    params = (FP8_SHAPES,)
    param_names = ["shape"]
    timeout = 600

    def setup_cache(self):
        import torch

        if not torch.cuda.is_available():
            return {"skip": "no CUDA GPU: timings skipped"}
        results = {}
        for shape, (batch, seqlen, causal) in zip(FP8_SHAPES, FP8_STEPS):
            try:
                results[shape] = measure_fp8(batch, seqlen, causal)
            except NotImplementedError as exc:
                results[shape] = {"skip": str(exc)}
        return results

    setup_cache.timeout = 1200

    def setup(self, cache, shape):
        if "skip" in cache:
            raise NotImplementedError(cache["skip"])
        self.r = cache[shape]
        if "skip" in self.r:
            raise NotImplementedError(self.r["skip"])

    def track_fp8_ms(self, cache, shape):
        return self.r["fp8"]

    track_fp8_ms.unit = "ms"

    def track_bf16_ms(self, cache, shape):
        return self.r["bf16"]

    track_bf16_ms.unit = "ms"

    def track_speedup_over_bf16(self, cache, shape):
        """bf16 time over FP8 time in the same run (issue 46's targets: >= 1.5 for the
        forward, >= 1.8 for a decode step over an FP8 KV cache)."""
        return self.r["bf16"] / self.r["fp8"]

    track_speedup_over_bf16.unit = "ratio"


# ---- FP8 KV cache -----------------------------------------------------------------------------

# (batch, keys, page size, cache dtype) of the FP8 cache rows: bf16 q, GQA 32/8, d_head 128.
FP8_CACHE_STEPS = ((16, 32768, 0, "e4m3"), (64, 8192, 0, "e5m2"), (16, 8192, 256, "e4m3"))
FP8_CACHE_SHAPES = [f"b{b}_k{k}" + (f"_page{p}" if p else "") + f"_{fmt}"
                    for b, k, p, fmt in FP8_CACHE_STEPS]


def measure_fp8_cache(batch: int, keys: int, page: int, fmt: str, reps: int = 50) -> dict:
    """{contender: median ms} of one decode step with a bf16 q: over an FP8 cache ("fp8", each
    (sequence, KV head)'s amax mapped to the format's largest value) and over the same values
    in a bf16 cache ("bf16"), paged alike. A build from before FP8 caches is skipped."""
    import inspect

    import torch

    try:
        from flash_attention.interface import flash_attn_with_kvcache
    except ImportError as exc:
        raise NotImplementedError(f"this build has no flash_attn_with_kvcache ({exc})") from None
    if "k_descale" not in inspect.signature(flash_attn_with_kvcache).parameters:
        raise NotImplementedError("this build's flash_attn_with_kvcache takes no FP8 cache")
    heads, kv_heads, d = 32, 8, 128
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, keys, kv_heads, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    top = torch.finfo(dtype).max
    kd, vd = ((t.float().abs().amax(dim=(1, 3)) / top).clamp_min(1e-12) for t in (k, v))
    k8, v8 = ((t.float() / s[:, None, :, None]).to(dtype) for t, s in ((k, kd), (v, vd)))
    seqlens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    table, (k16, v16) = paged_cache(k, v, page)
    _, (k8, v8) = paged_cache(k8, v8, page, table)  # the same pages for both caches
    fns = {"fp8": lambda: flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens,
                                                  block_table=table, k_descale=kd,
                                                  v_descale=vd),
           "bf16": lambda: flash_attn_with_kvcache(q, k16, v16, cache_seqlens=seqlens,
                                                   block_table=table)}
    if not torch.isfinite(fns["fp8"]()).all():
        raise RuntimeError("flash_attn_with_kvcache over an FP8 cache produced non-finite values")
    return {name: statistics.median(cuda_event_ms(fn, reps=reps, warmup=5))
            for name, fn in fns.items()}


class Fp8CacheDecode(Fp8Forward):
    """Decode steps over an FP8 KV cache (FP8_CACHE_STEPS) against the same values in a bf16
    cache, and the speedup (bf16 time over FP8 time); the tracks are Fp8Forward's."""

    params = (FP8_CACHE_SHAPES,)
    param_names = ["step"]

    def setup_cache(self):
        import torch

        if not torch.cuda.is_available():
            return {"skip": "no CUDA GPU: timings skipped"}
        results = {}
        for shape, step in zip(FP8_CACHE_SHAPES, FP8_CACHE_STEPS):
            try:
                results[shape] = measure_fp8_cache(*step)
            except NotImplementedError as exc:
                results[shape] = {"skip": str(exc)}
        return results

    setup_cache.timeout = 1200
