"""A measuring process bound to one build (the flash_attention found first on its path). It
reports which build it imported, then answers one JSON request per line on stdin with one JSON
reply per line on stdout, so the A/B gate pays the torch import once per side and alternates
rounds between two live workers. Each request gets new inputs at a new place in device memory
(see fresh_inputs).

    hello:    {"ok": true, "module": ..., "configs": [forward kernel names],
               "bwd_configs": [backward kernel names; none in a build from before them],
               "gpu": ..., "energy": gpu.energy.Granularity as a dict (the counter polled for
               200 ms)}
    request:  {"case": Case dict, "reps": 10, "slowdown": 0.0, "warm_ms": 100.0}
    reply:    {"ok": true, "results": {contender: median ms, ...}}  or  {"ok": false, ...}

With warm_ms > 0 the results also hold "<contender>_mcycles" and "<contender>_mhz", and
"<contender>_mj" (millijoules per call) where the GPU's energy counter could be read; a
contender the case has no use for (SDPA under a window or a softcap) is absent.

"slowdown" > 0 plants a known slowdown of attention() for the gate's power study (calibrate);
only that command sends it. "warm_ms" > 0: each contender's timed calls follow that long of its
own calls back to back (steady-state timing, perfcases.measure_case); 0: a burst after a sleep.
"""

from __future__ import annotations

import json
import random
import sys
import traceback


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything printed by libraries must not corrupt the protocol
    try:
        import torch

        import flash_attention as fa

        from ..gpu.perfcases import Case, measure_case

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU")
        from ..gpu.clockstamp import Stamps

        Stamps()  # the cycle measure loads here, so a failure of it is the worker's, not a case's
        from ..gpu import energy

        counter, why = energy.open_counter()  # None (with why) where NVML cannot be read
        hello = {"ok": True, "module": fa.__file__,
                 # .short: a build from before the one name scheme
                 "configs": [getattr(c, "name", None) or c.short
                             for c in fa.available_configs()],
                 "bwd_configs": backward_configs(),  # the extension is loaded by now
                 "gpu": torch.cuda.get_device_name(),
                 "energy": energy.granularity(counter, why).as_dict()}
    except Exception as exc:  # report, do not die silently
        out.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 3
    out.write(json.dumps(hello) + "\n")
    out.flush()
    placement = random.Random()
    last_ms: dict[Case, dict] = {}  # per case: each contender's last median, the warm-up's guide
    inputs = _pad = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            case = Case(**req["case"])
            inputs = _pad = None  # the last request's are freed first
            inputs, _pad = fresh_inputs(case, placement)  # _pad: kept with the inputs
            inputs.last_ms = last_ms.setdefault(case, {})
            results = measure_case(case, inputs, reps=req.get("reps", 10), warmup=1,
                                   slowdown=req.get("slowdown", 0.0),
                                   warm_ms=req.get("warm_ms", 0.0), energy=counter)
            reply = {"ok": True, "results": results}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "trace": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


def backward_configs() -> list[str]:
    """The backward kernels of the imported build (names), as its operator lists them;
    none for a build from before the backward."""
    import torch

    try:
        names = torch.ops.flash_attention.bwd_kernels()
    except (AttributeError, RuntimeError):  # no such operator in this build
        return []
    return [n for n in names.split(",") if n]


def fresh_inputs(case, placement: random.Random) -> tuple:
    """New random inputs for one request, placed anew: the cached blocks go back to the driver
    and a pad of random size (0.06-32 MB, freed with the inputs) is allocated first. Some
    cases' SM cycles depend on where their tensors lie in memory by several percent (H100, bf16
    d_head 192 window 1024 on 8 x 4096: a spread of 4% over placements); inputs made once per
    worker put that whole difference between the two workers into every round (unchanged
    trees: head/base 0.918-0.939, "faster", in 5 runs of 5, whichever worker started first),
    where new placements per request make it noise that the sequential test sees (A/A: 0.983
    [0.953, 1.014], "same"; docs/results/2026-11-25-h100-gpu-job-after-house.md)."""
    import torch

    from ..gpu.perfcases import Inputs

    torch.cuda.empty_cache()
    pad = torch.empty(placement.randrange(1, 512) * 65536, dtype=torch.uint8, device="cuda")
    return Inputs.make(case), pad  # the caller keeps the pad as long as the inputs


if __name__ == "__main__":
    raise SystemExit(main())
