"""A serving-style loop over one paged KV cache: sequences of different prompt and generation
lengths arrive over time and share one page pool for K and one for V; every step is ONE
flash_attn_varlen_func call that mixes prefill chunks and decode rows.

Each step:

1. admit the sequences that have arrived (first come, first served) while the batch has room
   and the pool can hold the whole lifetime of every admitted sequence (pages are still
   allocated lazily as sequences grow; admission only guarantees that growth never runs out of
   pages, so nothing is preempted);
2. schedule one decode row for each sequence past its prompt, then prefill chunks in admission
   order within --token-budget query tokens a step (0: whole prompts);
3. the model side (not a model: random, seeded q, k, v for the step's new tokens): allocate the
   pages the new rows need from the free list, and scatter the new K/V rows into their pages
   through the block table (index arithmetic on the device, no loop over tokens);
4. one call, flash_attn_varlen_func(q, k_pool, v_pool, cu_seqlens_q, cu_seqlens_k, max_q,
   max_k, causal=True, block_table=table, seqused_k=lengths): causal aligned bottom-right per
   sequence (docs/decode.md);
5. every --check-every steps: each scheduled sequence's rows against an fp32 reference computed
   from its own contiguous history (FlashAttention's rule, per sequence: err(ours) <= 2 x the
   error of the same reference in the input dtype + 1e-5, as tests/test_gpu_kvcache.py), and
   the pool: the allocator's invariants, each scheduled sequence's pages holding exactly its
   history and then the guard value, sampled free pages holding only the guard;
6. finished sequences leave: their pages are refilled with the guard, back to the free list.

At the end every page must be free and the whole pool the guard again (neither the scatter nor
the attention wrote outside the pages a sequence owned), and the decode kernels must have met no
bad cache metadata (flash_attention). Reported: steps, query tokens (prefill, decode), peak
pages, median step times and tokens per second over the attention calls alone and over whole
steps (metadata upload + scatter + attention); CUDA events on a GPU.

Exit 0 when every check passes, 1 when one fails (the report says which), 2 on a usage error.

    python3 ci/serving_loop.py                                  # GPU: flash_attention, bf16
    python3 ci/serving_loop.py --page-size 1 --json loop.json   # also 64, 256
    python3 ci/serving_loop.py --device cpu --attention reference

--attention reference swaps the flash_attention call for paged_varlen_reference, a torch fp32
implementation of the same paged varlen semantics, so the harness (scheduler, allocator,
scatter, checks, report, exit code) runs on a machine without a GPU (tests/test_serving_loop.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

ABS_FLOOR = 1e-5  # the rule's absolute floor, as tests/test_gpu_kvcache.py
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PAD_PAGE = -1  # block-table entries past a sequence's pages: a read of one is a fault


@dataclass(frozen=True)
class LoopConfig:
    sequences: int
    prompt_min: int
    prompt_max: int
    gen_min: int  # decode rows a sequence runs after its prompt
    gen_max: int
    arrival_rate: int  # new sequences a step: uniform in [0, 2 x rate]
    max_batch: int  # sequences in flight at most
    token_budget: int  # query tokens a step (decode rows first, then prefill chunks); 0: no cap
    page_size: int
    pool_tokens: int  # pool size in rows; num_pages = ceil(pool_tokens / page_size) unless set
    heads: int
    kv_heads: int
    d_head: int
    dtype: str = "bf16"
    num_pages: int = 0

    @property
    def pages(self) -> int:
        return self.num_pages or -(-self.pool_tokens // self.page_size)

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_size)


PRESETS = {
    # GQA 32 / 8, d_head 128: 256 sequences of 16-2048 prompt tokens, a pool of 128k rows
    "gpu": LoopConfig(sequences=256, prompt_min=16, prompt_max=2048, gen_min=1, gen_max=256,
                      arrival_rate=4, max_batch=128, token_budget=4096, page_size=16,
                      pool_tokens=131072, heads=32, kv_heads=8, d_head=128),
    # the harness on a CPU: seconds; the budget splits prompts, the pool limits admission
    "tiny": LoopConfig(sequences=24, prompt_min=1, prompt_max=40, gen_min=1, gen_max=10,
                       arrival_rate=2, max_batch=8, token_budget=48, page_size=16,
                       pool_tokens=256, heads=4, kv_heads=2, d_head=32),
}


# ---- the page allocator -----------------------------------------------------------------------


class PoolExhausted(RuntimeError):
    """More pages asked for than the free list holds."""


class PageAllocator:
    """Page ids [0, num_pages) of one pool: a free list (LIFO: the pages freed last are reused
    first) and each page's owner. Host-side bookkeeping; the tensors are the loop's."""

    def __init__(self, num_pages: int, seed: int | None = None):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        if seed is not None:  # scattered page ids, as a pool looks after a while
            random.Random(seed).shuffle(self._free)
        self._owner = [-1] * num_pages
        self._held: dict[int, list[int]] = {}
        self.peak = 0

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    def pages(self, owner: int) -> list[int]:
        """owner's pages in row order (a copy)."""
        return list(self._held.get(owner, ()))

    def free_pages(self) -> list[int]:
        return list(self._free)

    def grow(self, owner: int, count: int) -> list[int]:
        """Give owner pages until it holds count; returns the new ones. All or none: raises
        PoolExhausted, changing nothing, when the free list is short."""
        held = self._held.get(owner, [])
        need = count - len(held)
        if need <= 0:
            return []
        if need > len(self._free):
            raise PoolExhausted(f"sequence {owner} needs {need} more pages, {len(self._free)} "
                                "are free")
        new = [self._free.pop() for _ in range(need)]
        for page in new:
            self._owner[page] = owner
        self._held[owner] = held + new
        self.peak = max(self.peak, self.used)
        return new

    def release(self, owner: int) -> list[int]:
        """Return all of owner's pages to the free list; returns them."""
        if owner not in self._held:
            raise KeyError(f"sequence {owner} holds no pages")
        held = self._held.pop(owner)
        for page in held:
            self._owner[page] = -1
            self._free.append(page)
        return held

    def problems(self) -> list[str]:
        """The invariants, as sentences ([] when they hold): every page is either in the free
        list once and owned by nobody, or held once by exactly the sequence that owns it."""
        out = []
        seen: dict[int, str] = {}
        lists = [("the free list", -1, self._free)]
        lists += [(f"sequence {o}", o, held) for o, held in self._held.items()]
        for where, owner, pages in lists:
            for page in pages:
                if not 0 <= page < self.num_pages:
                    out.append(f"{where} holds page {page}, outside the pool")
                    continue
                if page in seen:
                    out.append(f"page {page} is in {seen[page]} and in {where}")
                seen[page] = where
                if self._owner[page] != owner:
                    out.append(f"page {page} is in {where} but owned by {self._owner[page]}")
        if len(seen) != self.num_pages:
            out.append(f"{self.num_pages - len(seen)} pages are neither free nor held (leaked)")
        return out


# ---- the attention under test -----------------------------------------------------------------


def paged_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=False, block_table=None, seqused_k=None, softmax_scale=None):
    """flash_attn_varlen_func's paged semantics in fp32 (out in q's dtype): sequence b's queries
    are rows cu_seqlens_q[b]..[b + 1] of q, its keys seqused_k[b] (else the cu_seqlens_k
    difference) rows read through block_table[b] from the pools (num_pages, page_size, Hk, D),
    or rows cu_seqlens_k[b]... of k and v without a table; causal aligns bottom-right."""
    from flash_attention.reference import attention_reference

    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = seqused_k.tolist() if seqused_k is not None else None
    out = torch.zeros_like(q)
    for b in range(len(cu_q) - 1):
        q0, q1 = cu_q[b], cu_q[b + 1]
        n = used[b] if used is not None else cu_k[b + 1] - cu_k[b]
        if block_table is None:
            keys, values = k[cu_k[b]:cu_k[b] + n], v[cu_k[b]:cu_k[b] + n]
        else:
            pages = block_table[b, :-(-n // k.shape[1])].long()
            keys, values = k[pages].flatten(0, 1)[:n], v[pages].flatten(0, 1)[:n]
        if q1 > q0:
            o, _ = attention_reference(q[None, q0:q1], keys[None], values[None], softmax_scale,
                                       causal=causal)
            out[q0:q1] = o[0].to(q.dtype)
    return out


ATTENTIONS = ("flash_attention", "reference")


def load_attention(kind: str):
    """The function each step calls, flash_attn_varlen_func's signature; flash_attention is
    imported only here (its extension loads on CUDA machines only)."""
    if kind == "flash_attention":
        from flash_attention.interface import flash_attn_varlen_func

        return flash_attn_varlen_func
    return paged_varlen_reference


# ---- sequences and the loop -------------------------------------------------------------------


@dataclass(eq=False)
class Sequence:
    sid: int
    prompt: int
    gen: int
    arrival: int  # the step it arrives at
    length: int = 0  # rows in the cache
    k_hist: torch.Tensor | None = None  # (prompt + gen, Hk, D): the reference's own copy
    v_hist: torch.Tensor | None = None

    @property
    def total(self) -> int:
        return self.prompt + self.gen

    @property
    def decoding(self) -> bool:
        return self.length >= self.prompt


def make_workload(cfg: LoopConfig, seed: int) -> list[Sequence]:
    """The sequences in arrival order: prompt and decode lengths uniform in their ranges, a
    uniform 0..2 x rate of them arriving each step (at least one at step 0)."""
    rng = random.Random(seed)
    seqs: list[Sequence] = []
    step = 0
    while len(seqs) < cfg.sequences:
        n = rng.randint(0, 2 * cfg.arrival_rate) if step else max(1, cfg.arrival_rate)
        for _ in range(min(n, cfg.sequences - len(seqs))):
            seqs.append(Sequence(len(seqs), rng.randint(cfg.prompt_min, cfg.prompt_max),
                                 rng.randint(cfg.gen_min, cfg.gen_max), step))
        step += 1
    return seqs


def row_slots(table: torch.Tensor, before: torch.Tensor, rows: torch.Tensor, total: int,
              page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, row in page) of each of a step's total new rows, packed sequence by sequence:
    sequence b's rows go to positions before[b] ... before[b] + rows[b] - 1 of its pages
    table[b]. All on the tensors' device, no host sync."""
    device = table.device
    rows = rows.long()
    seq = torch.repeat_interleave(torch.arange(len(rows), device=device), rows,
                                  output_size=total)
    first = torch.cumsum(rows, 0) - rows  # each sequence's first row in the step
    pos = torch.arange(total, device=device) - first[seq] + before.long()[seq]
    return table[seq, pos // page_size].long(), pos % page_size


@dataclass
class Figures:
    steps: int = 0
    idle_steps: int = 0  # steps with nothing to run (no sequence in flight)
    mixed_steps: int = 0  # steps with prefill and decode rows in the one call
    prefill_tokens: int = 0
    decode_tokens: int = 0
    partial_chunks: int = 0  # prefill chunks shorter than the rest of their prompt
    step_tokens: list[int] = field(default_factory=list)
    step_seqs: list[int] = field(default_factory=list)
    attn_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    peak_pages: int = 0
    checked_steps: int = 0
    seq_checks: int = 0
    worst_of_bound: float = 0.0  # max over checks of err / (2 err_pt + floor): <= 1 passes
    worst_err: float = 0.0
    failures: int = 0


class ServingLoop:
    def __init__(self, cfg: LoopConfig, attention, device: str, seed: int, check_every: int,
                 guard: float, guard_sample: int):
        self.cfg, self.attention, self.device = cfg, attention, torch.device(device)
        self.dtype = DTYPES[cfg.dtype]
        self.check_every, self.guard_sample = check_every, guard_sample
        self.guard = torch.tensor(guard, dtype=self.dtype).item()  # as the pool stores it
        shape = (cfg.pages, cfg.page_size, cfg.kv_heads, cfg.d_head)
        self.k_pool = torch.full(shape, self.guard, dtype=self.dtype, device=self.device)
        self.v_pool = torch.full(shape, self.guard, dtype=self.dtype, device=self.device)
        self.alloc = PageAllocator(cfg.pages, seed)
        self.waiting = make_workload(cfg, seed)  # arrival order
        self.active: list[Sequence] = []
        self.reserved = 0  # pages the active sequences hold or will hold
        self.clock = 0
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.rng = random.Random(seed + 1)
        self.fig = Figures()
        self.failures: list[str] = []  # the first few accuracy failures
        self.pool_problems: list[str] = []

    @property
    def done(self) -> bool:
        return not self.waiting and not self.active

    def _is_guard(self, t: torch.Tensor) -> bool:
        if t.numel() == 0:
            return True
        if math.isnan(self.guard):
            return bool(torch.isnan(t).all())
        return bool((t == self.guard).all())

    def _admit(self) -> None:
        cfg = self.cfg
        while self.waiting and self.waiting[0].arrival <= self.clock:
            s = self.waiting[0]
            need = cfg.pages_for(s.total)
            if len(self.active) >= cfg.max_batch or self.reserved + need > cfg.pages:
                return
            self.waiting.pop(0)
            self.reserved += need
            s.k_hist = torch.empty(s.total, cfg.kv_heads, cfg.d_head, dtype=self.dtype,
                                   device=self.device)
            s.v_hist = torch.empty_like(s.k_hist)
            self.active.append(s)

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, new rows) of this step: a decode row for each sequence past its prompt,
        then prefill chunks in admission order within the token budget; admission order."""
        budget = math.inf
        if self.cfg.token_budget:
            budget = self.cfg.token_budget - sum(s.decoding for s in self.active)
        entries = []
        for s in self.active:
            if s.decoding:
                entries.append((s, 1))
            elif budget > 0:
                n = int(min(s.prompt - s.length, budget))
                budget -= n
                entries.append((s, n))
                self.fig.partial_chunks += s.length + n < s.prompt
        return entries

    def step(self) -> None:
        cfg, dev, fig = self.cfg, self.device, self.fig
        self._admit()
        self.clock += 1
        entries = self._schedule()
        if not entries:
            fig.idle_steps += 1
            return
        seqs = [s for s, _ in entries]
        rows = [n for _, n in entries]
        before = [s.length for s in seqs]
        after = [b + n for b, n in zip(before, rows)]
        total = sum(rows)
        decode = sum(n for s, n in entries if s.decoding)
        for s, a in zip(seqs, after):
            self.alloc.grow(s.sid, cfg.pages_for(a))
        width = max(cfg.pages_for(a) for a in after)
        table_rows = [self.alloc.pages(s.sid) for s in seqs]
        table_rows = [p + [PAD_PAGE] * (width - len(p)) for p in table_rows]
        # the model side: this step's new tokens (not timed)
        q = torch.randn(total, cfg.heads, cfg.d_head, generator=self.gen, device=dev,
                        dtype=self.dtype)
        k_new, v_new = (torch.randn(total, cfg.kv_heads, cfg.d_head, generator=self.gen,
                                    device=dev, dtype=self.dtype) for _ in range(2))

        cuda = dev.type == "cuda"
        if cuda:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
        else:
            t0 = time.perf_counter()
        meta = torch.tensor([[0, *rows], [0, *after]], dtype=torch.int32).cumsum(1,
                                                                                dtype=torch.int32)
        cu_q, cu_k = meta.to(dev).unbind(0)
        lens = torch.tensor(after, dtype=torch.int32, device=dev)
        table = torch.tensor(table_rows, dtype=torch.int32, device=dev)
        page, slot = row_slots(table, torch.tensor(before, device=dev),
                               torch.tensor(rows, device=dev), total, cfg.page_size)
        self.k_pool[page, slot] = k_new
        self.v_pool[page, slot] = v_new
        if cuda:
            marks[1].record()
        else:
            t1 = time.perf_counter()
        out = self.attention(q, self.k_pool, self.v_pool, cu_q, cu_k, max(rows), max(after),
                             causal=True, block_table=table, seqused_k=lens)
        if cuda:
            marks[2].record()
            marks[2].synchronize()
            fig.step_ms.append(marks[0].elapsed_time(marks[2]))
            fig.attn_ms.append(marks[1].elapsed_time(marks[2]))
        else:
            t2 = time.perf_counter()
            fig.step_ms.append((t2 - t0) * 1e3)
            fig.attn_ms.append((t2 - t1) * 1e3)

        fig.steps += 1
        fig.decode_tokens += decode
        fig.prefill_tokens += total - decode
        fig.mixed_steps += 0 < decode < total
        fig.step_tokens.append(total)
        fig.step_seqs.append(len(seqs))
        q0 = 0
        for s, b, a in zip(seqs, before, after):  # the reference's contiguous histories
            s.k_hist[b:a] = k_new[q0:q0 + a - b]
            s.v_hist[b:a] = v_new[q0:q0 + a - b]
            q0 += a - b
        if fig.steps % self.check_every == 0:
            self._check_outputs(out, q, seqs, rows, after)
            self._check_pool(seqs, after)
        for s, a in zip(seqs, after):
            s.length = a
        self._retire()

    def _check_outputs(self, out, q, seqs, rows, after) -> None:
        """Each sequence's rows of out against attention over its own history: fp32 (the
        reference) and the input dtype (what low precision costs); one host sync."""
        from flash_attention.reference import attention_reference

        fig = self.fig
        fig.checked_steps += 1
        errs = []
        q0 = 0
        for s, n, a in zip(seqs, rows, after):
            qs, keys, values = q[None, q0:q0 + n], s.k_hist[None, :a], s.v_hist[None, :a]
            ref, _ = attention_reference(qs, keys, values, causal=True)
            low, _ = attention_reference(qs, keys, values, causal=True, upcast=False)
            errs.append(torch.stack([(out[q0:q0 + n].float() - ref[0]).abs().max(),
                                     (low[0].float() - ref[0]).abs().max()]))
            q0 += n
        for s, a, (err, err_pt) in zip(seqs, after, torch.stack(errs).tolist()):
            bound = 2 * err_pt + ABS_FLOOR
            fig.seq_checks += 1
            of_bound = err / bound if math.isfinite(err) else math.inf
            fig.worst_of_bound = max(fig.worst_of_bound, of_bound)
            fig.worst_err = max(fig.worst_err, err if math.isfinite(err) else math.inf)
            if not of_bound <= 1:
                fig.failures += 1
                if len(self.failures) < 8:
                    kind = "decode" if s.decoding else "prefill"
                    self.failures.append(
                        f"step {fig.steps}: sequence {s.sid} ({kind}, {a} keys): error "
                        f"{err:.3e} > 2 x {err_pt:.3e} + {ABS_FLOOR}")

    def _check_pool(self, seqs, after) -> None:
        """The allocator's invariants; each scheduled sequence's pages: its history, then the
        guard; a sample of free pages: the guard only."""
        where = f"step {self.fig.steps}"
        problems = [f"{where}: {p}" for p in self.alloc.problems()]
        for s, a in zip(seqs, after):
            pages = torch.tensor(self.alloc.pages(s.sid), device=self.device)
            for name, pool, hist in (("K", self.k_pool, s.k_hist), ("V", self.v_pool, s.v_hist)):
                rows = pool[pages].flatten(0, 1)
                if not torch.equal(rows[:a], hist[:a]):
                    problems.append(f"{where}: sequence {s.sid}'s {name} pages differ from the "
                                    "rows written for it")
                if not self._is_guard(rows[a:]):
                    problems.append(f"{where}: sequence {s.sid}'s {name} rows past its length "
                                    "were written")
        free = self.alloc.free_pages()
        sample = self.rng.sample(free, min(self.guard_sample, len(free)))
        if sample:
            idx = torch.tensor(sample, device=self.device)
            if not (self._is_guard(self.k_pool[idx]) and self._is_guard(self.v_pool[idx])):
                problems.append(f"{where}: a free page was written")
        self.pool_problems.extend(problems)

    def _retire(self) -> None:
        for s in [s for s in self.active if s.length >= s.total]:
            pages = torch.tensor(self.alloc.release(s.sid), device=self.device)
            self.k_pool[pages] = self.guard
            self.v_pool[pages] = self.guard
            self.reserved -= self.cfg.pages_for(s.total)
            s.k_hist = s.v_hist = None
            self.active.remove(s)
        self.fig.peak_pages = self.alloc.peak

    def finish(self) -> None:
        """The end-of-run pool checks: every page free, the whole pool the guard again."""
        problems = [f"end: {p}" for p in self.alloc.problems()]
        if self.alloc.free != self.alloc.num_pages:
            problems.append(f"end: {self.alloc.used} pages not returned")
        for name, pool in (("K", self.k_pool), ("V", self.v_pool)):
            if not self._is_guard(pool):
                problems.append(f"end: the {name} pool holds rows no live sequence wrote")
        self.pool_problems.extend(problems)


# ---- the client -------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", choices=ATTENTIONS, default="flash_attention")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="workload and pool (default: gpu on CUDA, tiny on CPU); the options "
                   "below override its fields")
    for name in ("sequences", "prompt_min", "prompt_max", "gen_min", "gen_max", "arrival_rate",
                 "max_batch", "token_budget", "page_size", "pool_tokens", "num_pages", "heads",
                 "kv_heads", "d_head"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-every", type=int, default=1,
                   help="check outputs and pages every N-th step")
    p.add_argument("--guard", type=float, default=float("nan"),
                   help="value of pool rows no live sequence wrote (default NaN)")
    p.add_argument("--guard-sample", type=int, default=32,
                   help="free pages checked for the guard on each checked step")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the time figures")
    p.add_argument("--max-steps", type=int, default=100000)
    p.add_argument("--json", type=Path, help="write the figures here")
    return p.parse_args(argv)


def usage_problem(cfg: LoopConfig, args) -> str | None:
    if min(cfg.sequences, cfg.prompt_min, cfg.gen_min, cfg.arrival_rate, cfg.max_batch,
           cfg.page_size, cfg.heads, cfg.kv_heads, cfg.d_head) < 1:
        return "sequences, lengths, rate, batch, page size, heads and d_head must be >= 1"
    if cfg.prompt_min > cfg.prompt_max or cfg.gen_min > cfg.gen_max:
        return "a length range is empty (min > max)"
    if cfg.heads % cfg.kv_heads:
        return f"heads {cfg.heads} is not a multiple of kv_heads {cfg.kv_heads}"
    if cfg.token_budget < 0 or cfg.num_pages < 0 or cfg.pool_tokens < 1:
        return "token budget and num_pages must be >= 0, pool_tokens >= 1"
    longest = cfg.pages_for(cfg.prompt_max + cfg.gen_max)
    if longest > cfg.pages:
        return (f"the pool of {cfg.pages} pages cannot hold the longest sequence "
                f"({cfg.prompt_max + cfg.gen_max} rows, {longest} pages)")
    if args.check_every < 1 or args.guard_sample < 0 or args.warmup < 0:
        return "--check-every must be >= 1, --guard-sample and --warmup >= 0"
    return None


def report(cfg, args, device_name, fig, loop, problems, ok) -> dict:
    timed = slice(args.warmup, None) if fig.steps > args.warmup else slice(None)
    tokens = sum(fig.step_tokens[timed])
    attn_s, step_s = sum(fig.attn_ms[timed]) / 1e3, sum(fig.step_ms[timed]) / 1e3
    med = statistics.median
    figures = {
        "steps": fig.steps, "idle_steps": fig.idle_steps, "mixed_steps": fig.mixed_steps,
        "prefill_tokens": fig.prefill_tokens, "decode_tokens": fig.decode_tokens,
        "partial_chunks": fig.partial_chunks,
        "max_step_tokens": max(fig.step_tokens, default=0),
        "max_step_sequences": max(fig.step_seqs, default=0), "peak_pages": fig.peak_pages,
        "timed_steps": len(fig.step_ms[timed]),
        "median_attention_ms": med(fig.attn_ms[timed]) if fig.steps else 0.0,
        "median_step_ms": med(fig.step_ms[timed]) if fig.steps else 0.0,
        "attention_tokens_per_s": tokens / attn_s if attn_s else 0.0,
        "step_tokens_per_s": tokens / step_s if step_s else 0.0,
        "checked_steps": fig.checked_steps, "sequence_checks": fig.seq_checks,
        "worst_of_bound": fig.worst_of_bound, "worst_err": fig.worst_err,
        "accuracy_failures": fig.failures, "pool_problems": len(loop.pool_problems),
    }
    unit = "CUDA events" if device_name != "cpu" else "wall clock"
    print(f"serving loop (torch {torch.__version__}, {device_name}): attention {args.attention};"
          f" {cfg.sequences} sequences, prompts {cfg.prompt_min}..{cfg.prompt_max}, "
          f"{cfg.gen_min}..{cfg.gen_max} decode rows, ~{cfg.arrival_rate} arriving a step, "
          f"batch <= {cfg.max_batch}, token budget {cfg.token_budget or 'none'}; heads "
          f"{cfg.heads} / {cfg.kv_heads} KV, d_head {cfg.d_head}, {cfg.dtype}; pool "
          f"{cfg.pages} pages x {cfg.page_size} rows (K and V), guard {args.guard}")
    rows = [
        ("steps (idle, mixed prefill+decode)",
         f"{fig.steps} ({fig.idle_steps}, {fig.mixed_steps})"),
        ("query tokens: prefill / decode", f"{fig.prefill_tokens} / {fig.decode_tokens}"),
        ("partial prefill chunks", f"{fig.partial_chunks}"),
        ("a step: max sequences / max tokens",
         f"{figures['max_step_sequences']} / {figures['max_step_tokens']}"),
        ("peak pages used", f"{fig.peak_pages} of {cfg.pages} "
         f"({100 * fig.peak_pages / cfg.pages:.1f}%)"),
        (f"attention: median ms, tokens/s ({unit})",
         f"{figures['median_attention_ms']:.3f}, {figures['attention_tokens_per_s']:.4g}"),
        ("step (upload+scatter+attention): median ms, tokens/s",
         f"{figures['median_step_ms']:.3f}, {figures['step_tokens_per_s']:.4g}"),
        ("accuracy: sequence checks, worst err/bound",
         f"{fig.seq_checks} in {fig.checked_steps} steps, {fig.worst_of_bound:.3f}"),
        ("accuracy failures / pool problems", f"{fig.failures} / {len(loop.pool_problems)}"),
    ]
    print(f"  {'figure':<54} value")
    for name, value in rows:
        print(f"  {name:<54} {value}")
    if fig.steps > args.warmup:
        print(f"  (times: steps {args.warmup + 1}-{fig.steps})")
    for line in loop.failures + loop.pool_problems[:8] + problems:
        print(f"  FAIL: {line}")
    print(f"\nRESULT: {'PASS' if ok else 'FAIL'}" + ("" if ok else (
        f" ({fig.failures} accuracy failures, {len(loop.pool_problems)} pool problems"
        + (f", {'; '.join(problems)}" if problems else "") + ")")))
    return figures


def main(argv=None, attention_fn=None) -> int:
    """Runs the loop; attention_fn replaces the --attention function (tests plant faults)."""
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (use --device cpu --attention reference)",
              file=sys.stderr)
        return 2
    if args.attention == "flash_attention" and attention_fn is None and device == "cpu":
        print("flash_attention runs on CUDA only: use --attention reference on a CPU",
              file=sys.stderr)
        return 2
    cfg = PRESETS[args.preset or ("gpu" if device.startswith("cuda") else "tiny")]
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(LoopConfig)
                 if getattr(args, f.name, None) is not None}
    cfg = dataclasses.replace(cfg, **overrides)
    problem = usage_problem(cfg, args)
    if problem:
        print(f"usage: {problem}", file=sys.stderr)
        return 2
    # the fp32 reference is fp32 all through: no TF32 matmuls
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    loop = ServingLoop(cfg, attention_fn or load_attention(args.attention), device, args.seed,
                       args.check_every, args.guard, args.guard_sample)
    problems = []
    with torch.no_grad():
        while not loop.done and loop.clock < args.max_steps:
            loop.step()
    if not loop.done:
        problems.append(f"not finished after {args.max_steps} steps")
    loop.finish()
    if args.attention == "flash_attention" and attention_fn is None:
        import flash_attention as fa

        problems += [f"decode kernels' status: {e}" for e in fa.kvcache_errors()]
    ok = not problems and not loop.fig.failures and not loop.pool_problems
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    figures = report(cfg, args, device_name, loop.fig, loop, problems, ok)
    if args.json:
        args.json.write_text(json.dumps({
            "config": asdict(cfg), "num_pages": cfg.pages, "attention": args.attention,
            "device": device_name, "torch": torch.__version__, "seed": args.seed,
            "check_every": args.check_every, "guard": str(args.guard), "pass": ok,
            "figures": figures, "accuracy_failures": loop.failures,
            "pool_problems": loop.pool_problems, "problems": problems,
            "per_step": {"tokens": loop.fig.step_tokens, "sequences": loop.fig.step_seqs,
                         "attention_ms": loop.fig.attn_ms, "step_ms": loop.fig.step_ms},
        }, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
