"""A measuring process bound to one build (the flash_attention found first on its path). It
reports which build it imported, then answers one JSON request per line on stdin with one JSON
reply per line on stdout, so the A/B gate pays the torch import once per side and alternates
rounds between two live workers. Inputs of each case are made once and kept.

    hello:    {"ok": true, "module": ..., "configs": [short forms], "gpu": ...,
               "energy": gpu.energy.Granularity as a dict (the counter polled for 200 ms)}
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
import sys
import traceback


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything printed by libraries must not corrupt the protocol
    try:
        import torch

        import flash_attention as fa

        from ..gpu.perfcases import Case, Inputs, measure_case

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU")
        from ..gpu.clockstamp import Stamps

        Stamps()  # the cycle measure loads here, so a failure of it is the worker's, not a case's
        from ..gpu import energy

        counter, why = energy.open_counter()  # None (with why) where NVML cannot be read
        hello = {"ok": True, "module": fa.__file__,
                 "configs": [c.short for c in fa.available_configs()],
                 "gpu": torch.cuda.get_device_name(),
                 "energy": energy.granularity(counter, why).as_dict()}
    except Exception as exc:  # report, do not die silently
        out.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 3
    out.write(json.dumps(hello) + "\n")
    out.flush()
    inputs: dict[Case, Inputs] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            case = Case(**req["case"])
            if case not in inputs:
                inputs[case] = Inputs.make(case)
            results = measure_case(case, inputs[case], reps=req.get("reps", 10), warmup=1,
                                   slowdown=req.get("slowdown", 0.0),
                                   warm_ms=req.get("warm_ms", 0.0), energy=counter)
            reply = {"ok": True, "results": results}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "trace": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
