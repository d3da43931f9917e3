"""A target for Nsight Compute on decode steps: runs one decode call (ours: flash_attn_with_kvcache
on a contiguous cache, the split heuristic; sdpa: SDPA forced to its cuDNN backend) a few times
so that ncu can profile a launch of the kernel it matches.
    python3 studies/decode_ncu_target.py ours|sdpa [batch seqlen heads kv_heads d_head]"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attention.interface import flash_attn_with_kvcache

ap = argparse.ArgumentParser()
ap.add_argument("who", choices=("ours", "sdpa"))
ap.add_argument("shape", nargs="*", type=int)
args = ap.parse_args()
b, s, h, hk, d = args.shape + [16, 32768, 32, 8, 128][len(args.shape):]
q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
qs, kt, vt = q.transpose(1, 2).contiguous(), kc.transpose(1, 2).contiguous(), \
    vc.transpose(1, 2).contiguous()
for _ in range(5):
    if args.who == "ours":
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    else:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qs, kt, vt, enable_gqa=True)
torch.cuda.synchronize()
