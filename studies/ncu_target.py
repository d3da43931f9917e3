"""A target for Nsight Compute (ci/gpu_validate.sh steps profile, profile-bwd): runs one attention
call (or, with --backward, its backward) a few times on random inputs, so that ncu can profile
the last launch of the kernel it matches.
    python3 studies/ncu_target.py ours|cudnn|fa2 [dtype d_head batch seqlen heads [causal]]
        [--config NAME] [--window LEFT,RIGHT]    (ours only: a built kernel, a sliding window)
        [--backward]                             (the backward of one forward, through autograd;
                                                  with --config bwd_...: that backward kernel
                                                  (bwd_sm80_... or bwd_sm90_...) by name, on the
                                                  forward's out and LSE)
    dtype e4m3: the FP8 forward (flash_attention.fp8) on the bf16 inputs quantised per head."""

import argparse

import torch

import flash_attention as fa
from fa_tools.gpu.perfcases import contenders
from flash_attention import ops

ap = argparse.ArgumentParser()
ap.add_argument("who", choices=("ours", "cudnn", "fa2"))
ap.add_argument("shape", nargs="*")
ap.add_argument("--config")
ap.add_argument("--window")
ap.add_argument("--backward", action="store_true")
args = ap.parse_args()
dtype, d, b, s, h = (args.shape[:5] + ["bf16", "128", "16", "4096", "16"][len(args.shape[:5]):])
causal = len(args.shape) > 5 and args.shape[5] == "causal"
dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.bfloat16}[dtype]
q, k, v = (torch.randn(int(b), int(s), int(h), int(d), device="cuda", dtype=dt) for _ in range(3))
if dtype == "e4m3":
    from flash_attention import fp8

    if args.who != "ours" or args.backward or args.window:
        ap.error("e4m3 takes ours, without --backward or --window")
    (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q), fp8.quantize(k), fp8.quantize(v)

    def run():
        fp8.attention_fp8(q8, k8, v8, qd, kd, vd, causal=causal, config=args.config)
elif args.backward and args.config:
    # A backward kernel by name (e.g. the sm80 family's on an sm_90 GPU, where dispatch picks
    # the Hopper one), through the operator that autograd calls.
    if args.who != "ours" or args.window or not args.config.startswith("bwd_"):
        ap.error("--backward --config takes ours and a backward kernel's name (bwd_...)")
    ops.require()  # the extension loaded, its operators registered
    out, lse = torch.ops.flash_attention.attention.default(q, k, v, None, None, 0, 0, None, causal,
                                                           -1, -1, 0.0, True, "")
    dout = torch.randn_like(out)

    def run():
        torch.ops.flash_attention.bwd.default(dout, q, k, v, out, lse, None, None, None, 0, 0,
                                              None, causal, -1, -1, 0.0, False, args.config)
elif args.backward:
    if args.window:
        ap.error("--backward takes no --window")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if args.who == "ours":
        o = fa.attention(q, k, v, causal=causal)
    else:
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}
        with sdpa_kernel(backend[args.who]):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=causal).transpose(1, 2)
    dout = torch.randn_like(o)

    def run():
        torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)
elif args.window or args.config:
    if args.who != "ours":
        ap.error("--config and --window apply to ours only")
    opts = {"config": args.config} if args.config else {}
    if args.window:
        opts["window_size"] = tuple(int(x) for x in args.window.split(","))
    out = torch.empty_like(q)

    def run():
        fa.attention(q, k, v, out=out, causal=causal, **opts)
else:
    name = {"ours": "ours", "cudnn": "sdpa_cudnn", "fa2": "sdpa_fa2"}[args.who]
    run = contenders(q, k, v, torch.empty_like(q), names=(name,), causal=causal)[name]
for _ in range(4):
    run()
torch.cuda.synchronize()
print(args.who, "backward" if args.backward else "", dtype, d, b, s, h, "causal" if causal else "",
      args.config or "", args.window or "", "done")
