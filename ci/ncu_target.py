"""A target for Nsight Compute (ci/gpu_validate.sh step profile): runs one attention call a few
times on random inputs, so that ncu can profile the last launch of the kernel it matches.
    python3 ci/ncu_target.py ours|cudnn|fa2 [dtype d_head batch seqlen heads [causal]]"""

import sys

import torch

from fa_tools.gpu.perfcases import contenders

who = sys.argv[1]
dtype, d, b, s, h = (sys.argv[2:7] + ["bf16", "128", "16", "4096", "16"][len(sys.argv[2:7]):])
causal = len(sys.argv) > 7 and sys.argv[7] == "causal"
dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
q, k, v = (torch.randn(int(b), int(s), int(h), int(d), device="cuda", dtype=dt) for _ in range(3))
name = {"ours": "ours", "cudnn": "sdpa_cudnn", "fa2": "sdpa_fa2"}[who]
run = contenders(q, k, v, torch.empty_like(q), names=(name,), causal=causal)[name]
for _ in range(4):
    run()
torch.cuda.synchronize()
print(who, dtype, d, b, s, h, "causal" if causal else "", "done")
