"""The performance cases the gate and asv measure, and measuring them in one process: every
case is timed for ours and for PyTorch SDPA's FA2 backend on the same inputs, with CUDA events
(flash_attention.timing). What a case times is its kind: the forward (attention()), the backward
(the flash_attention::bwd operator on the forward's saved out and LSE; SDPA's backward through
autograd with its graph kept) or a training step (forward and autograd backward, a new graph
per call, for both)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace

# (batch, seqlen) pairs of the standard table: 16 heads, batch shrinking as sequences grow.
STANDARD = ((16, 512), (16, 1024), (16, 2048), (16, 4096), (8, 8192), (4, 16384))

# What a case times: the forward, the backward alone (on the forward's saved out and LSE),
# forward + backward as a training step does them, or a decode step (flash_attn_with_kvcache:
# seqlen queries per sequence over a KV cache of seqlen_k keys, contiguous or paged).
KINDS = ("fwd", "bwd", "fwdbwd", "decode")
# The gate's --kinds selects among these: a case's kind, but "fp8" for the FP8 forward's cases
# (kind fwd), so that either can be run alone.
GATE_KINDS = (*KINDS, "fp8")
# FLOPs of each kind in forwards: the backward counts 2.5 forwards (FlashAttention's benchmark
# convention), a training step both.
FLOPS_PER_FORWARD = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5, "decode": 1.0}


@dataclass(frozen=True)
class Case:
    """One measured problem. New fields have defaults that leave the call as it was, so an old
    request (and an old base's flash_attention) reads the same; the case travels to the workers
    as JSON (as_dict), where a list comes back for `window` and is made a tuple again."""

    dtype: str
    d_head: int
    batch: int
    seqlen: int  # seqlen_q
    heads: int = 16
    causal: bool = False
    varlen: bool = False  # a packed batch of `batch` sequences of varlen_lengths() tokens
    window: tuple[int, int] | None = None  # (left, right) as attention()'s window_size
    softcap: float = 0.0
    kv_heads: int | None = None  # GQA: fewer K/V heads than query heads
    seqlen_k: int | None = None  # keys per sequence when not seqlen
    kind: str = "fwd"  # one of KINDS
    deterministic: bool = False  # the backward adds dQ in a fixed order (bwd, fwdbwd only)
    page_size: int = 0  # decode: rows per page of a paged cache (0: a contiguous cache)
    cache: str = ""  # decode: an FP8 cache's dtype, e4m3 or e5m2 ("": q's dtype)
    # dtype "e4m3": the FP8 forward (flash_attention.fp8, sm_90 alone) on q, k, v quantised with
    # per-(batch, KV head) descales; its SDPA peers run the 16-bit values they came from

    def __post_init__(self) -> None:
        if self.window is not None:
            object.__setattr__(self, "window", tuple(int(x) for x in self.window))
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.varlen and (self.seqlen_k is not None or self.kv_heads is not None):
            raise ValueError("a varlen case has seqlen_k = seqlen and all K/V heads")
        if self.kind not in KINDS:
            raise ValueError(f"case kind must be one of {KINDS}, got {self.kind!r}")
        if self.deterministic and not self.times_backward:
            raise ValueError("deterministic is an option of the backward: a bwd or fwdbwd case")
        if self.varlen and self.kind == "fwdbwd":
            raise ValueError("a training step is fixed-length (no varlen fwdbwd timing yet)")
        if self.page_size and self.kind != "decode":
            raise ValueError("page_size is an option of a decode case")
        if self.cache and (self.kind != "decode" or self.cache not in ("e4m3", "e5m2")):
            raise ValueError("cache is an option of a decode case: e4m3 or e5m2")
        if self.fp8 and self.kind != "fwd":
            raise ValueError("an e4m3 case is a forward (the FP8 forward has no backward or "
                             "decode step)")
        if self.kind == "decode" and (self.varlen or self.seqlen_k is None or self.page_size < 0):
            raise ValueError("a decode case is fixed-length with seqlen_k cached keys "
                             "(page_size 0 or the rows of a page)")

    @property
    def name(self) -> str:
        def side(n: int) -> str:
            return "inf" if n < 0 else str(n)

        return (f"{self.dtype}_d{self.d_head}_b{self.batch}_s{self.seqlen}"
                + (f"_sk{self.seqlen_k}" if self.seqlen_k is not None else "")
                + (f"_kv{self.kv_heads}" if self.kv_heads is not None else "")
                + (f"_w{side(self.window[0])}_{side(self.window[1])}" if self.window else "")
                + (f"_cap{self.softcap:g}" if self.softcap else "")
                + ("_causal" if self.causal else "") + ("_varlen" if self.varlen else "")
                + ("_det" if self.deterministic else "")
                + (f"_page{self.page_size}" if self.page_size else "")
                + (f"_{self.cache}" if self.cache else "")
                + ("" if self.kind == "fwd" else f"_{self.kind}"))

    @property
    def fp8(self) -> bool:
        """Whether the case times the FP8 (e4m3) forward."""
        return self.dtype == "e4m3"

    @property
    def gate_kind(self) -> str:
        """What the gate's --kinds selects the case by (GATE_KINDS)."""
        return "fp8" if self.fp8 else self.kind

    @property
    def times_forward(self) -> bool:
        """Whether the timed calls run the forward (fwd, fwdbwd)."""
        return self.kind in ("fwd", "fwdbwd")

    @property
    def times_backward(self) -> bool:
        """Whether the timed calls run the backward (bwd, fwdbwd)."""
        return self.kind in ("bwd", "fwdbwd")

    @property
    def keys(self) -> int:
        return self.seqlen if self.seqlen_k is None else self.seqlen_k

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    def options(self) -> dict:
        """attention()'s keyword arguments beyond q, k, v: only those that differ from the
        defaults, so a base from before an option existed still runs the cases without it."""
        opts = _attention_options(self.causal, self.window, self.softcap)
        if self.deterministic:
            opts["deterministic"] = True
        return opts

    def peer_note(self) -> str:
        """Why SDPA cannot be the peer of this case ("" when it can)."""
        if self.softcap:
            return "SDPA has no softcap"
        if self.window is not None:
            return "SDPA has no sliding window"
        if self.deterministic:
            return "SDPA's backward as called here is not deterministic"
        return ""

    def flops(self) -> float:
        """FLOPs of one call: the forward's, the visible (query, key) pairs counted under a
        window (flash_attention.timing.attention_flops), a varlen batch summing its sequences,
        times FLOPS_PER_FORWARD of the case's kind."""
        from flash_attention.timing import attention_flops

        if self.varlen:
            forward = sum(attention_flops(1, self.heads, n, n, self.d_head, self.causal,
                                          self.window) for n in varlen_lengths(self))
        else:
            forward = attention_flops(self.batch, self.heads, self.seqlen, self.keys,
                                      self.d_head, self.causal, self.window)
        return FLOPS_PER_FORWARD[self.kind] * forward

    def as_dict(self) -> dict:
        return asdict(self)


def varlen_lengths(case: Case) -> list[int]:
    """The sequence lengths of a varlen case: fixed pseudo-random draws between a quarter of
    seqlen and seqlen (the longest is seqlen), the same in every process."""
    import random

    rng = random.Random(case.seqlen * 1000 + case.batch)
    lengths = [rng.randint(case.seqlen // 4, case.seqlen) for _ in range(case.batch - 1)]
    return [case.seqlen, *lengths]


# The perf gate's forward cases: at least one per kind of kernel the dispatch tables run on an
# sm_90 GPU (every tile of the Hopper table, ignoring dtype; the sm80-family softcap kernels with
# and without masks; the sm80-family varlen fallback), and each call feature: causal, sliding
# windows, softcap, GQA, seqlen_q != seqlen_k, short sequences, both dtypes, d_head 64, 128
# and the 160-256 range (tests/test_gate_coverage.py checks it against dispatch). 16 heads.
FWD_GATE_CASES = tuple([
    # no mask: d_head 128 over the three Hopper rows (<= 512, <= 2048, longer), both dtypes;
    # 4 x 16384 is the power study's case (its plants come in the finest steps)
    Case("bf16", 128, 64, 512),
    Case("fp16", 128, 16, 1024),
    Case("bf16", 128, 16, 4096), Case("bf16", 128, 4, 16384),
    Case("bf16", 64, 16, 4096), Case("bf16", 64, 8, 8192),  # d_head 64: <= 4096, longer
    Case("bf16", 256, 16, 4096),
    # causal: d_head 128 over its three rows (the <= 2048 one with GQA, 4 K/V heads), d 64
    Case("bf16", 128, 16, 2048, causal=True, kv_heads=4),
    Case("bf16", 128, 16, 4096, causal=True),
    Case("bf16", 128, 8, 8192, causal=True),
    Case("bf16", 64, 16, 4096, causal=True),
    # seqlen_q != seqlen_k: a causal chunk of 1024 queries against 8192 keys (bottom-right)
    Case("bf16", 128, 8, 1024, causal=True, seqlen_k=8192),
    # sliding windows (the Hopper local rows): d_head 64, 128, and 192 (on the d 256 kernel)
    Case("bf16", 64, 16, 4096, window=(512, 0)),
    Case("bf16", 128, 8, 8192, window=(1024, 1024)),
    Case("bf16", 192, 8, 4096, window=(1024, 0)),
    # softcap (the Hopper softcap rows): plain at d_head 128, causal at 64, with a window at 256
    Case("bf16", 128, 16, 4096, softcap=30.0),
    Case("bf16", 64, 16, 4096, causal=True, softcap=30.0),
    Case("bf16", 256, 4, 8192, window=(2048, 0), softcap=50.0),
    # varlen (the Hopper varlen kernels): batches of 1024-4096 tokens, causal and not at d_head
    # 128, a softcap at 64
    Case("bf16", 128, 16, 4096, causal=True, varlen=True),
    Case("bf16", 128, 16, 4096, varlen=True),
    Case("fp16", 64, 16, 4096, varlen=True, softcap=30.0),
    # short sequences: the d_head 64 B_r 128 row (577 tokens, 12 heads at batch 64, a ViT's)
    # and the fewer-padded-keys tile (257 keys: B_c 96); calls whose tiles fit in one wave on
    # the gate GPU's 132 SMs, one per one-wave tier: one head of 8192 tokens (128 tiles of
    # B_r 64) or two of 8000 (126 of B_r 128; names carry no head count), long enough per call
    # for the gate's spread (batch-1 ViT calls of 23-32 us spread 16-30% per round and ended
    # inconclusive after 48 rounds)
    Case("bf16", 64, 64, 577, heads=12), Case("bf16", 128, 64, 257),
    Case("bf16", 64, 1, 8192, heads=1), Case("bf16", 64, 1, 8000, heads=2),
    Case("bf16", 128, 1, 8192, heads=1), Case("fp16", 128, 1, 8000, heads=2),
])
# The gate's backward cases: each kernel of the `default` backward set, dtype aside, on the
# runner's sm_90 GPU (both families' d_head 64, 128 and 256, each with and without a softcap;
# the preprocess and both families' dQ conversions of both dtypes run with them), and each
# feature of the backward's calls: causal, GQA (dK and dV summed over the group), a sliding
# window, varlen, deterministic dQ, and a training step (forward + autograd backward). On an
# sm_90 GPU the fixed-length cases run the Hopper kernels (deterministic ones too) and varlen
# calls the sm80 family, so the varlen cases keep its kernels under the gate there; on another
# GPU every case runs the sm80 family. 16 heads, 16384 tokens (a varlen case 4 sequences of
# 1024-4096): 3-9 ms a call on an H100 at the 150-300 TFLOP/s the first backward measured
# there. 6 of the 12 cases have an SDPA FA2 peer (not the softcap and deterministic ones; a
# varlen case's runs the padded batch): 18 timed contenders at about 5.3 s each (the forward's
# 31 in its 185 s A/A run, less about 20 s of start-up), about 95 s per gate run (with four
# deterministic cases where the varlen ones are, 15 contenders, about 80 s; estimated, to be
# measured). Since 2026-11-27 a 13th case, deterministic with no mask (its own order), adds
# one contender, and two varlen cases at d_head 256 (the sm80 family's kernels, since the
# Hopper family serves the fixed-length ones) add three more (one has an FA2 peer).
# tests/test_gate_coverage.py checks the kernels against the backward's selection.
BWD_GATE_CASES = tuple([
    # no softcap: d_head 128 causal (the LLM training mask), d_head 64 with GQA in fp16,
    # d_head 256
    Case("bf16", 128, 4, 4096, causal=True, kind="bwd"),
    Case("fp16", 64, 4, 4096, kv_heads=4, kind="bwd"),
    Case("bf16", 256, 2, 4096, kind="bwd"),
    # softcap (no SDPA peer): d_head 128; d_head 64 under a sliding window; d_head 256 causal
    # with softcap 50 (Gemma-2's attention)
    Case("bf16", 128, 4, 4096, softcap=30.0, kind="bwd"),
    Case("fp16", 64, 4, 4096, window=(1024, 0), softcap=50.0, kind="bwd"),
    Case("bf16", 256, 2, 4096, causal=True, softcap=50.0, kind="bwd"),
    # varlen (all K/V heads; the sm80 family on every GPU): its d_head 128, 64 and 256 kernels
    # with and without a softcap, whose fixed-length cases above run the Hopper kernels on
    # sm_90
    Case("bf16", 128, 4, 4096, causal=True, varlen=True, kind="bwd"),
    Case("fp16", 64, 4, 4096, varlen=True, kind="bwd"),
    Case("bf16", 128, 4, 4096, softcap=30.0, varlen=True, kind="bwd"),
    Case("fp16", 64, 4, 4096, window=(1024, 0), softcap=50.0, varlen=True, kind="bwd"),
    Case("bf16", 256, 2, 4096, varlen=True, kind="bwd"),
    Case("bf16", 256, 2, 4096, causal=True, softcap=50.0, varlen=True, kind="bwd"),
    # deterministic dQ (a fixed order of the KV blocks' additions), causal d_head 128: the
    # Hopper kernel's order on sm_90, the sm80 family's elsewhere; and with no mask at d_head
    # 64, the rotated order of either family (bwd::rotated_dq_turn)
    Case("bf16", 128, 4, 4096, causal=True, deterministic=True, kind="bwd"),
    Case("bf16", 64, 4, 4096, deterministic=True, kind="bwd"),
    # a training step: forward + backward through autograd, causal GQA d_head 128 (Llama's)
    Case("bf16", 128, 4, 4096, causal=True, kv_heads=4, kind="fwdbwd"),
])
# The gate's decode steps (flash_attn_with_kvcache, one query per sequence unless stated, GQA
# 32/8 but at d_head 256): each decode kernel of the `default` set, dtype aside (d_head 64,
# 128, 256; the sm80 family's, the one decode family, on every GPU), and each way a step
# reads its cache: split-KV with the combine (batch 1), one pass without (64 sequences fill
# the GPU), paged caches whose pages hold whole blocks (16 rows at d_head 128, 256 at 64, 16 on
# the d_head 64 small-page kernel) and one whose blocks cross pages (an FP8 cache's 64-key
# blocks over pages of 16: each 16-row group from its own page's entry; the row-by-row gather
# of page sizes that are not multiples of 16 is left to the tests), speculative decoding (4
# causal queries: 16 packed rows; 8: 32, the 32-row kernels), FP8 caches (their keys twice as
# many as a 16-bit case's for the same time).
# Their SDPA peer runs the same step on the contiguous cache. Every step's GPU time is above the
# host's ~25 us per eager call (the gate times eager calls back to back): one sequence of 8192
# keys (14 us) measured the host, 19-24% apart round to round on an H200, and ended
# "inconclusive" after 48 rounds; 65536 keys take about 70 us. tests/test_gate_coverage.py checks
# the kernels against the decode table.
DEC_GATE_CASES = tuple([
    Case("bf16", 128, 1, 1, heads=32, kv_heads=8, seqlen_k=65536, kind="decode"),
    Case("bf16", 128, 64, 1, heads=32, kv_heads=8, seqlen_k=4096, kind="decode"),
    Case("bf16", 128, 16, 1, heads=32, kv_heads=8, seqlen_k=8192, page_size=16,
         kind="decode"),
    Case("fp16", 64, 16, 1, heads=32, kv_heads=8, seqlen_k=8192, page_size=256,
         kind="decode"),
    # d_head 64 over pages of 16: the small-page kernel (16-key blocks, each inside one page)
    Case("bf16", 64, 16, 1, heads=32, kv_heads=8, seqlen_k=8192, page_size=16,
         kind="decode"),
    Case("bf16", 256, 8, 1, heads=16, kv_heads=16, seqlen_k=4096, kind="decode"),
    Case("bf16", 128, 16, 4, heads=32, kv_heads=8, seqlen_k=8192, causal=True,
         kind="decode"),
    # 128 tiles of 2048 keys: one CTA per SM, the deep kernel on sm_90
    Case("bf16", 128, 16, 1, heads=32, kv_heads=8, seqlen_k=2048, kind="decode"),
    # 8 speculative positions x GQA groups of 4: 32 packed rows, the 32-row kernels
    Case("bf16", 128, 16, 8, heads=32, kv_heads=8, seqlen_k=8192, causal=True,
         kind="decode"),
    Case("fp16", 64, 4, 8, heads=32, kv_heads=8, seqlen_k=16384, page_size=64, causal=True,
         kind="decode"),
    # FP8 caches (issue 46): each FP8 decode kernel of the default set, q's and the cache's
    # dtype aside (d_head 64, 128, 256), contiguous and paged
    Case("bf16", 128, 16, 1, heads=32, kv_heads=8, seqlen_k=16384, cache="e4m3",
         kind="decode"),
    Case("fp16", 64, 16, 1, heads=32, kv_heads=8, seqlen_k=16384, page_size=16, cache="e5m2",
         kind="decode"),
    Case("bf16", 256, 8, 1, heads=16, kv_heads=16, seqlen_k=8192, cache="e4m3",
         kind="decode"),
])
# The gate's FP8 forward cases (issue 46; sm_90 alone: the gate leaves them out on another
# GPU): each e4m3 kernel of the default table (d_head 128 and 256, plain, masked, softcap,
# masked with softcap; fixed-length and varlen), with GQA, a sliding window and d_head 192 (on
# the d_head 256 kernel) among them; 4096-8192 tokens per sequence, 1-5 ms a call on an H200.
# The cases without a softcap or window have SDPA peers (bf16; a varlen case's on the padded
# batch).
FP8_GATE_CASES = tuple([
    # varlen packs (the FP8 varlen kernels, flag j): 8 sequences of 1024-4096 tokens
    Case("e4m3", 128, 8, 4096, varlen=True),
    Case("e4m3", 128, 8, 4096, causal=True, varlen=True),
    Case("e4m3", 128, 8, 4096, softcap=30.0, varlen=True),
    Case("e4m3", 128, 8, 4096, window=(1024, 0), softcap=30.0, varlen=True),
    Case("e4m3", 256, 8, 4096, varlen=True),
    Case("e4m3", 256, 8, 4096, causal=True, varlen=True),
    Case("e4m3", 192, 8, 4096, softcap=50.0, varlen=True),
    Case("e4m3", 256, 8, 4096, causal=True, softcap=50.0, varlen=True),
    # fixed-length
    Case("e4m3", 128, 16, 4096),
    Case("e4m3", 128, 8, 8192, causal=True, kv_heads=4),
    Case("e4m3", 128, 16, 4096, softcap=30.0),
    Case("e4m3", 128, 8, 4096, window=(1024, 0), softcap=30.0),
    Case("e4m3", 256, 8, 4096),
    Case("e4m3", 256, 8, 4096, causal=True),
    Case("e4m3", 192, 8, 4096, softcap=50.0),
    Case("e4m3", 256, 4, 4096, causal=True, softcap=50.0),
])
GATE_CASES = FWD_GATE_CASES + BWD_GATE_CASES + DEC_GATE_CASES + FP8_GATE_CASES
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


def interleaved_rounds(contenders: dict, rounds: int = 3, reps: int = 20,
                       warmup: int = 5) -> dict[str, list[float]]:
    """The median ms (time_cuda_ms) of each contender (name -> callable) per round, the
    contenders interleaved within each round (the studies' side-by-side tables)."""
    import statistics

    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            times[name].append(statistics.median(time_cuda_ms(fn, reps, warmup)))
    return times


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
                      stamps=None, energy=None) -> list[float]:
    """CUDA-event milliseconds of each of `reps` calls made after about `warm_ms` of the same
    calls back to back, all queued without a gap: the GPU at the steady state of continuous
    work, clocks settled under its power limit. (A burst after an idle gap runs at boost clocks
    that fall within tens of milliseconds, by how much depends on the kernel, so short bursts
    rank contenders differently from continuous use: on an H100 at 700 W, 16 x 4096 x 16 heads
    bf16 d128, SDPA cuDNN 3.58 ms and ours 3.64 ms sustained at about 1.5 GHz, against 3.25 and
    3.8 ms median in 10-call bursts; docs/results.md.) one_ms: the time of one call if known
    (else measured first), which sets how many warm calls make warm_ms. stamps: clock stamps
    around the timed calls (the cycles they took, gpu.clockstamp). energy (gpu.energy.Window):
    the GPU's energy counter read with the GPU idle before the warm calls and after the timed
    ones, per call over both (the counter updates too seldom to resolve the timed calls
    alone)."""
    import torch

    if one_ms is None:
        fn()
        torch.cuda.synchronize()
        one_ms = statistics.median(time_cuda_ms(fn, reps=3, warmup=0))
    warm = max(1, int(warm_ms / max(one_ms, 1e-3)))
    if energy is not None:
        torch.cuda.synchronize()
        energy.start()
    for _ in range(warm):
        fn()
    times = _queued_calls_ms(fn, reps, stamps)  # ends with a synchronize
    if energy is not None:
        energy.stop(warm + reps)
    return times


def time_sustained_cycles(fn, reps: int, warm_ms: float = 300.0, one_ms: float | None = None,
                          energy=None) -> tuple[list[float], float, float]:
    """time_sustained_ms with clock stamps around the timed calls: (milliseconds of each call,
    millions of SM cycles per call, mean SM clock in MHz over the calls)."""
    from .clockstamp import Stamps

    stamps = Stamps()
    times = time_sustained_ms(fn, reps, warm_ms, one_ms, stamps, energy)
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


def _attention_options(causal: bool, window, softcap: float) -> dict:
    """attention()'s keyword arguments that differ from the defaults (an older build without
    an option runs every call that does not use it)."""
    opts: dict = {}
    if causal:
        opts["causal"] = True
    if window is not None:
        opts["window_size"] = tuple(window)
    if softcap:
        opts["softcap"] = softcap
    return opts


def _sdpa_peer(backend, qt, kt, vt, causal: bool, expand: bool = False):
    """SDPA restricted to one backend on (B, H, S, D) tensors: K/V heads shared by query heads
    through enable_gqa (expand: K/V repeated to every query head instead, made once here, for
    a torch or backend without it); causal with fewer queries than keys aligned bottom-right
    as ours (a lower-right causal bias, which SDPA runs on its FA2 kernel), else its own
    is_causal."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    groups = qt.shape[1] // kt.shape[1]
    extra = _sdpa_mask(qt, kt, causal)
    if groups > 1 and expand:
        kt, vt = (t.repeat_interleave(groups, dim=1) for t in (kt, vt))
    elif groups > 1:
        extra["enable_gqa"] = True

    def peer():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, kt, vt, **extra)
    return peer


def _sdpa_mask(qt, kt, causal: bool) -> dict:
    """SDPA's mask arguments for ours' causal on (B, H, S, D) tensors: a lower-right causal
    bias when there are fewer queries than keys (ours aligns bottom-right), else is_causal."""
    if causal and qt.shape[2] != kt.shape[2]:
        from torch.nn.attention.bias import causal_lower_right

        return {"attn_mask": causal_lower_right(qt.shape[2], kt.shape[2])}
    return {"is_causal": causal}


def _sdpa_training_peer(backend, case: Case, qt, kt, vt, dout_t, expand: bool):
    """SDPA restricted to one backend, timing what the case times on (B, H, S, D) leaves that
    require grad: the backward (autograd.grad on a graph made once and kept) or a training
    step (forward and autograd.grad, a new graph per call). K/V heads are shared through
    enable_gqa, or (expand) repeated to every query head inside the graph, so their gradients
    sum over the group as ours do."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    groups = qt.shape[1] // kt.shape[1]
    extra = _sdpa_mask(qt, kt, case.causal)
    if groups > 1 and not expand:
        extra["enable_gqa"] = True

    def forward():
        k, v = kt, vt
        if groups > 1 and expand:
            k, v = (t.repeat_interleave(groups, dim=1) for t in (kt, vt))
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qt, k, v, **extra)

    leaves = (qt, kt, vt)
    if case.kind == "bwd":
        out = forward()
        return lambda: torch.autograd.grad(out, leaves, dout_t, retain_graph=True)
    return lambda: torch.autograd.grad(forward(), leaves, dout_t)


def training_contenders(case: Case, inputs: Inputs, names=CONTENDERS, kernel: str = "") -> dict:
    """Zero-argument callables, one per contender, timing a bwd or fwdbwd case on the same
    inputs; each returns the gradients (dq, dk, dv). Ours: for bwd, the flash_attention::bwd
    operator on the out and LSE of one attention() call made here (the forward's saved
    tensors), called as the autograd formula calls it (a varlen case: attention_varlen on the
    packed q, k, v, its (heads, total) LSE and the cu_seqlens to bwd); for fwdbwd, attention()
    on q, k, v that require grad and autograd.grad. The SDPA peers: _sdpa_training_peer on the
    (B, H, S, D) views of the same tensors (a varlen case: of the same tokens padded to the
    longest sequence, with dout padded alike); a backend that cannot run the case is left out,
    and so is SDPA for a case it has no counterpart of (Case.peer_note). `kernel`: the backward
    kernel ours runs in a bwd case (a built kernel name; "" the operator's choice)."""
    import torch

    import flash_attention as fa

    if case.kind not in ("bwd", "fwdbwd"):
        raise ValueError(f"{case.name}: training_contenders times bwd and fwdbwd cases")
    if case.peer_note():
        names = tuple(n for n in names if n == "ours")
    q, k, v, dout = inputs.q, inputs.k, inputs.v, inputs.dout
    opts = case.options()
    fns = {}
    if "ours" in names and case.kind == "bwd":
        if case.varlen:
            cu, max_len, _ = inputs.varlen
            out, lse = fa.attention_varlen(q, k, v, cu, cu, max_len, max_len, return_lse=True,
                                           **opts)
            seqs = (cu, cu, max_len, max_len)
        else:
            out, lse = fa.attention(q, k, v, return_lse=True, **opts)
            seqs = (None, None, 0, 0)
        left, right = case.window or (-1, -1)
        bwd = torch.ops.flash_attention.bwd.default
        fns["ours"] = lambda: bwd(dout, q, k, v, out, lse, None, *seqs, None, case.causal, left,
                                  right, case.softcap, case.deterministic, kernel)
    elif "ours" in names:
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        fns["ours"] = lambda: torch.autograd.grad(fa.attention(*leaves, **opts), leaves, dout)
    # the peers run a varlen case's tokens padded to its longest sequence
    peer_qkv = inputs.varlen[2] if case.varlen else (q, k, v)
    dout_t = (inputs.dout_padded if case.varlen else dout).transpose(1, 2)

    def make(backend, expand):
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in peer_qkv)
        return _sdpa_training_peer(backend, case, qt, kt, vt, dout_t, expand)

    fns.update(_working_peers(names, make, gqa=case.kv != case.heads))
    return fns


def _working_peers(names, make, gqa: bool) -> dict:
    """The SDPA peers among `names` that run the case: make(backend, expand) builds one (expand:
    K/V heads repeated to the query heads), tried once, and for GQA again expanded when the
    backend refuses grouped heads; a backend that cannot run it is left out."""
    from torch.nn.attention import SDPBackend

    backends = {"sdpa_fa2": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}
    fns = {}
    for name in (n for n in names if n in backends):
        for expand in (False, True) if gqa else (False,):
            try:
                peer = make(backends[name], expand)
                peer()
            except (RuntimeError, TypeError, ImportError):  # TypeError: no enable_gqa
                continue
            fns[name] = peer
            break
    return fns


def contenders(q, k, v, out, config=None, names=CONTENDERS, causal: bool = False,
               varlen=None, window=None, softcap: float = 0.0) -> dict:
    """Zero-argument callables, one per contender, on the same inputs: attention() (the given
    config, else dispatch) writing into out, and SDPA restricted to one backend on the
    (B, H, S, D) view of the same tensors (_sdpa_peer). A backend that cannot run the shape is
    left out, and so is SDPA for a window or a softcap, which it does not have. attention()
    gets only the options that differ from the defaults, so a base from before one existed
    runs every case without it. varlen: (cu_seqlens, max_seqlen, (qp, kp, vp)): ours runs
    attention_varlen on the packed q, k, v, the peers on the padded qp, kp, vp."""

    import flash_attention as fa

    opts = _attention_options(causal, window, softcap)
    if window is not None or softcap:
        names = tuple(n for n in names if n == "ours")
    if varlen is not None:
        cu, max_len, padded = varlen
        fns = contenders(*padded, None, names=tuple(n for n in names if n != "ours"),
                         causal=causal)
        if "ours" in names:
            fns["ours"] = lambda: fa.attention_varlen(q, k, v, cu, cu, max_len, max_len, **opts)
        return fns
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    fns = {}
    if "ours" in names:
        fns["ours"] = (lambda: fa.attention(q, k, v, out=out, **opts)) if config is None else (
            lambda: fa.attention(q, k, v, out=out, config=config, **opts))
    fns.update(_working_peers(
        names, lambda backend, expand: _sdpa_peer(backend, qt, kt, vt, causal, expand),
        gqa=k.shape[2] != q.shape[2]))
    return fns


@dataclass
class Inputs:
    """Random q, k, v of a case (BSHD) and the output buffer attention() writes into; for a
    varlen case q, k, v are packed (total, H, D), and `varlen` holds cu_seqlens, the longest
    length and the same tokens padded to it (B, S, H, D) for the peers. A case that times the
    backward also gets a random output gradient `dout` (like q: packed for a varlen case, whose
    peers get the same rows padded, `dout_padded`)."""

    q: object
    k: object
    v: object
    out: object
    varlen: tuple | None = None
    dout: object = None
    dout_padded: object = None  # a varlen backward case's dout as (B, S, H, D), for the peers
    last_ms: dict = field(default_factory=dict)  # {contender: median ms of its last timing}
    planted: dict = field(default_factory=dict)  # {fraction: (k, v)}, planted_attention
    # a decode case: (k_cache, v_cache, block_table or None, cache_seqlens); k and v above are
    # the same keys as a contiguous cache (B, seqlen_k, kv heads, d), the peers' input
    cache: tuple | None = None
    # a decode case over an FP8 cache: its (k_descale, v_descale), (B, kv heads) fp32
    descales: tuple | None = None
    # an FP8 forward case: (q8, k8, v8, q_descale, k_descale, v_descale) quantised from q, k, v
    # (bf16, the peers' inputs)
    fp8: tuple | None = None

    @classmethod
    def make(cls, case: Case, device: str = "cuda") -> Inputs:
        import torch

        if case.fp8:
            return cls._fp8(case, device)
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
        if case.kind == "decode":
            return cls._decode(case, dtype, device)
        q = torch.randn(case.batch, case.seqlen, case.heads, case.d_head, device=device,
                        dtype=dtype)
        k, v = (torch.randn(case.batch, case.keys, case.kv, case.d_head, device=device,
                            dtype=dtype) for _ in range(2))
        dout = torch.randn_like(q) if case.times_backward else None
        if not case.varlen:
            return cls(q, k, v, torch.empty_like(q), dout=dout)
        lengths = varlen_lengths(case)
        padded = (q, k, v) if dout is None else (q, k, v, dout)
        packed = [torch.cat([t[b, :n] for b, n in enumerate(lengths)]) for t in padded]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        cu = torch.tensor(offsets, dtype=torch.int32, device=device)
        return cls(*packed[:3], torch.empty_like(packed[0]), (cu, max(lengths), (q, k, v)),
                   dout=packed[3] if dout is not None else None, dout_padded=dout)


    @classmethod
    def _fp8(cls, case: Case, device: str) -> Inputs:
        """An FP8 forward case's inputs: bf16 q, k, v (the peers') and the same values quantised
        to e4m3 with a descale per (batch, KV head) (fp8.quantize; q's per KV head group). A
        varlen case: the pack of varlen_lengths (bf16 padded for the peers, as a 16-bit varlen
        case's), quantised per tensor, the descales expanded per (sequence, KV head)."""
        import torch

        from flash_attention import fp8  # a base from before the FP8 forward cannot run it

        if case.varlen:
            pack = cls.make(replace(case, dtype="bf16"), device)
            (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t[None], per_tensor=True)
                                            for t in (pack.q, pack.k, pack.v))
            descales = (d[:1, :1].expand(case.batch, case.kv) for d in (qd, kd, vd))
            return cls(pack.q, pack.k, pack.v, None, pack.varlen,
                       fp8=(q8[0], k8[0], v8[0], *descales))
        q = torch.randn(case.batch, case.seqlen, case.heads, case.d_head, device=device,
                        dtype=torch.bfloat16)
        k, v = (torch.randn(case.batch, case.keys, case.kv, case.d_head, device=device,
                            dtype=torch.bfloat16) for _ in range(2))
        (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q, case.kv), fp8.quantize(k), fp8.quantize(v)
        return cls(q, k, v, None, fp8=(q8, k8, v8, qd, kd, vd))

    @classmethod
    def _decode(cls, case: Case, dtype, device: str) -> Inputs:
        """A decode case's inputs: q, a full cache of seqlen_k keys per sequence (contiguous,
        or its rows copied into pages of page_size rows in a random order, one block table
        row per sequence) and cache_seqlens."""
        import torch

        q = torch.randn(case.batch, case.seqlen, case.heads, case.d_head, device=device,
                        dtype=dtype)
        k, v = (torch.randn(case.batch, case.keys, case.kv, case.d_head, device=device,
                            dtype=dtype) for _ in range(2))
        seqlens = torch.full((case.batch,), case.keys, dtype=torch.int32, device=device)
        descales = None
        stored = (k, v)
        if case.cache:  # each (sequence, KV head)'s amax mapped to the format's largest value
            fp8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[case.cache]
            top = torch.finfo(fp8).max
            descales = tuple((t.float().abs().amax(dim=(1, 3)) / top).clamp_min(1e-12)
                             for t in (k, v))
            stored = tuple((t.float() / d[:, None, :, None]).to(fp8).view(torch.uint8)
                           for t, d in zip((k, v), descales))
        as_cache = (lambda t: t.view(fp8)) if case.cache else (lambda t: t)
        if not case.page_size:
            return cls(q, k, v, None, cache=(*map(as_cache, stored), None, seqlens),
                       descales=descales)
        per_seq = -(-case.keys // case.page_size)
        table = torch.randperm(case.batch * per_seq, device=device, dtype=torch.int32)
        table = table.view(case.batch, per_seq)
        pad = per_seq * case.page_size - case.keys

        def paged(t):
            t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad))
            pool = torch.empty(case.batch * per_seq, case.page_size, *t.shape[2:],
                               device=device, dtype=t.dtype)
            pool[table.flatten().long()] = t.reshape(-1, case.page_size, *t.shape[2:])
            return as_cache(pool)

        return cls(q, k, v, None, cache=(*map(paged, stored), table, seqlens),
                   descales=descales)


def decode_contenders(case: Case, inputs: Inputs, names=CONTENDERS) -> dict:
    """Zero-argument callables, one per contender, timing one decode step: ours is
    flash_attn_with_kvcache on the case's cache (paged or not), returning its output; the SDPA
    peers run the same queries over the contiguous cache's (B, H, S, D) views (enable_gqa, or
    K/V repeated where a backend refuses it; causal aligned bottom-right as ours). A case over
    an FP8 cache: ours reads the FP8 cache with its descales, the peers the 16-bit keys."""
    from flash_attention.interface import flash_attn_with_kvcache

    q, (k_cache, v_cache, table, seqlens) = inputs.q, inputs.cache
    opts = _attention_options(case.causal, case.window, case.softcap)
    fns = {}
    if inputs.descales is not None:  # an FP8 cache
        opts = {**opts, "k_descale": inputs.descales[0], "v_descale": inputs.descales[1]}
    if "ours" in names:
        fns["ours"] = lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, **opts)
    if case.peer_note():
        return fns
    qt, kt, vt = (t.transpose(1, 2) for t in (q, inputs.k, inputs.v))
    fns.update(_working_peers(
        names, lambda backend, expand: _sdpa_peer(backend, qt, kt, vt, case.causal, expand),
        gqa=case.kv != case.heads))
    return fns


def fp8_contenders(case: Case, inputs: Inputs, names=CONTENDERS) -> dict:
    """Zero-argument callables, one per contender, timing one FP8 forward: ours is
    fp8.attention_fp8 on the quantised q, k, v with their descales (returning its bf16 output),
    the SDPA peers run the bf16 values (the speed FP8 is for); none under a window or a
    softcap, as for the 16-bit forward."""
    from flash_attention import fp8

    q8, k8, v8, qd, kd, vd = inputs.fp8
    opts = _attention_options(case.causal, case.window, case.softcap)
    fns = contenders(inputs.q, inputs.k, inputs.v, None,
                     names=tuple(n for n in names if n != "ours"), causal=case.causal,
                     varlen=inputs.varlen, window=case.window, softcap=case.softcap)
    if inputs.varlen is not None:  # the packed call (the peers run the padded batch)
        cu, longest, _ = inputs.varlen
        opts.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    if "ours" in names:
        fns["ours"] = lambda: fp8.attention_fp8(q8, k8, v8, qd, kd, vd, **opts)
    return fns


def planted_keys(case: Case, fraction: float) -> int:
    """How many keys a planted slowdown of `fraction` adds to every sequence of the case: the
    nearest whole number to fraction x the keys per sequence, at least one."""
    return max(1, round(fraction * case.keys))


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

    if case.varlen or case.window is not None or case.kind != "fwd" or case.fp8:
        raise ValueError(f"{case.name}: planted slowdowns are for fixed-length 16-bit forward "
                         "cases without a window (keys added under a window add no work)")
    if fraction not in inputs.planted:  # made once per request's inputs, kept with them
        shape = (case.batch, case.keys + planted_keys(case, fraction), case.kv, case.d_head)
        k, v = (torch.randn(shape, device="cuda", dtype=inputs.q.dtype) for _ in range(2))
        inputs.planted[fraction] = (k, v)
    k, v = inputs.planted[fraction]
    q, out, opts = inputs.q, inputs.out, case.options()
    return lambda: fa.attention(q, k, v, out=out, **opts)


def measure_case(case: Case, inputs: Inputs, contenders_: tuple[str, ...] = ("ours", "sdpa_fa2"),
                 reps: int = 10, warmup: int = 3, slowdown: float = 0.0, warm_ms: float = 0.0,
                 energy=None) -> dict[str, float]:
    """{contender: median ms over reps calls} of one case (of any kind: contenders for the
    forward, training_contenders for the backward and the training step); raises on any failure
    (a broken benchmark must never look like a slow one). SDPA is left out of a case it has no
    counterpart of (Case.peer_note: a window, a softcap, a deterministic backward); any other
    contender that cannot run raises.
    warm_ms > 0: each contender's timed calls follow about warm_ms of its own calls queued back
    to back (time_sustained_ms: the steady state under the power limit), and the reply also
    holds, per contender, the SM cycles per call over the timed calls ("<name>_mcycles",
    millions) and the mean SM clock ("<name>_mhz") from clock stamps around them
    (gpu.clockstamp), and with an energy counter (gpu.energy.Counter) the millijoules per call
    over the warm and timed calls ("<name>_mj"; left out when a read fails); else `warmup`
    calls and a burst after a device-side sleep."""
    import torch

    from .energy import Window

    if case.peer_note():
        contenders_ = tuple(n for n in contenders_ if n == "ours")
    if case.fp8:
        fns = fp8_contenders(case, inputs, contenders_)
    elif case.kind == "fwd":
        fns = contenders(inputs.q, inputs.k, inputs.v, inputs.out, names=contenders_,
                         causal=case.causal, varlen=inputs.varlen, window=case.window,
                         softcap=case.softcap)
    elif case.kind == "decode":
        fns = decode_contenders(case, inputs, contenders_)
    else:
        fns = training_contenders(case, inputs, contenders_)
    missing = set(contenders_) - set(fns)
    if missing:
        raise RuntimeError(f"{case.name}: {', '.join(sorted(missing))} cannot run this case")
    if case.kind == "decode":
        if not torch.isfinite(fns["ours"]()).all():
            raise RuntimeError(f"{case.name}: flash_attn_with_kvcache produced non-finite values")
    elif case.fp8:
        if not torch.isfinite(fns["ours"]()).all():
            raise RuntimeError(f"{case.name}: attention_fp8() produced non-finite values")
    elif case.kind == "fwd":
        inputs.out.fill_(float("nan"))
        result = fns["ours"]()
        out = inputs.out if inputs.varlen is None else result  # varlen returns its output
        if not torch.isfinite(out).all():
            raise RuntimeError(f"{case.name}: attention() produced non-finite values")
    elif not all(torch.isfinite(g).all() for g in fns["ours"]()):
        raise RuntimeError(f"{case.name}: the backward produced non-finite gradients")
    if slowdown > 0:
        fns["ours"] = planted_attention(case, inputs, slowdown)
    result: dict[str, float] = {}
    for name, fn in fns.items():
        if warm_ms > 0:
            window = Window(energy) if energy is not None else None
            times, result[f"{name}_mcycles"], result[f"{name}_mhz"] = time_sustained_cycles(
                fn, reps, warm_ms, inputs.last_ms.get(name), window)
            if window is not None and window.per_call is not None:
                result[f"{name}_mj"] = window.per_call
        else:
            times = time_cuda_ms(fn, reps=reps, warmup=warmup)
        result[name] = inputs.last_ms[name] = statistics.median(times)
    return result


def measure(cases: list[Case], contenders_: tuple[str, ...] = ("ours", "sdpa_fa2"),
            reps: int = 10, warmup: int = 3) -> dict[str, dict[str, float]]:
    """{case name: {contender: median ms over reps calls}}, fresh inputs per case."""
    return {case.name: measure_case(case, Inputs.make(case), contenders_, reps, warmup)
            for case in cases}
