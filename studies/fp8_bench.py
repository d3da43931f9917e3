"""Issue 46's FP8 forward targets on an sm_90 GPU, side by side in one process: fixed-length
calls of 16 heads, d_head 128 (--d-head), about 64k tokens per call (batch = 65536 / seqlen),
seqlen 1024 to 16384, causal and not. Contenders: the FP8 forward (dispatched e4m3 kernel; --ab
adds other built e4m3 kernels by name), the project's bf16 forward (dispatched) on the same
values, and SDPA's cuDNN backend in bf16; cuDNN's FP8 attention where torch's SDPA takes float8
inputs (otherwise the line says why not). TFLOP/s: 4 L^2 d H per sequence, halved when causal.

--varlen: a packed batch instead (sequences of 512-8192 tokens drawn at random, about 64k in
all, causal and not): the FP8 varlen forward (dispatched: the varlen kernels, flag j) against
the project's bf16 varlen forward on the same values and against the FP8 fixed-length call on
a batch of sequences of the pack's mean length (the same tokens; its TFLOP/s are its own).

Every contender is timed in ROUNDS rounds, interleaved (median of each round's 20 calls); a line
gives the median over rounds and the rounds' range. Writes JSON to --out if given.
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

ROUNDS = 3
HEADS = 16
D_HEAD = 128  # the default of --d-head


def row(seqlen: int, causal: bool, ab: list[str], results: list, d_head: int) -> None:
    batch = max(1, 65536 // seqlen)
    shape = (batch, seqlen, HEADS, d_head)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v)
    contenders = {
        "fp8 dispatched": lambda: fp8.attention_fp8(q8, k8, v8, qd, kd, vd, causal=causal),
    }
    for name in ab:  # the masked twin (flag m) in causal rows
        name = name + "m" if causal and not name.endswith("m") else name
        if name not in fp8.ops.BUILT_NAMES:
            continue
        contenders[f"fp8 {name}"] = (
            lambda name=name: fp8.attention_fp8(q8, k8, v8, qd, kd, vd, causal=causal,
                                                config=name))
    try:  # a build of FP8 kernels alone (studies/patch_ab.sh) has no bf16 kernel to compare
        fa.attention(q, k, v, causal=causal)
        contenders["bf16 dispatched"] = lambda: fa.attention(q, k, v, causal=causal)
    except RuntimeError as exc:
        if not causal:
            print(f"  bf16 dispatched: not in this build ({str(exc).splitlines()[0][:100]})")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    contenders["sdpa cudnn bf16"] = cudnn
    try:
        q8t, k8t, v8t = (t.transpose(1, 2) for t in (q8, k8, v8))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q8t, k8t, v8t, is_causal=causal)

        def cudnn_fp8():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q8t, k8t, v8t, is_causal=causal)

        contenders["sdpa cudnn fp8"] = cudnn_fp8
    except Exception as exc:
        if seqlen == 1024 and not causal:
            print(f"  sdpa cudnn fp8: not reachable ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0][:120]})")
    fl = 4 * seqlen * seqlen * d_head * HEADS * batch * (0.5 if causal else 1.0)
    times = interleaved_rounds(contenders, ROUNDS)
    cud = st.median(times["sdpa cudnn bf16"])
    base = st.median(times["bf16 dispatched"]) if "bf16 dispatched" in times else float("nan")
    print(f"b{batch} s{seqlen} causal={causal}:")
    for name, ms in times.items():
        med = st.median(ms)
        tf = fl / med / 1e9
        print(f"  {name:44s} {med:8.3f} ms [{min(ms):.3f}, {max(ms):.3f}] {tf:7.1f} TFLOP/s "
              f"{base / med:5.2f}x bf16 {cud / med:5.2f}x cudnn-bf16")
        results.append({"seqlen": seqlen, "batch": batch, "d_head": d_head, "causal": causal,
                        "contender": name,
                        "ms": ms, "tflops": tf})


def varlen_row(causal: bool, results: list, d_head: int, ab: list[str]) -> None:
    """The --varlen comparison on one pack (the same lengths in every run: seed 0); --ab's
    varlen kernels (flag j; the masked twin in causal rows) by name beside the dispatched one."""
    g = torch.Generator().manual_seed(0)
    lengths: list[int] = []
    while sum(lengths) < 65536:
        lengths.append(int(torch.randint(512, 8193, (1,), generator=g)))
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q, k, v = (torch.randn(total, HEADS, d_head, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize(t[None]) for t in (q, k, v))
    q8, k8, v8 = q8[0], k8[0], v8[0]
    # one descale per (sequence, head): the tensor's, expanded
    qd, kd, vd = (d.expand(len(lengths), HEADS) for d in (qd, kd, vd))
    longest = max(lengths)
    mean = total // len(lengths)
    fq, fk, fv = (torch.randn(len(lengths), mean, HEADS, d_head, device="cuda",
                              dtype=torch.bfloat16) for _ in range(3))
    (f8q, fqd), (f8k, fkd), (f8v, fvd) = fp8.quantize(fq), fp8.quantize(fk), fp8.quantize(fv)
    contenders = {
        "fp8 varlen dispatched": lambda: fp8.attention_fp8(
            q8, k8, v8, qd, kd, vd, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
            max_seqlen_q=longest, max_seqlen_k=longest),
        "bf16 varlen dispatched": lambda: fa.attention_varlen(q, k, v, cu, cu, longest, longest,
                                                              causal=causal),
        "fp8 fixed-length, mean length": lambda: fp8.attention_fp8(f8q, f8k, f8v, fqd, fkd, fvd,
                                                                   causal=causal),
    }
    for name in ab:
        name = name + "m" if causal and not name.endswith("m") else name
        if name not in fp8.ops.BUILT_NAMES or "j" not in name.rsplit("_f", 1)[1]:
            continue
        contenders[f"fp8 varlen {name}"] = (
            lambda name=name: fp8.attention_fp8(
                q8, k8, v8, qd, kd, vd, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                max_seqlen_q=longest, max_seqlen_k=longest, config=name))
    flops = {name: sum(4 * n * n * d_head * HEADS for n in lengths) for name in contenders}
    flops["fp8 fixed-length, mean length"] = 4 * mean * mean * d_head * HEADS * len(lengths)
    times = interleaved_rounds(contenders, ROUNDS)
    print(f"varlen pack of {len(lengths)} sequences, {total} tokens (512-8192), causal={causal}:")
    for name, ms in times.items():
        med = st.median(ms)
        tf = flops[name] * (0.5 if causal else 1.0) / med / 1e9
        print(f"  {name:44s} {med:8.3f} ms [{min(ms):.3f}, {max(ms):.3f}] {tf:7.1f} TFLOP/s")
        results.append({"varlen": True, "lengths": lengths, "d_head": d_head, "causal": causal,
                        "contender": name, "ms": ms, "tflops": tf})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--ab", default="", help="other e4m3 kernels (comma-separated) to time")
    ap.add_argument("--d-head", type=int, default=D_HEAD)
    ap.add_argument("--varlen", action="store_true", help="a packed batch (see above)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, d_head {args.d_head}")
    ab = [n for n in args.ab.split(",") if n]
    fp8.ops.require()  # the extension loaded: BUILT_NAMES lists the kernels --ab may name
    results: list = []
    for causal in (False, True):
        if args.varlen:
            varlen_row(causal, results, args.d_head, ab)
            continue
        for s in map(int, args.seqlens.split(",")):
            row(s, causal, ab, results, args.d_head)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
