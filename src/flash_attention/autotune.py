"""Autotuning: time every built config of a dtype and d_head on representative shapes and write
the fastest per sequence bucket to the tuning file that dispatch reads.

    python -m flash_attention.autotune --dtypes bf16,fp16 --d-heads 128 --seqlens 512,4096
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from . import dispatch
from .api import attention, available_configs
from .kernels import KernelConfig
from .timing import attention_flops, median_ms

log = logging.getLogger(__name__)
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def batch_for(seqlen: int, tokens: int = 65536) -> int:
    """Batch that keeps batch * seqlen about constant (16 at 4096)."""
    return max(1, tokens // seqlen)


def time_configs(dtype: str, d_head: int, seqlen: int, heads: int = 16,
                 configs: list[KernelConfig] | None = None, reps: int = 20
                 ) -> list[tuple[KernelConfig, float]]:
    """(config, median ms) for every built config of this dtype and d_head, fastest first."""
    configs = [c for c in (configs or available_configs())
               if c.dtype == dtype and c.d_head == d_head]
    batch = batch_for(seqlen)
    shape = (batch, seqlen, heads, d_head)
    q, k, v = (torch.randn(shape, device="cuda", dtype=TORCH_DTYPES[dtype]) for _ in range(3))
    out = torch.empty_like(q)
    results = []
    for cfg in configs:
        ms = median_ms(lambda cfg=cfg: attention(q, k, v, out=out, config=cfg), reps=reps)
        results.append((cfg, ms))
        log.info("%s seq=%d: %.3f ms, %.1f TFLOP/s", cfg, seqlen, ms,
                 attention_flops(batch, heads, seqlen, seqlen, d_head) / ms / 1e9)
    return sorted(results, key=lambda r: r[1])


def tune(dtypes: list[str], d_heads: list[int], seqlens: list[int], path: Path) -> dict:
    entries: dict[str, str] = {}
    for dtype in dtypes:
        for d_head in d_heads:
            for seqlen in seqlens:
                ranked = time_configs(dtype, d_head, seqlen)
                if ranked:
                    entries[dispatch.tuning_key(dtype, d_head, seqlen)] = ranked[0][0].name
    data = {"version": 1, "device": torch.cuda.get_device_name(), "entries": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    dispatch.reload_tuning()
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bf16,fp16")
    parser.add_argument("--d-heads", default="64,128")
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--out", type=Path, default=dispatch.tuning_file_path())
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if not torch.cuda.is_available():
        print("autotune needs a CUDA GPU", file=sys.stderr)
        return 3
    data = tune(args.dtypes.split(","), [int(d) for d in args.d_heads.split(",")],
                [int(s) for s in args.seqlens.split(",")], args.out)
    print(json.dumps(data, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
