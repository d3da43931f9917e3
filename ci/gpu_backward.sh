#!/usr/bin/env bash
# Build the backward kernels with the forward kernels its tests need, then run the backward GPU
# tests (and, with BENCH=1, the backward timing against SDPA; with LLAMA=1, the Hugging Face
# Llama training client against SDPA, which needs transformers: ci/llama_train_client.py).
# Logs go to $OUT (or ./out). BWD is a selection of backward kernels as FLASH_ATTENTION_KERNELS
# takes it (bwd:default, bwd_sm90:r64, kernel names, comma-separated).
#   BWD=bwd:default FWD_D="32 64 96 128 160 192 224 256" ci/gpu_backward.sh [pytest args...]
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
fwd_d=${FWD_D:-32 64 96 128 160 192 224 256}
fwd=$(python3 - "$fwd_d" <<'PY'
import sys
sys.path.insert(0, "src")
from flash_attention.kernels import fwd_sm80
# The sm80 family's long-sequence kernel of each d_head, masked and masked + softcap: every call
# of the backward tests has a forward to run on.
long = {d: row.kernel for row in fwd_sm80.ROWS if row.max_seq is None for d in row.d_heads}
names = [f"{fwd_sm80.KIND}_{dt}_d{d}_{long[d]}{f}" for dt in ("fp16", "bf16")
         for d in map(int, sys.argv[1].split()) for f in ("m", "mt")]
print(",".join(names))
PY
)
start=$(date +%s)
FLASH_ATTENTION_KERNELS="$fwd,${BWD:-bwd:default}" \
    FLASH_ATTENTION_ARCHS="${ARCHS:-90}" MAX_JOBS="${MAX_JOBS:-16}" \
    python3 setup.py build_ext --inplace >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
cp build/ptxas.log "$out/ptxas.log" 2>/dev/null
PYTHONPATH=src python3 -m fa_tools resources --kernel 'bwd_*' | head -40
rc=0
if [ "${TESTS:-1}" = 1 ]; then
    PYTHONPATH=src FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q -p no:cacheprovider \
        tests/test_gpu_backward.py "$@" >"$out/pytest.log" 2>&1
    rc=$?
    grep -E "passed|failed|error" "$out/pytest.log" | tail -3
    grep -E "^(FAILED|ERROR)" "$out/pytest.log" | head -30
fi
if [ "${SANITIZE:-0}" = 1 ]; then
    for tool in memcheck racecheck synccheck; do
        PYTHONPATH=src compute-sanitizer --tool "$tool" python3 ci/backward_sanitize.py \
            >"$out/sanitize-$tool.log" 2>&1
        echo "compute-sanitizer $tool: exit $? ($(grep -c "ERROR SUMMARY: 0 errors\|RACECHECK SUMMARY: 0 hazards" "$out/sanitize-$tool.log") clean summaries)"
        grep -E "SUMMARY" "$out/sanitize-$tool.log" | head -3
    done
fi
if [ "${BENCH:-0}" = 1 ]; then
    PYTHONPATH=src python3 studies/backward_bench.py 2>&1 | tee "$out/bench.log"
fi
if [ "${LLAMA:-0}" = 1 ]; then
    python3 ci/llama_train_client.py --json "$out/llama.json" 2>&1 | tee "$out/llama.log"
    llama_rc=${PIPESTATUS[0]}
    echo "llama client: exit $llama_rc"
    [ "$llama_rc" = 0 ] || rc=$llama_rc
fi
exit "$rc"
