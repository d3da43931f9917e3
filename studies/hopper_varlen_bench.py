"""Issue 45's varlen and softcap forward targets on an sm_90 GPU, side by side in one process:

varlen: packs of sequences drawn at random from 512-8192 tokens (seeded), 16 heads, bf16 and
fp16, d_head 64, 128 and 256, causal and not. Contenders: the dispatched (Hopper varlen) kernel;
the sm80 family's kernel of the same row, named; the fixed-length call at the same total tokens
(sequences of the pack's mean length rounded to 128); SDPA (cuDNN, FA2) on the pack padded to
its longest sequence; SDPA on a nested (jagged) tensor of the pack where torch runs it.
TFLOP/s count only the pack's own attention (per sequence 4 L^2 d H, halved under a causal mask).

softcap: fixed-length 16 x 4096 and 4 x 16384, d_head 64, 128 and 256, causal and not, bf16:
the dispatched Hopper softcap kernel against the same call without a softcap (the Hopper plain
or masked row) and against the sm80 family's softcap kernel.

--backward: the varlen backward instead (the backward operator alone, on the out and LSE of one
forward): the dispatched Hopper varlen backward (bwd_sm90 flag j), the sm80 family's kernel
named, the fixed-length backward at the same total tokens, and SDPA cuDNN's backward on the
padded batch; TFLOP/s count 2.5x the forward's FLOPs.

--ab NAMES (comma-separated kernels in the build) adds each one that serves a row's calls as a
contender of that row (a varlen kernel in the varlen rows, a softcap one in the softcap rows);
--equal adds a varlen row of 16 sequences of 4096 (the pack's cost without unequal lengths).

Every contender is timed in ROUNDS rounds, interleaved (median of each round's 20 calls); a
line gives the median over rounds and the rounds' range. Writes JSON to --out if given.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics as st

import torch
import torch.nn.functional as F

import flash_attention as fa
from fa_tools.gpu.perfcases import interleaved_rounds
from flash_attention import api, ops

ROUNDS = 3
HEADS = 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def pack_lengths(seed: int, tokens: int) -> list[int]:
    """Lengths drawn uniformly from 512-8192 until the pack holds about `tokens` tokens."""
    rng = random.Random(seed)
    out = []
    while sum(out) < tokens:
        out.append(rng.randint(512, 8192))
    return out


def flops(lengths, d_head, causal) -> float:
    return sum(4 * n * n * d_head * HEADS * (0.5 if causal else 1.0) for n in lengths)


def summary(ms: list[float]) -> str:
    return f"{st.median(ms):8.3f} ms [{min(ms):.3f}, {max(ms):.3f}]"


def cu_of(lengths):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device="cuda")


def sm80_kernel(dtype: str, d_head: int, causal: bool, softcap: bool) -> str:
    """The sm80 family's kernel of the dispatch row of long calls of this kind (its fallback)."""
    rows = [r for r in ops.dispatch_rows(ops.BUILT)
            if r[0] == dtype and r[1] == d_head and r[3] == causal and not r[4]
            and r[5] == softcap]
    return max(rows, key=lambda r: r[2])[7]


def alternatives(ab: list[str], dtype: str, d_head: int, causal: bool, softcap: bool,
                 varlen: bool) -> list[str]:
    """The --ab kernels that serve this row's calls (d_head variant, masks as the row's)."""
    from flash_attention.kernels import fwd_sm90
    out = []
    for name in ab:
        cfg = fwd_sm90.parse(name)
        if (cfg.dtype == dtype and cfg.d_head == fwd_sm90.variant_for(d_head)
                and cfg.mask == causal and cfg.softcap == softcap and cfg.varlen == varlen):
            out.append(name)
    return out


def varlen_rows(results: list, dtype: str, d_head: int, causal: bool, seed: int,
                ab: list[str], lengths: list[int] | None = None) -> None:
    dt = DTYPES[dtype]
    lengths = lengths or pack_lengths(seed, 65536)
    total, longest = sum(lengths), max(lengths)
    cu = cu_of(lengths)
    q, k, v = (torch.randn(total, HEADS, d_head, device="cuda", dtype=dt) for _ in range(3))
    hopper = api.explain_varlen(q, k, v, longest, longest, causal=causal)
    sm80 = sm80_kernel(dtype, d_head, causal, softcap=False)

    def varlen(kernel=""):
        return lambda: torch.ops.flash_attention.attention.default(
            q, k, v, cu, cu, longest, longest, None, causal, -1, 0 if causal else -1, 0.0,
            False, kernel)

    mean = max(128, round(total / len(lengths) / 128) * 128)
    batch = max(1, total // mean)
    qf, kf, vf = (torch.randn(batch, mean, HEADS, d_head, device="cuda", dtype=dt)
                  for _ in range(3))
    padded = [torch.zeros(len(lengths), HEADS, longest, d_head, device="cuda", dtype=dt)
              for _ in range(3)]
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        for p, t in zip(padded, (q, k, v), strict=True):
            p[i, :, :b - a] = t[a:b].transpose(0, 1)
    # the padded batch's key mask (keys past each sequence's end): SDPA's cuDNN and FA2
    # backends take no arbitrary mask, so they time the padded batch unmasked (a lower bound of
    # what padding costs them), as the project's features probe does
    contenders = {
        "hopper varlen": varlen(),
        "sm80 varlen": varlen(sm80),
        "fixed same tokens": lambda: fa.attention(qf, kf, vf, causal=causal),
    }
    for name in alternatives(ab, dtype, d_head, causal, False, True):
        contenders["ab " + name.rsplit("_", 1)[1]] = varlen(name)
    for name, backend in (("sdpa cudnn padded", "CUDNN_ATTENTION"),
                          ("sdpa fa2 padded", "FLASH_ATTENTION")):
        be = getattr(torch.nn.attention.SDPBackend, backend)

        def peer(be=be):
            with torch.nn.attention.sdpa_kernel(be):
                return F.scaled_dot_product_attention(*padded, is_causal=causal)
        try:
            peer()
            contenders[name] = peer
        except RuntimeError as exc:
            print(f"  {name}: not run ({str(exc).splitlines()[0][:100]})")
    try:
        nested = [torch.nested.nested_tensor_from_jagged(t, offsets=cu.long()).transpose(1, 2)
                  for t in (q, k, v)]

        def jagged():
            return F.scaled_dot_product_attention(*nested, is_causal=causal)
        jagged()
        contenders["sdpa jagged"] = jagged
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        print(f"  sdpa jagged: not run ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})")
    times = interleaved_rounds(contenders, ROUNDS)
    f_pack = flops(lengths, d_head, causal)
    f_fixed = flops([mean] * batch, d_head, causal)
    print(f"varlen {dtype} d{d_head} causal={causal}: {len(lengths)} sequences, {total} tokens, "
          f"longest {longest}; hopper kernel {hopper}; sm80 kernel {sm80}")
    base = st.median(times["hopper varlen"])
    row = {"dtype": dtype, "d_head": d_head, "causal": causal, "lengths": lengths,
           "hopper_kernel": hopper, "sm80_kernel": sm80, "fixed": [batch, mean], "ms": times}
    for name, ms in times.items():
        tflops = (f_fixed if name == "fixed same tokens" else f_pack) / (st.median(ms) * 1e9)
        print(f"  {name:18s} {summary(ms)}  {tflops:6.1f} TFLOP/s  "
              f"time / hopper varlen {st.median(ms) / base:5.3f}")
    t_h = f_pack / (base * 1e9)
    t_f = f_fixed / (st.median(times["fixed same tokens"]) * 1e9)
    row["tflops_ratio_to_fixed"] = t_h / t_f
    print(f"  hopper varlen TFLOP/s / fixed-length TFLOP/s: {t_h / t_f:.3f}; "
          f"sm80 varlen time / hopper varlen: {st.median(times['sm80 varlen']) / base:.3f}")
    results.append(row)


def backward_rows(results: list, dtype: str, d_head: int, causal: bool, seed: int,
                  lengths: list[int] | None = None) -> None:
    from flash_attention.backward import built
    from flash_attention.kernels import Call, bwd_sm80
    dt = DTYPES[dtype]
    lengths = lengths or pack_lengths(seed, 65536)
    total, longest = sum(lengths), max(lengths)
    cu = cu_of(lengths)
    q, k, v, dout = (torch.randn(total, HEADS, d_head, device="cuda", dtype=dt)
                     for _ in range(4))
    out, lse = torch.ops.flash_attention.attention.default(
        q, k, v, cu, cu, longest, longest, None, causal, -1, 0 if causal else -1, 0.0, True, "")
    hopper = torch.ops.flash_attention.bwd_explain(dout, q, k, v, True, False)
    sm80 = bwd_sm80.select(Call(dtype, d_head), built()).name
    bwd = torch.ops.flash_attention.bwd.default

    def varlen(kernel=""):
        return lambda: bwd(dout, q, k, v, out, lse, None, cu, cu, longest, longest, None, causal,
                           -1, 0 if causal else -1, 0.0, False, kernel)

    mean = max(128, round(total / len(lengths) / 128) * 128)
    batch = max(1, total // mean)
    qf, kf, vf, df = (torch.randn(batch, mean, HEADS, d_head, device="cuda", dtype=dt)
                      for _ in range(4))
    of, lf = fa.attention(qf, kf, vf, causal=causal, return_lse=True)

    def fixed():
        return bwd(df, qf, kf, vf, of, lf, None, None, None, 0, 0, None, causal, -1,
                   0 if causal else -1, 0.0, False, "")
    padded = [torch.zeros(len(lengths), HEADS, longest, d_head, device="cuda", dtype=dt)
              for _ in range(4)]
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        for p, t in zip(padded, (q, k, v, dout), strict=True):
            p[i, :, :b - a] = t[a:b].transpose(0, 1)
    contenders = {"hopper varlen": varlen(), "sm80 varlen": varlen(sm80),
                  "fixed same tokens": fixed}
    try:
        leaves = [t.detach().requires_grad_() for t in padded[:3]]
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            o_sdpa = F.scaled_dot_product_attention(*leaves, is_causal=causal)

        def sdpa():
            return torch.autograd.grad(o_sdpa, leaves, padded[3], retain_graph=True)
        sdpa()
        contenders["sdpa cudnn padded"] = sdpa
    except RuntimeError as exc:
        print(f"  sdpa cudnn padded: not run ({str(exc).splitlines()[0][:100]})")
    times = interleaved_rounds(contenders, ROUNDS)
    f_pack = 2.5 * flops(lengths, d_head, causal)
    f_fixed = 2.5 * flops([mean] * batch, d_head, causal)
    print(f"varlen backward {dtype} d{d_head} causal={causal}: {len(lengths)} sequences, {total} "
          f"tokens, longest {longest}; hopper kernel {hopper}; sm80 kernel {sm80}")
    base = st.median(times["hopper varlen"])
    for name, ms in times.items():
        tflops = (f_fixed if name == "fixed same tokens" else f_pack) / (st.median(ms) * 1e9)
        print(f"  {name:18s} {summary(ms)}  {tflops:6.1f} TFLOP/s  "
              f"time / hopper varlen {st.median(ms) / base:5.3f}")
    t_f = f_fixed / (st.median(times["fixed same tokens"]) * 1e9)
    ratio = f_pack / (base * 1e9) / t_f
    print(f"  hopper varlen TFLOP/s / fixed-length TFLOP/s: {ratio:.3f}; "
          f"sm80 varlen time / hopper varlen: {st.median(times['sm80 varlen']) / base:.3f}")
    results.append({"dtype": dtype, "d_head": d_head, "causal": causal, "lengths": lengths,
                    "hopper_kernel": hopper, "sm80_kernel": sm80, "fixed": [batch, mean],
                    "ms": times, "tflops_ratio_to_fixed": ratio})


def softcap_rows(results: list, dtype: str, d_head: int, batch: int, seqlen: int,
                 causal: bool, ab: list[str]) -> None:
    dt = DTYPES[dtype]
    q, k, v = (torch.randn(batch, seqlen, HEADS, d_head, device="cuda", dtype=dt)
               for _ in range(3))
    left, right = (-1, 0) if causal else (-1, -1)
    capped = ops.extension().explain(q, k, v, left, right, True)
    plain = ops.extension().explain(q, k, v, left, right, False)
    sm80 = sm80_kernel(dtype, d_head, causal, softcap=True)
    contenders = {
        "hopper softcap": lambda: fa.attention(q, k, v, causal=causal, softcap=30.0),
        "hopper no softcap": lambda: fa.attention(q, k, v, causal=causal),
        "sm80 softcap": lambda: fa.forward(sm80, q, k, v, causal=causal, softcap=30.0),
    }
    for name in alternatives(ab, dtype, d_head, causal, True, False):
        contenders["ab " + name.rsplit("_", 1)[1]] = (
            lambda name=name: fa.forward(name, q, k, v, causal=causal, softcap=30.0))
    times = interleaved_rounds(contenders, ROUNDS)
    f = 4 * batch * seqlen * seqlen * d_head * HEADS * (0.5 if causal else 1.0)
    base = st.median(times["hopper softcap"])
    print(f"softcap {dtype} d{d_head} {batch}x{seqlen} causal={causal}: {capped} "
          f"(plain: {plain}; sm80: {sm80})")
    for name, ms in times.items():
        print(f"  {name:18s} {summary(ms)}  {f / (st.median(ms) * 1e9):6.1f} TFLOP/s  "
              f"time / hopper softcap {st.median(ms) / base:5.3f}")
    ratio = st.median(times["hopper no softcap"]) / base
    print(f"  softcap TFLOP/s / no-softcap TFLOP/s: {ratio:.3f}")
    results.append({"dtype": dtype, "d_head": d_head, "batch": batch, "seqlen": seqlen,
                    "causal": causal, "kernel": capped, "plain": plain, "sm80": sm80,
                    "ms": times, "softcap_over_plain_tflops": ratio})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="bf16 only, fewer shapes")
    parser.add_argument("--ab", default="", help="kernels to add where they serve a row")
    parser.add_argument("--equal", action="store_true", help="a pack of equal lengths too")
    parser.add_argument("--no-softcap", action="store_true", help="the varlen rows alone")
    parser.add_argument("--softcap-only", action="store_true", help="the softcap rows alone")
    parser.add_argument("--backward", action="store_true", help="the varlen backward rows")
    args = parser.parse_args()
    ab = [n for n in args.ab.split(",") if n]
    torch.manual_seed(0)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    varlen, softcap = [], []
    dtypes = ("bf16",) if args.quick else ("bf16", "fp16")
    if args.backward:
        for dtype in dtypes:
            for d_head in (128, 64, 256):
                for causal in (False, True):
                    backward_rows(varlen, dtype, d_head, causal, d_head + causal)
        if args.equal:
            backward_rows(varlen, "bf16", 128, False, 0, lengths=[4096] * 16)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "backward": varlen}, f, indent=1)
        return
    for dtype in () if args.softcap_only else dtypes:
        for d_head in (128, 64, 256):
            for causal in (False, True):
                varlen_rows(varlen, dtype, d_head, causal, d_head + causal, ab)
    if args.equal:
        varlen_rows(varlen, "bf16", 128, False, 0, ab, lengths=[4096] * 16)
    for d_head in () if args.no_softcap else (128, 64, 256):
        for batch, seqlen in ((16, 4096), (4, 16384))[: 1 if args.quick else 2]:
            for causal in (False, True):
                softcap_rows(softcap, "bf16", d_head, batch, seqlen, causal, ab)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "varlen": varlen,
                       "softcap": softcap}, f, indent=1)


if __name__ == "__main__":
    main()
