"""Issue 45's short sequences (ViT-like shapes) on an sm_90 GPU, side by side in one process:
the dispatched forward and named kernels (--ab) against SDPA's flash, cuDNN and efficient
backends, no mask, bf16. q, k, v are (batch, seq, heads, d_head) contiguous for ours and their
(batch, heads, seq, d_head) transposed views for SDPA, as a vision transformer's projections
give them. Every contender is timed on the GPU alone (calls queued behind a device-side sleep:
no host gaps) in ROUNDS interleaved rounds; a line gives microseconds per call (median over
rounds, with the rounds' range) and each contender's time over the best SDPA backend's.

    PYTHONPATH=src python3 studies/short_seq_bench.py [--seqs 197,257,577,785,1024]
        [--batches 1,8,64] [--shapes 64x12,80x16,128x16] [--ab NAMES] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics as st

import torch
import torch.nn.functional as F

import flash_attention as fa
from fa_tools.gpu.perfcases import interleaved_rounds
from flash_attention import ops
from flash_attention.kernels import fwd_sm90

ROUNDS = 3
BACKENDS = {"sdpa flash": "FLASH_ATTENTION", "sdpa cudnn": "CUDNN_ATTENTION",
            "sdpa efficient": "EFFICIENT_ATTENTION"}


def serves(name: str, d_head: int) -> bool:
    """Whether the named fwd_sm90 kernel serves a plain call at this d_head."""
    cfg = fwd_sm90.parse(name)
    return (cfg.d_head == fwd_sm90.variant_for(d_head) and not cfg.mask and not cfg.softcap
            and not cfg.varlen and cfg.dtype == "bf16")


def row(results: list, batch: int, seq: int, heads: int, d_head: int, ab: list[str]) -> None:
    q, k, v = (torch.randn(batch, seq, heads, d_head, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    ref = fa.attention(q, k, v)
    contenders = {"ours": lambda: fa.attention(q, k, v)}
    for name in ab:
        if serves(name, d_head):
            contenders[name.split("_d", 1)[1]] = lambda name=name: fa.attention(q, k, v,
                                                                                 config=name)
    for label, backend in BACKENDS.items():
        be = getattr(torch.nn.attention.SDPBackend, backend)

        def peer(be=be):
            with torch.nn.attention.sdpa_kernel(be):
                return F.scaled_dot_product_attention(qt, kt, vt)
        try:
            peer()
            contenders[label] = peer
        except RuntimeError as exc:
            print(f"  {label}: not run ({str(exc).splitlines()[0][:90]})")
    for label, fn in contenders.items():  # every contender computes the same attention
        err = (fn().float() - (ref if not label.startswith("sdpa") else ref.transpose(1, 2))
               .float()).abs().max().item()
        if err > 0.02:
            raise SystemExit(f"{label} at {batch}x{seq}x{heads}x{d_head} differs by {err}")
    times = interleaved_rounds(contenders, ROUNDS, reps=30)
    med = {name: st.median(ms) * 1e3 for name, ms in times.items()}
    best_sdpa = min((t, n) for n, t in med.items() if n.startswith("sdpa"))
    kernel = ops.extension().explain(q, k, v, -1, -1, False).split()[0]
    flops = 4 * batch * heads * seq * seq * d_head
    print(f"b{batch} s{seq} h{heads} d{d_head}: ours {kernel}; best SDPA {best_sdpa[1]}")
    for name, ms in times.items():
        print(f"  {name:28s} {med[name]:8.2f} us [{min(ms) * 1e3:.2f}, {max(ms) * 1e3:.2f}]  "
              f"{flops / (med[name] * 1e6):6.1f} TFLOP/s  best SDPA / this "
              f"{best_sdpa[0] / med[name]:5.3f}")
    results.append({"batch": batch, "seq": seq, "heads": heads, "d_head": d_head,
                    "kernel": kernel, "best_sdpa": best_sdpa[1],
                    "us": {n: [t * 1e3 for t in ms] for n, ms in times.items()}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="197,257,577,785,1024")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--shapes", default="64x12,80x16,128x16", help="d_head x heads, ...")
    ap.add_argument("--ab", default="", help="named fwd_sm90 kernels (in the build) to add")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ab = [n for n in args.ab.split(",") if n]
    results: list = []
    for shape in args.shapes.split(","):
        d_head, heads = (int(x) for x in shape.split("x"))
        for seq in (int(s) for s in args.seqs.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                row(results, batch, seq, heads, d_head, ab)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
