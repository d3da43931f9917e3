"""Probe: the FP8 forward's LSE against the fp32 reference on the dequantised inputs, by row
(which rows and by how much), with and without descales."""

import torch

from flash_attention import fp8
from flash_attention.reference import attention_reference_fp8

torch.manual_seed(0)
for shape, scaled in (((1, 256, 256, 2, 2, 128), False), ((1, 256, 256, 2, 2, 128), True),
                      ((1, 1, 300, 2, 2, 128), True), ((1, 64, 64, 1, 1, 128), True)):
    b, sq, sk, h, hk, d = shape
    q, k, v = (torch.randn(b, s, n, d, device="cuda") for s, n in ((sq, h), (sk, hk), (sk, hk)))
    if scaled:
        (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v)
    else:
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        qd = kd = vd = None
    out, lse = fp8.attention_fp8(q8, k8, v8, qd, kd, vd, return_lse=True)
    ref, lse_ref = attention_reference_fp8(q8, k8, v8, qd, kd, vd)
    diff = (lse - lse_ref)[0, 0]
    print(shape, "scaled" if scaled else "raw", "out err", (out.float() - ref).abs().max().item(),
          "lse max|diff|", diff.abs().max().item())
    print("  diff rows 0..20:", [round(x, 4) for x in diff[:20].tolist()])
    print("  lse rows 0..5:", lse[0, 0, :5].tolist(), "ref", lse_ref[0, 0, :5].tolist())
    if sq >= 128:
        print("  mean |diff| by 16-row group:",
              [round(x, 4) for x in diff[:128].abs().view(8, 16).mean(1).tolist()])
