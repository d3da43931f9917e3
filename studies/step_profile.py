"""Where a training step's GPU time goes, ours against SDPA cuDNN: one forward + backward
through autograd (bf16, 16 heads), its kernels summed per name over 5 steps under
torch.profiler after 30 warm steps, and the wall time of 20 steps queued back to back (CUDA
events). The kernel sum separates the kernels (main, preprocess, dQ conversion, forward) from
what the host adds between them.

    PYTHONPATH=src python3 studies/step_profile.py [--shape 16,4096,16] [--d 64,128] [--top 6]

Run it on a build with the default forward set (`ci/gpu_validate.sh` step `build`, or `nox -s
build`): `ci/gpu_backward.sh` builds the sm80-family forward alone, which a step then runs.
"""

from __future__ import annotations

import argparse

import torch
from backward_bench import train_step_fns
from torch.profiler import ProfilerActivity, profile

from flash_attention import ops


def kernel_ms(fn, steps: int = 5) -> dict[str, float]:
    """Milliseconds per step of each CUDA kernel (by name) over `steps` profiled steps."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] = total.get(e.name, 0.0) + e.device_time / 1000 / steps
    return total


def wall_ms(fn, steps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="16,4096,16", help="batch,seq,heads")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--top", type=int, default=6, help="kernels listed per contender")
    args = ap.parse_args()
    ops.require()
    batch, seq, heads = map(int, args.shape.split(","))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, batch {batch}, "
          f"seq {seq}, {heads} heads; ms per training step")
    for d in map(int, args.d.split(",")):
        for causal in (False, True):
            steps = train_step_fns(batch, seq, heads, d, causal)
            for name in ("ours", "cudnn"):
                fn = steps[name]
                for _ in range(30):
                    fn()
                torch.cuda.synchronize()
                kernels = kernel_ms(fn)
                print(f"== d_head {d}, causal {causal}, {name}: kernels "
                      f"{sum(kernels.values()):.3f} ms, wall {wall_ms(fn):.3f} ms")
                for kname, ms in sorted(kernels.items(), key=lambda x: -x[1])[:args.top]:
                    print(f"   {ms:8.3f}  {kname[:110]}")


if __name__ == "__main__":
    main()
