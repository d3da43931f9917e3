"""The performance cases the gate and asv measure, and measuring them in one process: every
case is timed for attention() (dispatched config) and for PyTorch SDPA's FA2 backend on the same
inputs, with CUDA events (flash_attention.timing)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

# (batch, seqlen) pairs of the standard table: 16 heads, batch shrinking as sequences grow.
STANDARD = ((16, 512), (16, 1024), (16, 2048), (16, 4096), (8, 8192), (4, 16384))


@dataclass(frozen=True)
class Case:
    dtype: str
    d_head: int
    batch: int
    seqlen: int
    heads: int = 16
    causal: bool = False
    varlen: bool = False  # a packed batch of `batch` sequences of varlen_lengths() tokens

    @property
    def name(self) -> str:
        return (f"{self.dtype}_d{self.d_head}_b{self.batch}_s{self.seqlen}"
                + ("_causal" if self.causal else "") + ("_varlen" if self.varlen else ""))

    def as_dict(self) -> dict:
        return asdict(self)


def varlen_lengths(case: Case) -> list[int]:
    """The sequence lengths of a varlen case: fixed pseudo-random draws between a quarter of
    seqlen and seqlen (the longest is seqlen), the same in every process."""
    import random

    rng = random.Random(case.seqlen * 1000 + case.batch)
    lengths = [rng.randint(case.seqlen // 4, case.seqlen) for _ in range(case.batch - 1)]
    return [case.seqlen, *lengths]


# The perf gate's cases: both dtypes at d_head 128 over short, mid and long sequences, d 64
# and 256, causal d 128 (against SDPA FA2 causal) and a causal varlen batch (against SDPA FA2 on
# the same sequences padded to the longest).
GATE_CASES = tuple(
    [Case(dt, 128, b, s) for dt in ("bf16", "fp16")
     for b, s in ((16, 1024), (16, 4096), (4, 16384))]
    + [Case("bf16", 64, 16, 4096), Case("bf16", 256, 16, 4096),
       Case("bf16", 128, 16, 4096, causal=True),
       Case("bf16", 128, 16, 4096, causal=True, varlen=True)]
)
# asv's cases: the standard table for both dtypes and both d_heads.
ASV_CASES = tuple(Case(dt, d, b, s) for dt in ("bf16", "fp16") for d in (128, 64)
                  for b, s in STANDARD)

CONTENDERS = ("ours", "sdpa_fa2", "sdpa_cudnn")


def time_cuda_ms(fn, reps: int, warmup: int) -> list[float]:
    """CUDA-event milliseconds of each call, the stream held busy (a device-side sleep) while
    the host queues the calls so host overhead does not open gaps. Kept here, not imported from
    the build under test, so both sides of an A/B comparison are timed by the same code."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000 + 100_000 * reps)
    return _queued_calls_ms(fn, reps)


def _queued_calls_ms(fn, reps: int, stamps=None) -> list[float]:
    """Queues `reps` calls of fn between CUDA events on the current stream, then waits: the
    milliseconds of each. stamps (gpu.clockstamp.Stamps): marked before and after the calls."""
    import torch

    stream = torch.cuda.current_stream()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    if stamps is not None:
        stamps.mark()
    for start, end in events:
        start.record(stream)
        fn()
        end.record(stream)
    if stamps is not None:
        stamps.mark()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def time_sustained_ms(fn, reps: int, warm_ms: float = 300.0, one_ms: float | None = None,
                      stamps=None) -> list[float]:
    """CUDA-event milliseconds of each of `reps` calls made after about `warm_ms` of the same
    calls back to back, all queued without a gap: the GPU at the steady state of continuous
    work, clocks settled under its power limit. (A burst after an idle gap runs at boost clocks
    that fall within tens of milliseconds, by how much depends on the kernel, so short bursts
    rank contenders differently from continuous use: on an H100 at 700 W, 16 x 4096 x 16 heads
    bf16 d128, SDPA cuDNN 3.58 ms and ours 3.64 ms sustained at about 1.5 GHz, against 3.25 and
    3.8 ms median in 10-call bursts; docs/results.md.) one_ms: the time of one call if known
    (else measured first), which sets how many warm calls make warm_ms. stamps: clock stamps
    around the timed calls (the cycles they took, gpu.clockstamp)."""
    import torch

    if one_ms is None:
        fn()
        torch.cuda.synchronize()
        one_ms = statistics.median(time_cuda_ms(fn, reps=3, warmup=0))
    for _ in range(max(1, int(warm_ms / max(one_ms, 1e-3)))):
        fn()
    return _queued_calls_ms(fn, reps, stamps)


def time_sustained_cycles(fn, reps: int, warm_ms: float = 300.0, one_ms: float | None = None
                          ) -> tuple[list[float], float, float]:
    """time_sustained_ms with clock stamps around the timed calls: (milliseconds of each call,
    millions of SM cycles per call, mean SM clock in MHz over the calls)."""
    from .clockstamp import Stamps

    stamps = Stamps()
    times = time_sustained_ms(fn, reps, warm_ms, one_ms, stamps)
    return times, stamps.cycles() / reps / 1e6, stamps.mhz()


@dataclass(frozen=True)
class RoundTiming:
    """One contender in one round: the median milliseconds of its calls, the SM cycles per call
    (which the clock it ran at does not move) and the mean SM clock over the calls."""

    ms: float
    cycles: float
    mhz: float


@dataclass
class WindowVsFull:
    """Sliding-window timings against the full kernel on the same inputs (window_vs_full), one
    RoundTiming per round for the full kernel and for each window config."""

    shape: str
    fraction: float  # visible fraction of the (query, key) pairs
    full: list[RoundTiming]
    window: dict[str, list[RoundTiming]]  # per config

    def ratios(self, config: str, cycles: bool = False) -> list[float]:
        """Per round: window / (visible fraction x full), in time or in SM cycles; 1.0 = the
        window costs exactly its share of the work."""
        key = "cycles" if cycles else "ms"
        return [getattr(w, key) / (self.fraction * getattr(f, key))
                for w, f in zip(self.window[config], self.full)]

    def lines(self) -> list[str]:
        def spread(xs, fmt):
            return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}, {max(xs):{fmt}}]"

        def timing(ts):
            return (f"{spread([t.ms for t in ts], '.3f')} ms at "
                    f"{spread([t.mhz for t in ts], '.0f')} MHz")

        out = [f"{self.shape}, visible fraction {self.fraction:.4f}, full {timing(self.full)}"]
        for c, ts in self.window.items():
            out.append(f"{c:36s} window {timing(ts)}  window/(fraction*full) = "
                       f"{spread(self.ratios(c), '.3f')}, in SM cycles "
                       f"{spread(self.ratios(c, cycles=True), '.3f')}")
        return out


def window_vs_full(configs=("dispatched",), dtype: str = "bf16", rounds: int = 3,
                   batch: int = 8, seqlen: int = 8192, window=(1024, 1024),
                   progress=print) -> WindowVsFull:
    """The features issue's window case: window (1024, 1024) at 8 x 8192 x 16 heads, d_head 128,
    for each config ("dispatched" or a built sm90 config with masks) against the dispatched full
    kernel, interleaved over `rounds` rounds, each timing the median of 10 calls after 300 ms
    of the same calls (time_sustained_cycles)."""
    import torch

    import flash_attention as fa
    from flash_attention.masks import visible

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    q, k, v = (torch.randn(batch, seqlen, 16, 128, device="cuda", dtype=dt) for _ in range(3))
    out = torch.empty_like(q)

    def call(config):
        opts = {} if config == "dispatched" else {"config": config}
        return lambda: fa.attention(q, k, v, out=out, window_size=window, **opts)

    def timed(fn) -> RoundTiming:
        ms, cycles, mhz = time_sustained_cycles(fn, 10)
        return RoundTiming(statistics.median(ms), cycles, mhz)

    res = WindowVsFull(f"window {tuple(window)} {batch}x{seqlen} {dtype} d128",
                       visible(seqlen, seqlen, *window, "cuda").float().mean().item(), [],
                       {c: [] for c in configs})
    for r in range(rounds):
        res.full.append(timed(lambda: fa.attention(q, k, v, out=out)))
        for c in configs:
            res.window[c].append(timed(call(c)))
        if progress:
            progress(f"window rounds {r + 1}/{rounds} done")
    return res


def contenders(q, k, v, out, config=None, names=CONTENDERS, causal: bool = False,
               varlen=None) -> dict:
    """Zero-argument callables, one per contender, on the same inputs: attention() (the given
    config, else dispatch) writing into out, and SDPA restricted to one backend on the
    (B, H, S, D) view of the same tensors, causal or not. A backend that cannot run the shape is
    left out. (Without causal, attention() is called exactly as before the argument existed, so
    a base from then runs.) varlen: (cu_seqlens, max_seqlen, (qp, kp, vp)): ours runs
    attention_varlen on the packed q, k, v, the peers on the padded qp, kp, vp."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flash_attention as fa

    if varlen is not None:
        cu, max_len, padded = varlen
        fns = contenders(*padded, None, names=tuple(n for n in names if n != "ours"),
                         causal=causal)
        if "ours" in names:
            fns["ours"] = lambda: fa.attention_varlen(q, k, v, cu, cu, max_len, max_len,
                                                      causal=causal)
        return fns
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    backends = {"sdpa_fa2": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}

    def make_peer(backend):
        def peer():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        return peer

    fns = {}
    extra = {"causal": True} if causal else {}
    if "ours" in names:
        fns["ours"] = (lambda: fa.attention(q, k, v, out=out, **extra)) if config is None else (
            lambda: fa.attention(q, k, v, out=out, config=config, **extra))
    for name in names:
        if name in backends:
            peer = make_peer(backends[name])
            try:
                peer()
            except RuntimeError:
                continue
            fns[name] = peer
    return fns


@dataclass
class Inputs:
    """Random q, k, v of a case (BSHD) and the output buffer attention() writes into; for a
    varlen case q, k, v are packed (total, H, D), and `varlen` holds cu_seqlens, the longest
    length and the same tokens padded to it (B, S, H, D) for the peers."""

    q: object
    k: object
    v: object
    out: object
    varlen: tuple | None = None
    last_ms: dict = field(default_factory=dict)  # {contender: median ms of its last timing}
    planted: dict = field(default_factory=dict)  # {fraction: (k, v)}, planted_attention

    @classmethod
    def make(cls, case: Case) -> Inputs:
        import torch

        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
        shape = (case.batch, case.seqlen, case.heads, case.d_head)
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
        if not case.varlen:
            return cls(q, k, v, torch.empty_like(q))
        lengths = varlen_lengths(case)
        packed = [torch.cat([t[b, :n] for b, n in enumerate(lengths)]) for t in (q, k, v)]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        return cls(*packed, torch.empty_like(packed[0]), (cu, max(lengths), (q, k, v)))


def planted_keys(case: Case, fraction: float) -> int:
    """How many keys a planted slowdown of `fraction` adds to every sequence of the case: the
    nearest whole number to fraction x seqlen, at least one."""
    return max(1, round(fraction * case.seqlen))


def planted_attention(case: Case, inputs: Inputs, fraction: float):
    """attention() on the case's queries against planted_keys(case, fraction) more keys and
    values per sequence: the same kernel, the same grid, every tile doing that much more work at
    the same power density (a kernel that got slower by that much). The gate's power study
    (fa-tools gate calibrate) plants this, nothing else. The work added is whole KV blocks of
    the kernel (a partial one costs a full one), so the slowdown is fine-grained on long
    sequences (a 128-key block is 0.8% of 16384 keys, 3.1% of 4096); with causal, each query
    sees the added keys, twice the share of a causal problem's work.

    (Two plants before it were no slowdown of known size on an H100 at its power limit: a
    device-side spin after each call lowered the power, the clocks rose, and a 1.5% spin
    measured 0.987 to 1.055 in runs seconds apart; more (batch, head) pairs filled the last
    partial wave of the grid for free or added a whole one, 8 more of 256 heads costing 0.3% at
    16 x 1024 and 1.6% at 16 x 4096.)"""
    import torch

    import flash_attention as fa

    if case.varlen:
        raise ValueError(f"{case.name}: planted slowdowns are for fixed-length cases")
    if fraction not in inputs.planted:  # made once per worker, kept with the case's inputs
        shape = (case.batch, case.seqlen + planted_keys(case, fraction), case.heads,
                 case.d_head)
        k, v = (torch.randn(shape, device="cuda", dtype=inputs.q.dtype) for _ in range(2))
        inputs.planted[fraction] = (k, v)
    k, v = inputs.planted[fraction]
    q, out = inputs.q, inputs.out
    extra = {"causal": True} if case.causal else {}
    return lambda: fa.attention(q, k, v, out=out, **extra)


def measure_case(case: Case, inputs: Inputs, contenders_: tuple[str, ...] = ("ours", "sdpa_fa2"),
                 reps: int = 10, warmup: int = 3, slowdown: float = 0.0, warm_ms: float = 0.0
                 ) -> dict[str, float]:
    """{contender: median ms over reps calls} of one case; raises on any failure (a broken
    benchmark must never look like a slow one). warm_ms > 0: each contender's timed calls
    follow about warm_ms of its own calls queued back to back (time_sustained_ms: the steady
    state under the power limit), and the reply also holds, per contender, the SM cycles per
    call over the timed calls ("<name>_mcycles", millions) and the mean SM clock ("<name>_mhz")
    from clock stamps around them (gpu.clockstamp); else `warmup` calls and a burst after a
    device-side sleep."""
    import torch

    fns = contenders(inputs.q, inputs.k, inputs.v, inputs.out, names=contenders_,
                     causal=case.causal, varlen=inputs.varlen)
    missing = set(contenders_) - set(fns)
    if missing:
        raise RuntimeError(f"{case.name}: {', '.join(sorted(missing))} cannot run this case")
    inputs.out.fill_(float("nan"))
    result = fns["ours"]()
    out = inputs.out if inputs.varlen is None else result  # varlen returns its output
    if not torch.isfinite(out).all():
        raise RuntimeError(f"{case.name}: attention() produced non-finite values")
    if slowdown > 0:
        fns["ours"] = planted_attention(case, inputs, slowdown)
    result: dict[str, float] = {}
    for name, fn in fns.items():
        if warm_ms > 0:
            times, result[f"{name}_mcycles"], result[f"{name}_mhz"] = time_sustained_cycles(
                fn, reps, warm_ms, inputs.last_ms.get(name))
        else:
            times = time_cuda_ms(fn, reps=reps, warmup=warmup)
        result[name] = inputs.last_ms[name] = statistics.median(times)
    return result


def measure(cases: list[Case], contenders_: tuple[str, ...] = ("ours", "sdpa_fa2"),
            reps: int = 10, warmup: int = 3) -> dict[str, dict[str, float]]:
    """{case name: {contender: median ms over reps calls}}, fresh inputs per case."""
    return {case.name: measure_case(case, Inputs.make(case), contenders_, reps, warmup)
            for case in cases}
