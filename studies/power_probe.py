"""Clock and power beside per-call time (GPU machine): each contender runs back to back for a
few seconds while nvidia-smi samples the SM clock, power and temperature every 50 ms; phases
alternate ours / cuDNN twice. Shows whether a contender's time follows the clock (power limit)
rather than its own work.   python3 studies/power_probe.py [dtype d_head batch seqlen heads]"""

import statistics as st
import subprocess
import sys
import time

import torch

from fa_tools.gpu.perfcases import contenders as make_contenders

dtype, d, b, s, h = (sys.argv[1:6] + ["bf16", "128", "16", "4096", "16"][len(sys.argv[1:6]):])
dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
q, k, v = (torch.randn(int(b), int(s), int(h), int(d), device="cuda", dtype=dt) for _ in range(3))
fns = make_contenders(q, k, v, torch.empty_like(q), names=("ours", "sdpa_cudnn"))
contenders = {"ours": fns["ours"], "cudnn": fns["sdpa_cudnn"]}
for fn in contenders.values():
    fn()
torch.cuda.synchronize()


def phase(name, fn, seconds=3.0):
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    times = []
    t_end = time.time() + seconds
    while time.time() < t_end:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(20)]
        for a, z in ev:
            a.record()
            fn()
            z.record()
        torch.cuda.synchronize()
        times += [a.elapsed_time(z) for a, z in ev]
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    clk = [float(r[0]) for r in rows[2:]]
    pw = [float(r[1]) for r in rows[2:]]
    tmp = [float(r[2]) for r in rows[2:]]
    q10, q50, q90 = (sorted(times)[int(len(times) * f)] for f in (0.1, 0.5, 0.9))
    print(f"{name:6s} calls {len(times):4d}  ms p10 {q10:.3f} p50 {q50:.3f} p90 {q90:.3f}  "
          f"SM MHz {min(clk):.0f}/{st.median(clk):.0f}/{max(clk):.0f}  W {st.median(pw):.0f} "
          f"(max {max(pw):.0f})  C {max(tmp):.0f}", flush=True)


for name in ("ours", "cudnn", "ours", "cudnn"):
    phase(name, contenders[name])
    time.sleep(1.0)
