#!/usr/bin/env bash
# One pass on a GPU machine: build, GPU tests, a config sweep, the benchmark table against SDPA,
# and compute-sanitizer on small runs. Logs go to $LOG_DIR (default ./gpu-logs); a short summary
# is printed last.
#   KERNELS=ci,default,tune ARCHS=90 STEPS="build test sweep bench bench64 prog sanitize" \
#       ci/gpu_validate.sh
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-gpu-logs}
KERNELS=${KERNELS:-ci,default}
ARCHS=${ARCHS:-90}
STEPS=${STEPS:-build test bench}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_TUNING_FILE=${FLASH_ATTENTION_TUNING_FILE:-/nonexistent}
summary=()
step() { [[ " $STEPS " == *" $1 "* ]]; }
run() {  # run NAME CMD...: log to $LOG_DIR/NAME.log, record status and time
    local name=$1; shift
    local t0=$SECONDS
    echo "== $name: $*"
    "$@" >"$LOG_DIR/$name.log" 2>&1
    local rc=$?
    summary+=("$name: rc=$rc, $((SECONDS - t0)) s")
    tail -n 15 "$LOG_DIR/$name.log"
    return $rc
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv >"$LOG_DIR/env.log" 2>&1
python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' >>"$LOG_DIR/env.log" 2>&1
cat "$LOG_DIR/env.log"

if step build; then
    run build env FLASH_ATTENTION_KERNELS="$KERNELS" FLASH_ATTENTION_ARCHS="$ARCHS" \
        MAX_JOBS=${MAX_JOBS:-16} python3 -m pip install --no-build-isolation --no-deps -e . \
        || { printf '%s\n' "${summary[@]}"; exit 2; }
    cp build/ptxas.log "$LOG_DIR/ptxas.log" 2>/dev/null
fi
if step test; then
    run test env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q -x -p no:cacheprovider tests
fi
if step sweep; then
    run sweep python3 -c '
import json, sys
from flash_attention.autotune import time_configs
from flash_attention.timing import attention_flops
res = {}
for dtype in ("bf16", "fp16"):
    for d, seqs in ((128, (512, 4096)), (64, (4096,))):
        for s in seqs:
            ranked = time_configs(dtype, d, s, reps=10)
            b = max(1, 65536 // s)
            res[f"{dtype}/d{d}/{s}"] = [(c.short, ms, attention_flops(b, 16, s, s, d) / ms / 1e9) for c, ms in ranked]
            print(f"{dtype} d{d} seq {s}:")
            for c, ms, tf in res[f"{dtype}/d{d}/{s}"][:8]:
                print(f"  {c:34s} {ms:8.3f} ms {tf:6.1f} TFLOP/s")
json.dump(res, open(sys.argv[1], "w"), indent=1)
' "$LOG_DIR/sweep.json"
fi
if step bench; then
    run bench python3 -m fa_tools bench --json "$LOG_DIR/bench.json" --md "$LOG_DIR/bench.md"
fi
if step bench64; then
    run bench64 python3 -m fa_tools bench --d-heads 64 --json "$LOG_DIR/bench64.json" \
        --md "$LOG_DIR/bench64.md"
fi
if step prog; then
    run prog python3 -m fa_tools bench --dtypes bf16 --shapes 16x4096 --configs prog \
        --json "$LOG_DIR/prog.json" --md "$LOG_DIR/prog.md"
fi
if step sanitize; then
    for tool in memcheck racecheck synccheck; do
        run "sanitize-$tool" timeout 200 compute-sanitizer --tool "$tool" --error-exitcode 1 python3 -c '
import torch, flash_attention as fa
from flash_attention.config_sets import SETS
for cfg in fa.available_configs():
    if cfg not in SETS["default"] and cfg not in SETS["ci"]:
        continue
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[cfg.dtype]
    q = torch.randn(1, 131, 2, cfg.d_head, device="cuda", dtype=dt)
    k = torch.randn(1, 77, 2, cfg.d_head, device="cuda", dtype=dt)
    fa.attention(q, k, k, config=cfg, return_lse=True)
torch.cuda.synchronize()
print("ok")
'
    done
fi
echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$LOG_DIR/summary.log"
