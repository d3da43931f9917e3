"""A measuring process bound to one build (the flash_attention found first on its path). It
reports which build it imported, then answers one JSON request per line on stdin with one JSON
reply per line on stdout, so the A/B gate pays the torch import once per side and alternates
rounds between two live workers.

    request:  {"cases": [Case dicts], "reps": 10}
    reply:    {"ok": true, "results": {case name: {contender: ms}}}  or  {"ok": false, "error": ...}
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

        from .perfcases import Case, measure

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU")
        hello = {"ok": True, "module": fa.__file__,
                 "configs": [c.short for c in fa.available_configs()],
                 "gpu": torch.cuda.get_device_name()}
    except Exception as exc:  # report, do not die silently
        out.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 3
    out.write(json.dumps(hello) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            cases = [Case(**c) for c in req["cases"]]
            results = measure(cases, tuple(req.get("contenders", ("ours", "sdpa_fa2"))),
                              reps=req.get("reps", 10))
            reply = {"ok": True, "results": results}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                     "trace": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
