#!/usr/bin/env bash
# One pass on a GPU machine without network (the lent device or a runner): build in place,
# then the chosen steps, each logged to $LOG_DIR/<step>.log with a summary printed last.
#   KERNELS=ci,default ARCHS=90 STEPS="build test bench sanitize debug" ci/gpu_validate.sh
# Steps: build test sweep bench bench64 prog sanitize debug asv aa planted
#   asv      nox -s bench (needs nox and asv, e.g. from wheels; FA_COMMIT names the commit)
#   aa       A/A gate: the build against itself, AA_REPEAT comparisons (false positives, spread)
#   planted  A/B gate with a planted regression: the head dispatches non-swizzled kernels
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
LOG_DIR=${LOG_DIR:-gpu-logs}
KERNELS=${KERNELS:-ci,default}
ARCHS=${ARCHS:-90}
STEPS=${STEPS:-build test bench}
LOG_DIR=$(mkdir -p "$LOG_DIR" && cd "$LOG_DIR" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export FLASH_ATTENTION_TUNING_FILE=${FLASH_ATTENTION_TUNING_FILE:-/nonexistent}
summary=()
step() { [[ " $STEPS " == *" $1 "* ]]; }
run() {  # run NAME CMD...: log to $LOG_DIR/NAME.log, record status and time
    local name=$1
    shift
    local t0=$SECONDS
    echo "== $name: $*"
    "$@" >"$LOG_DIR/$name.log" 2>&1
    local rc=$?
    summary+=("$name: rc=$rc, $((SECONDS - t0)) s")
    tail -n 25 "$LOG_DIR/$name.log"
    return $rc
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv \
    >"$LOG_DIR/env.log" 2>&1
python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' >>"$LOG_DIR/env.log" 2>&1
cat "$LOG_DIR/env.log"

if step build; then
    run build env FLASH_ATTENTION_KERNELS="$KERNELS" FLASH_ATTENTION_ARCHS="$ARCHS" \
        MAX_JOBS="${MAX_JOBS:-16}" python3 setup.py build_ext --inplace \
        || { printf '%s\n' "${summary[@]}"; exit 2; }
    cp build/ptxas.log "$LOG_DIR/ptxas.log" 2>/dev/null
fi
if step test; then
    run test env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q -p no:cacheprovider tests
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
            res[f"{dtype}/d{d}/{s}"] = [(c.short, ms, attention_flops(b, 16, s, s, d) / ms / 1e9)
                                        for c, ms in ranked]
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
    run sanitize python3 -m fa_tools sanitize ci default
fi
if step debug; then
    for k in $(python3 -c 'import flash_attention as fa
from flash_attention.config_sets import SETS
print(" ".join(c.short for c in fa.available_configs() if c in SETS["default"]))'); do
        run "debug-$k" python3 -m fa_tools debug "$k"
    done
fi
if step asv; then
    run asv python3 -m nox --no-venv -s bench
fi
if step aa; then
    run aa python3 -m fa_tools gate perf --aa --repeat "${AA_REPEAT:-3}" --out "$LOG_DIR/aa"
fi
if step planted; then
    # base: this tree as built; head: a copy whose dispatch table drops swizzling (a real,
    # large slowdown of the generated code) for the long-sequence kernels.
    rm -rf /tmp/fa-head && cp -r . /tmp/fa-head
    sed -i "s/{'fseqkvbor' if d == 128 else 'fsekvbor'}/{'feqkvbor' if d == 128 else 'fekvbor'}/" \
        /tmp/fa-head/src/flash_attention/dispatch.py
    grep -n "feqkvbor" /tmp/fa-head/src/flash_attention/dispatch.py || exit 3
    run planted-build env FLASH_ATTENTION_KERNELS="$KERNELS,default" \
        FLASH_ATTENTION_ARCHS="$ARCHS" MAX_JOBS="${MAX_JOBS:-16}" \
        bash -c 'cd /tmp/fa-head && python3 setup.py build_ext --inplace'
    run planted bash -c "cd /tmp/fa-head && PYTHONPATH=/tmp/fa-head/src python3 -m fa_tools \
        gate perf --base-dir '$PWD' --out '$LOG_DIR/planted'"
fi
echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$LOG_DIR/summary.log"
