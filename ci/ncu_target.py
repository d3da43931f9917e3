"""A target for Nsight Compute (ci/gpu_validate.sh step profile): runs one attention call a few
times on random inputs, so that ncu can profile the last launch of the kernel it matches.
    python3 ci/ncu_target.py ours|cudnn|fa2 [dtype d_head batch seqlen heads [causal]]"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_attention as fa

who = sys.argv[1]
dtype, d, b, s, h = (sys.argv[2:7] + ["bf16", "128", "16", "4096", "16"][len(sys.argv[2:7]):])
causal = len(sys.argv) > 7 and sys.argv[7] == "causal"
dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
q, k, v = (torch.randn(int(b), int(s), int(h), int(d), device="cuda", dtype=dt) for _ in range(3))
if who == "ours":
    def run():
        return fa.attention(q, k, v, causal=causal)
else:
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[who]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
for _ in range(4):
    run()
torch.cuda.synchronize()
print(who, dtype, d, b, s, h, "causal" if causal else "", "done")
