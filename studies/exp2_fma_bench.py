"""A Hopper forward kernel against its exp2_fma twin (flag u: a share of the softmax's exp2s, and
with a softcap the tanh's exponential, by a polynomial on the FMA pipe), side by side in one
process with SDPA cuDNN in bf16 on the same shape as the peer that shows clock drift. Each
kernel named in --kernels (the twin without flag u; both must be built) runs its own kind of
call: FP8 inputs for an e4m3 kernel, causal for a masked one (flag m), softcap 30 for flag t;
16 heads, d_head the kernel's, each --shapes batch x seqlen. Lines: median ms over rounds (each
round the median of 20 calls, contenders interleaved), the rounds' range, TFLOP/s (4 L^2 d H
per sequence, halved when causal), twin / kernel speed and each against cuDNN.

    python3 studies/exp2_fma_bench.py --kernels fwd_sm90_e4m3_d128_r128_c192_s2_fwpia \\
        --shapes 16x4096,4x16384 [--rounds 3] [--out F.json]

--no-twin times each kernel alone beside cuDNN (trees that differ in their source, compared by
studies/patch_ab.sh, each kernel's time against the same cuDNN call).
"""

from __future__ import annotations

import argparse
import json
import statistics as st

import torch
import torch.nn.functional as F

import flash_attention as fa
from fa_tools.gpu.perfcases import interleaved_rounds
from flash_attention import fp8
from flash_attention.kernels import parse

HEADS = 16
SOFTCAP = 30.0


def twin_of(name: str) -> str:
    return parse(name).replace(exp2_fma=True).name


def measure(name: str, batch: int, seqlen: int, rounds: int, with_twin: bool) -> list[dict]:
    cfg = parse(name)
    twin = twin_of(name) if with_twin else None
    causal, softcap = cfg.mask, SOFTCAP if cfg.softcap else 0.0
    shape = (batch, seqlen, HEADS, cfg.d_head)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if cfg.dtype == "e4m3":
        (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v)

        def run(kernel):
            return lambda: fp8.attention_fp8(q8, k8, v8, qd, kd, vd, causal=causal,
                                             softcap=softcap, config=kernel)
    else:
        if cfg.dtype == "fp16":
            q, k, v = (t.half() for t in (q, k, v))

        def run(kernel):
            return lambda: fa.attention(q, k, v, causal=causal, softcap=softcap, config=kernel)
    qt, kt, vt = (t.to(torch.bfloat16).transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    contenders = {name: run(name), **({twin: run(twin)} if twin else {}), "sdpa cudnn bf16": cudnn}
    times = interleaved_rounds(contenders, rounds)
    flops = 4 * seqlen * seqlen * cfg.d_head * HEADS * batch * (0.5 if causal else 1.0)
    med = {n: st.median(ms) for n, ms in times.items()}
    print(f"{name} b{batch} s{seqlen} causal={causal} softcap={softcap}:")
    out = []
    for n, ms in times.items():
        print(f"  {n:48s} {med[n]:8.3f} ms [{min(ms):.3f}, {max(ms):.3f}] "
              f"{flops / med[n] / 1e9:7.1f} TFLOP/s {med['sdpa cudnn bf16'] / med[n]:5.2f}x cudnn")
        out.append({"kernel": name, "contender": n, "batch": batch, "seqlen": seqlen,
                    "causal": causal, "softcap": softcap, "ms": ms})
    if twin:
        print(f"  exp2_fma twin speed: {med[name] / med[twin]:.3f}x "
              f"(rounds: {', '.join(f'{a / b:.3f}' for a, b in zip(times[name], times[twin]))})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", required=True, help="comma-separated names without flag u")
    ap.add_argument("--shapes", default="16x4096,4x16384", help="batch x seqlen, ...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--no-twin", action="store_true", help="each kernel alone beside cuDNN")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    built = {c.name for c in fa.available_configs()}
    results = []
    for name in args.kernels.split(","):
        missing = [n for n in (name, *(() if args.no_twin else (twin_of(name),)))
                   if n not in built]
        if missing:
            print(f"{name}: skipped, not built: {', '.join(missing)}")
            continue
        for shape in args.shapes.split(","):
            batch, seqlen = (int(x) for x in shape.split("x"))
            results += measure(name, batch, seqlen, args.rounds, not args.no_twin)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
