#!/usr/bin/env bash
# A refactoring checked on a GPU against the tree it refactors: this tree (ci,default, sm_90)
# built beside a base tree unpacked from $BASE_TAR (git archive of the base commit: src,
# setup.py, pyproject.toml, studies) with $BASE_KERNELS / $BASE_BWD_KERNELS (the base's own
# selection variables), then this tree's GPU tests (the gate's grid), a memcheck of the
# backward, and the backward's time in both trees, base-head-base, each process timing SDPA FA2
# and cuDNN beside ours (studies/backward_bench.py of each tree; $BASE_VARIANT and
# $HEAD_VARIANT: one sm80-family kernel by name, as each tree names it). Logs under
# ${OUT:-gpu-logs}/logs; a summary last. SIDES ("base1 head base2"), TEST_LIMIT_S, SANITIZE_LIMIT_S
# and BENCH_LIMIT_S fit it to a call's time.
#   BASE_TAR=.carry/base.tar BASE_KERNELS=... BASE_BWD_KERNELS=default \
#     BASE_VARIANT=... HEAD_VARIANT=... studies/tree_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
L=${OUT:-gpu-logs}/logs
mkdir -p "$L" /tmp/base
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_TUNING_FILE=/nonexistent
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv >"$L/env.txt"
tar -xf "${BASE_TAR:?a git archive of the base tree}" -C /tmp/base
t0=$SECONDS
(cd /tmp/base && FLASH_ATTENTION_KERNELS=${BASE_KERNELS:?} \
    FLASH_ATTENTION_BWD_KERNELS=${BASE_BWD_KERNELS:-default} FLASH_ATTENTION_ARCHS=90 \
    MAX_JOBS=6 python3 setup.py -q build_ext --inplace >"$L/build-base.log" 2>&1
    echo "base build rc=$?" >>"$L/summary.txt") &
FLASH_ATTENTION_KERNELS=ci,default FLASH_ATTENTION_ARCHS=90 MAX_JOBS=10 \
    python3 setup.py -q build_ext --inplace >"$L/build.log" 2>&1
echo "head build rc=$? $((SECONDS - t0)) s" >>"$L/summary.txt"
wait
echo "builds done $((SECONDS - t0)) s" >>"$L/summary.txt"
export PYTHONPATH=$PWD/src
FLASH_ATTENTION_REQUIRE_EXT=1 FA_TEST_GRID=gate timeout "${TEST_LIMIT_S:-330}" \
    python3 -m pytest -q -p no:cacheprovider -m gpu tests >"$L/tests.log" 2>&1
echo "gpu tests rc=$? $(tail -n 1 "$L/tests.log")" >>"$L/summary.txt"
timeout "${SANITIZE_LIMIT_S:-150}" compute-sanitizer --tool memcheck \
    python3 ci/backward_sanitize.py >"$L/memcheck.log" 2>&1
echo "memcheck rc=$? $(tail -n 1 "$L/memcheck.log")" >>"$L/summary.txt"
bench=(--d "64,128" --seqs 4096 --dtypes bf16 --peers "fa2,cudnn" --no-train --no-det)
for side in ${SIDES:-base1 head base2}; do
    if [ "$side" = head ]; then
        timeout "${BENCH_LIMIT_S:-90}" python3 studies/backward_bench.py "${bench[@]}" \
            --variants "${HEAD_VARIANT:?}" >"$L/bench-$side.log" 2>&1
    else
        (cd /tmp/base && PYTHONPATH=/tmp/base/src timeout "${BENCH_LIMIT_S:-90}" \
            python3 studies/backward_bench.py "${bench[@]}" --variants "${BASE_VARIANT:?}" \
            >"$L/bench-$side.log" 2>&1)
    fi
done
echo "total $((SECONDS - t0)) s" >>"$L/summary.txt"
for side in ${SIDES:-base1 head base2}; do
    echo "== bench $side"
    tail -n 14 "$L/bench-$side.log"
done
cat "$L/summary.txt"
