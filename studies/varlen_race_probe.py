"""A probe of the Hopper varlen forward's run-to-run differences (the test "many" pack's second
run differed for fwialdgzj; fwialdgzjm gave wrong rows): each kernel named runs the pack
--runs times, each output allocated where a NaN-filled block of its size was just freed (so
rows no tile writes show as NaN); per run, the rows that differ from the per-sequence fp32
reference by more than the rule's tolerance, or from run 0, with their sequence, head and row
within the sequence, and the tile (query block) they fall in."""

import argparse

import torch

from flash_attention.reference import attention_reference
from tests.test_gpu_varlen_hopper import PACKS, packed

KERNELS = ["fwd_sm90_fp16_d128_r128_c128_s2_fwialdgzj",
           "fwd_sm90_bf16_d128_r128_c128_s2_fwialdgzj",
           "fwd_sm90_bf16_d64_r192_c96_s3_fwaldngzj", "fwd_sm90_bf16_d128_r128_c128_s2_fwpiazj"]


def fixed_probe(name: str, runs: int) -> None:
    """The same for a fixed-length kernel: 4 x 2048 (causal for a masked kernel), against its
    first run and the fp32 reference."""
    dtype = torch.float16 if "_fp16_" in name else torch.bfloat16
    causal = name.endswith("m") or name.endswith("mt")
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2048, 6, 128, device="cuda", dtype=dtype) for _ in range(3))
    ref, _ = attention_reference(q.float(), k.float(), v.float(), causal=causal)
    first, bad_runs = None, 0
    for r in range(runs):
        junk = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
        del junk
        out, _ = torch.ops.flash_attention.attention.default(
            q, k, v, None, None, 0, 0, None, causal, -1, -1, 0.0, True, name)
        torch.cuda.synchronize()
        bad = ((out.float() - ref).abs().amax(-1) > 0.05) | ~torch.isfinite(out.float()).all(-1)
        diff = (out != first).any(-1) if first is not None else torch.zeros_like(bad)
        first = out if first is None else first
        if bad.any() or diff.any():
            bad_runs += 1
            b, t, h = torch.nonzero(bad | diff, as_tuple=True)
            print(f"{name} run {r}: {int(bad.sum())} rows over the tolerance, {int(diff.sum())} "
                  f"differ from run 0; first (batch, row, head): "
                  f"{list(zip(b.tolist(), t.tolist(), h.tolist()))[:6]}")
    print(f"{name} (4 x 2048, causal={causal}): {bad_runs} of {runs} runs wrong or different")


def explain_rows(out, ref, rows, heads, starts_q, limit: int = 8) -> None:
    """For the first wrong (row, head)s: the error, whether the row is zero or NaN, and the
    reference row (any row, any head) it lies closest to: a stale or misplaced tile shows as
    another row's values."""
    flat = ref.reshape(-1, ref.shape[-1])  # (tokens * heads, d)
    for t, h in list(zip(rows.tolist(), heads.tolist()))[:limit]:
        o = out[t, h].float()
        near = (flat - o).abs().amax(-1)
        best = int(near.argmin())
        bt, bh = divmod(best, ref.shape[1])
        b = max(i for i in range(len(starts_q) - 1) if starts_q[i] <= t)
        print(f"    token {t} (seq {b} row {t - starts_q[b]}) head {h}: err "
              f"{(o - ref[t, h]).abs().max().item():.3g}, zero {bool((o == 0).all())}, nan "
              f"{bool(o.isnan().any())}; closest ref row token {bt} head {bh} "
              f"(diff {near[best].item():.3g})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--pack", default="many")
    ap.add_argument("--fixed", default="", help="kernels run on a fixed-length 4 x 2048 batch")
    args = ap.parse_args()
    for name in filter(None, args.fixed.split(",")):
        fixed_probe(name, args.runs)
    lq, lk = PACKS[args.pack]
    for name in filter(None, args.kernels.split(",")):
        dtype = torch.float16 if "_fp16_" in name else torch.bfloat16
        d = 96 if "_d128_" in name else 64
        causal = name.endswith("m") or name.endswith("mt")
        torch.manual_seed(0)
        q, k, v, cu_q, cu_k = packed(lq, lk, 6, 2, d, dtype)
        starts_q = cu_q.tolist()
        ref = torch.empty(q.shape, dtype=torch.float32, device="cuda")
        for b in range(len(lq)):
            sq, sk = slice(starts_q[b], starts_q[b + 1]), slice(cu_k[b].item(), cu_k[b + 1].item())
            if lq[b] and lk[b]:
                o, _ = attention_reference(q[None, sq].float(), k[None, sk].float(),
                                           v[None, sk].float(), causal=causal)
                ref[sq] = o[0]
            else:
                ref[sq] = 0
        runs = []
        bad_runs = 0
        for r in range(args.runs):
            junk = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
            del junk
            out, _ = torch.ops.flash_attention.attention.default(
                q, k, v, cu_q, cu_k, max(lq), max(lk), None, causal, -1, 0 if causal else -1,
                0.0, True, name)
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().amax(-1)  # (tokens, heads)
            bad = (err > 0.05) | ~torch.isfinite(err)
            diff0 = (out != runs[0]).any(-1) if runs else torch.zeros_like(bad)
            runs.append(out)
            if bad.any() or diff0.any():
                bad_runs += 1
                rows, heads = torch.nonzero(bad | diff0, as_tuple=True)
                seen = {}
                for t, h in zip(rows.tolist(), heads.tolist()):
                    b = max(i for i in range(len(lq)) if starts_q[i] <= t)
                    key = (b, h, (t - starts_q[b]) // 128)
                    seen.setdefault(key, []).append(t - starts_q[b])
                nan = int((~torch.isfinite(out.float())).any(-1).sum())
                print(f"{name} run {r}: {int(bad.sum())} (row, head) over the tolerance, "
                      f"{int(diff0.sum())} differ from run 0, {nan} with NaN; (seq, head, block): "
                      + "; ".join(f"{key} rows {min(v)}-{max(v)} of {lq[key[0]]}"
                                  for key, v in list(seen.items())[:6]))
                explain_rows(out, ref, rows, heads, starts_q)
        print(f"{name} (causal={causal}): {bad_runs} of {args.runs} runs wrong or different")


if __name__ == "__main__":
    main()
