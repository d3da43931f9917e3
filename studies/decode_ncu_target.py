"""A target for Nsight Compute on decode steps: runs one decode call (ours: flash_attn_with_kvcache
on a contiguous cache, or with --page N on the same rows in pages of N rows through a shuffled
block table, or with --fp8 on the cache quantized to e4m3 with per-(sequence, KV head)
descales (flash_attention.fp8.quantize), the split heuristic; sdpa: SDPA forced to its cuDNN
backend, on the 16-bit cache) a few times so that ncu can profile a launch of the kernel it
matches.
    python3 studies/decode_ncu_target.py ours|sdpa [batch seqlen heads kv_heads d_head]
        [--page N] [--fp8]"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attention import fp8
from flash_attention.interface import flash_attn_with_kvcache

ap = argparse.ArgumentParser()
ap.add_argument("who", choices=("ours", "sdpa"))
ap.add_argument("shape", nargs="*", type=int)
ap.add_argument("--page", type=int, default=0, help="ours over pages of this many rows")
ap.add_argument("--fp8", action="store_true", help="ours over an e4m3 cache")
args = ap.parse_args()
b, s, h, hk, d = args.shape + [16, 32768, 32, 8, 128][len(args.shape):]
q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
kc, vc = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
k_run, v_run, descales = kc, vc, {}
if args.fp8:  # the cache as k / k_descale in e4m3, descales per (sequence, KV head)
    (k_run, kd), (v_run, vd) = fp8.quantize(kc), fp8.quantize(vc)
    descales = {"k_descale": kd, "v_descale": vd}
kp, vp, table = k_run, v_run, None
if args.page:  # sequence i's rows in pages of a shuffled pool, as the decode bench lays them out
    per = -(-s // args.page)
    order = torch.randperm(b * per, device="cuda")
    table = order.view(b, per).to(torch.int32)
    pool = []
    for src in (k_run, v_run):  # FP8 through uint8 views (no index_put for FP8 dtypes)
        raw = src.view(torch.uint8) if args.fp8 else src
        padded = torch.zeros(b, per * args.page, hk, d, device="cuda", dtype=raw.dtype)
        padded[:, :s] = raw
        dst = torch.zeros(b * per, args.page, hk, d, device="cuda", dtype=raw.dtype)
        dst[order] = padded.view(b * per, args.page, hk, d)
        pool.append(dst.view(src.dtype) if args.fp8 else dst)
    kp, vp = pool
qs, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, kc, vc))
for _ in range(5):
    if args.who == "ours":
        flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, **descales)
    else:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qs, kt, vt, enable_gqa=True)
torch.cuda.synchronize()
