"""A few small backward calls for compute-sanitizer (memcheck, racecheck, synccheck): every
kernel of the backward (preprocess, main with and without the ordered dQ, conversion; on an sm_90
GPU with bwd_sm90:default built, the Hopper kernels, with and without the ordered dQ, and their dQ
conversion, bwd_sm90_convert_dq, for the fixed-length calls, the split-d_head kernel at d_head
136-256 among them; varlen on the sm80 family there) on tails, masks, a window, a softcap,
GQA and a padded d_head, in bf16, then each d_head variant in fp16 with and without a softcap;
a deterministic call with no mask in the Hopper family's rotated order; every sm80-family
kernel of the build by name (on an sm_90 GPU the only way to reach its fixed-length form), in
each of its dQ orders (FLASH_ATTENTION_SM80_DQ_ORDER: the build's GPU's, sm_80-89's lane-major
tiles, rows); the three calls with 17000-20000 keys have more CTAs than an H100 has SMs, some
with no query block under the window.

    compute-sanitizer --tool racecheck python3 ci/backward_sanitize.py
"""

from __future__ import annotations

import os

import torch

import flash_attention as fa


def main() -> None:
    torch.manual_seed(0)
    for d, causal, det, (sq, sk), (h, hk), extra in [
            (128, True, False, (130, 200), (4, 2), {}),
            (64, False, True, (77, 77), (2, 1), {}),
            (40, True, True, (200, 90), (2, 2), {}),
            (256, False, True, (65, 100), (2, 2), {}),
            (192, True, False, (190, 250), (4, 2), {"softcap": 20.0}),
            (256, False, True, (256, 128), (2, 1), {}),
            (256, False, False, (100, 9000), (2, 2), {"window_size": (64, 64)}),
            (64, False, False, (150, 333), (4, 1), {"window_size": (40, 7)}),
            (96, True, False, (300, 260), (2, 2), {"softcap": 30.0}),
            (64, True, True, (400, 300), (2, 1), {"softcap": 30.0}),
            (128, False, True, (512, 256), (2, 2), {}),
            (64, False, False, (128, 20000), (2, 2), {}),
            (128, False, True, (64, 17000), (2, 2), {"window_size": (64, 0)}),
            (128, False, False, (100, 20000), (2, 2), {"softcap": 30.0}),
            # fp16: each d_head's kernel with and without a softcap
            (64, True, False, (200, 170), (2, 1), {"dtype": torch.float16}),
            (64, False, False, (130, 130), (2, 2), {"dtype": torch.float16, "softcap": 20.0}),
            (128, False, True, (150, 200), (2, 2), {"dtype": torch.float16}),
            (128, True, False, (190, 190), (4, 2), {"dtype": torch.float16, "softcap": 20.0}),
            (256, True, False, (100, 140), (2, 1), {"dtype": torch.float16}),
            (224, False, False, (70, 130), (2, 2), {"dtype": torch.float16, "softcap": 20.0})]:
        dtype = extra.pop("dtype", torch.bfloat16)
        q = torch.randn(1, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(1, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(1, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
        fa.attention(q, k, v, causal=causal, deterministic=det, **extra).sum().backward()
        torch.cuda.synchronize()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    cu = torch.tensor([0, 1, 71, 74, 204], dtype=torch.int32, device="cuda")  # 1, 70, 3, 130
    q = torch.randn(204, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    kv = torch.randn(204, 2, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    fa.attention_varlen(q, kv, kv, cu, cu, 130, 130, causal=True).sum().backward()
    torch.cuda.synchronize()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    # Every sm80-family kernel of the build by name (on an sm_90 GPU the Hopper family takes
    # the fixed-length calls, so these run here only by name): tails, causal, its softcap, a
    # d_head below the variant's, ordered dQ on every other one.
    from flash_attention.backward import built
    from flash_attention.kernels.bwd_sm80 import Sm80BwdConfig
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for n, cfg in enumerate(c for c in built() if isinstance(c, Sm80BwdConfig)):
        d = cfg.d_head - 8 if n % 3 == 1 else cfg.d_head
        q, dout = (torch.randn(1, 150, 4, d, device="cuda", dtype=dtypes[cfg.dtype])
                   for _ in range(2))
        k, v = (torch.randn(1, 200, 2, d, device="cuda", dtype=dtypes[cfg.dtype])
                for _ in range(2))
        softcap, det = (20.0 if cfg.softcap else 0.0), n % 2 == 1
        out, lse = torch.ops.flash_attention.attention.default(q, k, v, None, None, 0, 0, None,
                                                               n % 2 == 0, -1, -1, softcap,
                                                               True, "")
        for order in ("", "lane", "rows"):  # "": the order the binding picks for this GPU
            os.environ["FLASH_ATTENTION_SM80_DQ_ORDER"] = order
            grads = torch.ops.flash_attention.bwd.default(dout, q, k, v, out, lse, None, None,
                                                          None, 0, 0, None, n % 2 == 0, -1, -1,
                                                          softcap, det, cfg.name)
            torch.cuda.synchronize()
            assert all(torch.isfinite(g).all() for g in grads), (cfg.name, order)
    os.environ.pop("FLASH_ATTENTION_SM80_DQ_ORDER", None)
    print("sanitize cases done")


if __name__ == "__main__":
    main()
