"""Feature probes on a GPU (issue targets of the features work), printed as lines:
host cost per call of attention() / flash_attn_func / flash_attn_varlen_func against SDPA on a
tiny problem (wall time of 300 calls queued back to back, median of 15, every contender measured
three times interleaved: the spread is the range of the three medians), a sliding window
against full attention at seq 8192, GQA 16/4 against MHA at 16x4096, and the gate's causal
varlen case against SDPA FA2 on the same sequences padded. Run by ci/gpu_validate.sh (step
features)."""

import statistics as st
import time

import torch
import torch.nn.functional as F

import flash_attention as fa
from fa_tools.gpu.perfcases import (
    GATE_CASES,
    Inputs,
    measure_case,
    time_sustained_ms,
    window_vs_full,
)
from flash_attention.interface import flash_attn_func, flash_attn_varlen_func

dt = torch.bfloat16
q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=dt) for _ in range(3))
qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))


def host(fn, n=300):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t) / n * 1e6)
    return st.median(res)


def sd():
    return F.scaled_dot_product_attention(qt, kt, vt)


qp, kp, vp = (t[0] for t in (q, k, v))
cu = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
probes = {"sdpa": sd, "attention": lambda: fa.attention(q, k, v),
          "flash_attn_func": lambda: flash_attn_func(q, k, v),
          "attention causal": lambda: fa.attention(q, k, v, causal=True),
          "flash_attn_varlen_func": lambda: flash_attn_varlen_func(qp, kp, vp, cu, cu, 128, 128)}
costs = {name: [] for name in probes}
for _ in range(3):
    for name, fn in probes.items():
        costs[name].append(host(fn))
for name, c in costs.items():
    print(f"host cost per call, 1x128x8x64 bf16, {name:22s} {st.median(c):6.1f} us "
          f"[{min(c):.1f}, {max(c):.1f}]")
print("\n".join(window_vs_full(rounds=3, progress=None).lines()))
b, s = 16, 4096
q = torch.randn(b, s, 16, 128, device="cuda", dtype=dt)
out = torch.empty_like(q)
k16, v16 = (torch.randn(b, s, 16, 128, device="cuda", dtype=dt) for _ in range(2))
k4, v4 = (torch.randn(b, s, 4, 128, device="cuda", dtype=dt) for _ in range(2))
r = []
for _ in range(5):
    m = st.median(time_sustained_ms(lambda: fa.attention(q, k16, v16, out=out), 10))
    g = st.median(time_sustained_ms(lambda: fa.attention(q, k4, v4, out=out), 10))
    r.append(g / m)
print(f"GQA 16/4 vs MHA 16 heads, b16 s4096 bf16 d128: time ratio median {st.median(r):.3f} "
      f"[{min(r):.3f}, {max(r):.3f}]")
case = next(c for c in GATE_CASES if c.varlen)
inputs = Inputs.make(case)
r = []
for _ in range(5):
    t = measure_case(case, inputs, reps=10)
    r.append(t["ours"] / t["sdpa_fa2"])
print(f"varlen {case.name} (lengths 1024-4096) vs SDPA FA2 causal on the padded batch: time "
      f"ratio median {st.median(r):.3f} [{min(r):.3f}, {max(r):.3f}]")
