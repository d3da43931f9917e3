"""compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over small runs of chosen
configs, including tail shapes (and, for kernels with masks, causal and window calls), a d_head
below the variant's and (sm80 family) a varlen batch, each call's q, k, v in a memory layout
drawn per config (contiguous, a transposed (b, h, s, d) buffer, or a view 8 bytes past a 16-byte
boundary that the operator copies first), with a summary of errors per tool. The tools run side
by side, one process each. GPU only."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass

from ..analysis.binaries import find_tool

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
# (batch, seqlen_q, seqlen_k, heads): a tail in both sequences, and exact multiples of 128.
SHAPES = ((1, 131, 77, 2), (2, 128, 256, 1))

_PROGRAM = """
import random, sys, torch, flash_attention as fa
shapes = {shapes!r}

def laid_out(shape, dt, rng):
    b, s, h, d = shape
    kind = rng.choice(("contiguous", "bhsd", "offset"))
    if kind == "bhsd":
        return torch.randn(b, h, s, d, device="cuda", dtype=dt).transpose(1, 2)
    if kind == "offset":  # 4 elements in: not 16-byte aligned, copied by the operator
        return torch.randn(b, s, h, d + 8, device="cuda", dtype=dt)[..., 4:4 + d]
    return torch.randn(b, s, h, d, device="cuda", dtype=dt)

for name in sys.argv[1:]:
    cfg = fa.parse(name)
    rng = random.Random(name)
    dt = {{"fp16": torch.float16, "bf16": torch.bfloat16}}[cfg.dtype]
    # kernels with masks: causal (rows without keys when sq > sk) and a two-sided window
    masks = [(True, (-1, -1)), (False, (37, 5))] if cfg.mask else [(False, (-1, -1))]
    softcap = 2.0 if cfg.softcap else 0.0
    for b, sq, sk, h in shapes:
        q = laid_out((b, sq, h, cfg.d_head), dt, rng)
        k = laid_out((b, sk, h, cfg.d_head), dt, rng)
        v = laid_out((b, sk, h, cfg.d_head), dt, rng)
        for causal, window in masks:
            fa.attention(q, k, v, config=cfg, return_lse=True, causal=causal,
                         window_size=window, softcap=softcap)
    # a smaller d_head on this variant (zero-filled columns), and a varlen batch with
    # sequences of 0, 1 and tail lengths (keys of another length than queries)
    q = torch.randn(1, 77, 2, cfg.d_head - 8, device="cuda", dtype=dt)
    fa.attention(q, q, q, config=cfg, causal=cfg.mask, softcap=softcap)
    if cfg.family == "sm80":  # varlen batches run on the sm80 family only
        lq, lk = [0, 1, 77, 131], [5, 0, 130, 64]
        cu_q, cu_k = (torch.tensor([0] + [sum(n[:i + 1]) for i in range(len(n))],
                                   dtype=torch.int32, device="cuda") for n in (lq, lk))
        qv = torch.randn(sum(lq), 2, cfg.d_head, device="cuda", dtype=dt)
        kv = torch.randn(sum(lk), 2, cfg.d_head, device="cuda", dtype=dt)
        torch.ops.flash_attention.attention(qv, kv, kv, cu_q, cu_k, max(lq), max(lk), None,
                                            cfg.mask, -1, -1, softcap, True, name)
torch.cuda.synchronize()
print("ran", len(sys.argv) - 1, "configs")
"""


@dataclass(frozen=True)
class SanitizerResult:
    tool: str
    errors: int
    returncode: int
    log: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.errors == 0


def _errors(text: str) -> int | None:
    m = re.search(r"ERROR SUMMARY: (\d+) error", text)
    if m:
        return int(m[1])
    m = re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?", text)
    return int(m[1]) if m else None


def run(configs: list[str], tools: tuple[str, ...] = TOOLS, timeout: int = 600
        ) -> list[SanitizerResult]:
    exe = find_tool("compute-sanitizer")
    program = _PROGRAM.format(shapes=SHAPES)
    procs = {}
    for tool in tools:  # side by side: each tool is a process of its own on the one GPU
        cmd = [exe, "--tool", tool, "--error-exitcode", "1", sys.executable, "-c", program,
               *configs]
        procs[tool] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    deadline = time.monotonic() + timeout
    results = []
    for tool, proc in procs.items():
        try:
            log, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0] + f"\n{tool}: killed after {timeout} s"
        errors = _errors(log)
        results.append(SanitizerResult(tool, -1 if errors is None else errors, proc.returncode,
                                       log))
    return results
