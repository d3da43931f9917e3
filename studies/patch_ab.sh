#!/usr/bin/env bash
# Kernel-source candidates as patches, on one GPU: a copy of this tree as it is (base) and one per
# patch in $PATCHES (git diffs against this tree, applied with git apply), each built with
# $AB_KERNELS alone (a few kernel names: minutes, all trees in parallel), then $AB_BENCH run in
# each tree in turn for $AB_ROUNDS rounds (base p1 p2 .. base p1 p2 ..), so that clock drift shows
# as the spread between rounds rather than as a difference between trees. The bench should time a
# peer beside the candidate (fp8_bench.py times our bf16 forward and SDPA cuDNN) so that rows
# compare as ratios. Logs: ${OUT:-gpu-logs}/logs/ab-<tree>-<round>.log, build-<tree>.log; each
# bench log's lines matching $AB_GREP printed last, tree by tree.
#   PATCHES="/tmp/p/lag2.patch /tmp/p/x.patch" AB_KERNELS=fwd_sm90_e4m3_d128_r128_c128_s3_fwpia \
#     AB_BENCH="python3 studies/fp8_bench.py --seqlens 4096,16384" AB_GREP="fp8 dispatched" \
#     studies/patch_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
L=${OUT:-gpu-logs}/logs
mkdir -p "$L"
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_TUNING_FILE=/nonexistent
trees=(base)
patches=("")
for p in ${PATCHES:-}; do
    trees+=("$(basename "$p" .patch)")
    patches+=("$(realpath "$p")")
done
t0=$SECONDS
root=/tmp/patch_ab
rm -rf "$root"
for i in "${!trees[@]}"; do
    dir="$root/${trees[$i]}"
    mkdir -p "$dir"
    tar -c --exclude=__pycache__ --exclude='*.so' --exclude=src/csrc/generated \
        src setup.py pyproject.toml studies | tar -x -C "$dir"
    if [ -n "${patches[$i]}" ]; then
        (cd "$dir" && git apply "${patches[$i]}") ||
            { echo "${patches[$i]} does not apply" | tee -a "$L/summary.txt"; exit 2; }
    fi
    (cd "$dir" && FLASH_ATTENTION_KERNELS=${AB_KERNELS:?kernel names to build} \
        FLASH_ATTENTION_ARCHS=${ARCHS:-90} MAX_JOBS=$(($(nproc) / ${#trees[@]} + 1)) \
        python3 setup.py -q build_ext --inplace >"$L/build-${trees[$i]}.log" 2>&1
        echo "build ${trees[$i]} rc=$? $((SECONDS - t0)) s" >>"$L/summary.txt") &
done
wait
for round in $(seq "${AB_ROUNDS:-2}"); do
    for tree in "${trees[@]}"; do
        (cd "$root/$tree" && PYTHONPATH=$root/$tree/src timeout "${AB_LIMIT_S:-120}" \
            bash -c "${AB_BENCH:?a bench command}" >"$L/ab-$tree-$round.log" 2>&1
            echo "bench $tree round $round rc=$? $((SECONDS - t0)) s" >>"$L/summary.txt")
    done
done
for tree in "${trees[@]}"; do
    echo "== $tree"
    for round in $(seq "${AB_ROUNDS:-2}"); do
        grep -E "${AB_GREP:-.}" "$L/ab-$tree-$round.log" | sed "s/^/r$round /"
    done
done
cat "$L/summary.txt"
