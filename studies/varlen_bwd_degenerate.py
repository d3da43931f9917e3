"""Whether FlashAttention's backward rule (error <= 2 x the low-precision reference's + 1e-4)
strains sequences with far more queries than keys for both backward families alike: packs of
test_gpu_varlen_hopper (PACKS) over many seeds, each call through the Hopper varlen kernel and
the sm80 family's kernel of the same d_head on the same inputs; per kernel, the cases over the
bound and the worst ratio to it, with the sequence (queries x keys)."""

import argparse

import torch

from flash_attention.kernels import parse
from tests.test_gpu_backward import reference_grads
from tests.test_gpu_varlen_hopper import PACKS, forward_for, packed, run_bwd_kernel

CASES = [  # (hopper, sm80, d_head, dtype, pack, causal, window, softcap)
    ("bwd_sm90_fp16_d64_r128_c128_fj", "bwd_sm80_fp16_d64_r128_c128_w8_fh", 64, torch.float16,
     "many", True, (100, -1), 0.0),
    ("bwd_sm90_bf16_d64_r128_c128_fj", "bwd_sm80_bf16_d64_r128_c128_w8_fh", 64, torch.bfloat16,
     "unequal", False, (64, 17), 0.0),
    ("bwd_sm90_bf16_d256_r64_c64_fjt", "bwd_sm80_bf16_d256_r64_c64_w8_ft", 256, torch.bfloat16,
     "many", True, (-1, -1), 1.5),
    ("bwd_sm90_bf16_d128_r64_c128_fj", "bwd_sm80_bf16_d128_r64_c128_w8_fh", 96, torch.bfloat16,
     "many", True, (-1, -1), 0.0),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    for hopper, sm80, d, dtype, pack, causal, window, softcap in CASES:
        lq, lk = PACKS[pack]
        feats = {"causal": causal, "window_size": window, "softcap": softcap}
        stats = {hopper: [0, 0.0, ""], sm80: [0, 0.0, ""]}
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            q, k, v, cu_q, cu_k = packed(lq, lk, 6, 2, d, dtype)
            dout = torch.randn_like(q)
            out, lse = forward_for(q, k, v, cu_q, cu_k, lq, lk, causal, window, softcap)
            grads = {n: run_bwd_kernel(parse(n), dout, q, k, v, out, lse, cu_q, cu_k, lq, lk,
                                       causal, window, softcap) for n in stats}
            q0 = k0 = 0
            for b, (nq, nk) in enumerate(zip(lq, lk)):
                sq, sk = slice(q0, q0 + nq), slice(k0, k0 + nk)
                q0, k0 = q0 + nq, k0 + nk
                if nq == 0 or nk == 0:
                    continue
                a = (q[None, sq], k[None, sk], v[None, sk], dout[None, sq])
                ref = reference_grads(*a, True, **feats)
                low = reference_grads(*a, False, **feats)
                for n, g in grads.items():
                    for i, name in enumerate(("dq", "dk", "dv")):
                        e = (g[i][sk if i else sq][None].float() - ref[i]).abs().max().item()
                        bound = 2 * (low[i].float() - ref[i]).abs().max().item() + 1e-4
                        s = stats[n]
                        s[0] += e > bound
                        if e / bound > s[1]:
                            s[1], s[2] = e / bound, f"{name} seed {seed} seq {b} ({nq} x {nk})"
        for n, (over, worst, where) in stats.items():
            print(f"{pack} {feats} {n}: {over} over the bound in {args.seeds} seeds; worst "
                  f"{worst:.2f} x the bound at {where}")


if __name__ == "__main__":
    main()
