"""A few small backward calls for compute-sanitizer (memcheck, racecheck, synccheck): every
kernel of the backward (preprocess, main with and without the ordered dQ, conversion; on an sm_90
GPU with the hopper set built, the Hopper kernels, with and without the ordered dQ, and their dQ
conversion, convert_dq_tiles, for the fixed-length calls at d_head up to 128; d_head 256 and
varlen on the sm80 family there) on tails, masks, a window, a softcap, GQA and a padded d_head;
a deterministic call with no mask in the Hopper family's rotated order; the last three calls
have more CTAs than an H100 has SMs, some with no query block under the window.

    compute-sanitizer --tool racecheck python3 ci/backward_sanitize.py
"""

from __future__ import annotations

import torch

import flash_attention as fa


def main() -> None:
    torch.manual_seed(0)
    for d, causal, det, (sq, sk), (h, hk), extra in [
            (128, True, False, (130, 200), (4, 2), {}),
            (64, False, True, (77, 77), (2, 1), {}),
            (40, True, True, (200, 90), (2, 2), {}),
            (256, False, True, (65, 100), (2, 2), {}),
            (64, False, False, (150, 333), (4, 1), {"window_size": (40, 7)}),
            (96, True, False, (300, 260), (2, 2), {"softcap": 30.0}),
            (64, True, True, (400, 300), (2, 1), {"softcap": 30.0}),
            (128, False, True, (512, 256), (2, 2), {}),
            (64, False, False, (128, 20000), (2, 2), {}),
            (128, False, True, (64, 17000), (2, 2), {"window_size": (64, 0)}),
            (128, False, False, (100, 20000), (2, 2), {"softcap": 30.0})]:
        q = torch.randn(1, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fa.attention(q, k, v, causal=causal, deterministic=det, **extra).sum().backward()
        torch.cuda.synchronize()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    cu = torch.tensor([0, 1, 71, 74, 204], dtype=torch.int32, device="cuda")  # 1, 70, 3, 130
    q = torch.randn(204, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    kv = torch.randn(204, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    fa.attention_varlen(q, kv, kv, cu, cu, 130, 130, causal=True).sum().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    print("sanitize cases done")


if __name__ == "__main__":
    main()
