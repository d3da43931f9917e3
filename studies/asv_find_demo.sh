#!/usr/bin/env bash
# asv's bisection finds a planted kernel slowdown in a synthetic history (GPU machine).
#
#   WHEELHOUSE=/path/to/wheels studies/asv_find_demo.sh        # exit 0: asv named the planted commit
#
# Makes a throwaway clone of this repository's HEAD in $WORK, commits a history of
# $N_COMMITS commits on top of it in which only commit $PLANT_AT changes code: it points the
# dispatch table's bf16 d_head 128 entry at the same tile without the shared-memory swizzle
# (a real kernel slowdown: bank-conflicted ldmatrix), every other commit edits a doc. Then
# `asv find BASE..LAST bench_attention.Attention.track_ours_ms` bisects it, asv building each
# commit it visits itself (asv.conf.json). The build is restricted to the two kernels that
# bf16 d_head 128 dispatches to before and after the plant, for sm_90 (FLASH_ATTENTION_KERNELS,
# FLASH_ATTENTION_ARCHS); the object cache (FA_BUILD_CACHE) makes every build after the first
# one link cached objects only, since no commit changes C++.
#
# Offline: asv, virtualenv and the packages asv installs into its environment (wheel, ninja,
# build, asv_runner, pympler) come from $WHEELHOUSE (pip --no-index); without a wheelhouse pip
# uses its index. torch is the one of $PYTHON (default python3), never installed.
# Logs: $OUT (default /tmp/asv-demo): demo.log, asv-find.log, history.txt, measured.txt,
# cache-stats.log. The clone and asv's environment: $WORK (default /tmp/asv-demo-work).
# Exit: 0 asv named the planted commit, 1 it named another one, 2 the demo could not run.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/asv-demo}
WORK=${WORK:-/tmp/asv-demo-work}
PYTHON=${PYTHON:-python3}
WHEELHOUSE=${WHEELHOUSE:-${FA_WHEELHOUSE:-$REPO/wheelhouse}}
BENCH=${BENCH:-bench_attention.Attention.track_ours_ms}
N_COMMITS=${N_COMMITS:-9}
PLANT_AT=${PLANT_AT:-6}
ORIG=fwd_sm80_bf16_d128_r128_c64_w4_fseqkvbor  # what dispatch runs for bf16 d_head 128, seq > 64
SLOW=fwd_sm80_bf16_d128_r128_c64_w4_feqkvbor   # the same tile without the smem swizzle ('s' flag)
export FA_BUILD_CACHE=${FA_BUILD_CACHE:-$HOME/.cache/fa-build}
export FLASH_ATTENTION_KERNELS=$ORIG,$SLOW FLASH_ATTENTION_ARCHS=${ARCHS:-90}
export MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
export FLASH_ATTENTION_TUNING_FILE=/nonexistent  # dispatch by the table only

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/demo.log") 2>&1
start=$SECONDS
say() { echo "== [$((SECONDS - start)) s] $*"; }
die() { echo "asv-find-demo: $*" >&2; exit 2; }
if (( PLANT_AT < 2 || PLANT_AT > N_COMMITS || N_COMMITS < 8 )); then
    die "need N_COMMITS >= 8 and 2 <= PLANT_AT <= N_COMMITS (a good commit must come first)"
fi

say "tools"
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
    || die "$PYTHON has no torch: set PYTHON to the interpreter with the CUDA torch"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader \
    || echo "no nvidia-smi: timings will be skipped and asv cannot find anything"
if [ -d "$WHEELHOUSE" ]; then
    export PIP_FIND_LINKS=$WHEELHOUSE PIP_NO_INDEX=1
    missing=()
    for pkg in asv virtualenv wheel ninja build asv_runner pympler; do
        find "$WHEELHOUSE" -maxdepth 1 -iname "${pkg}-*.whl" | grep -q . || missing+=("$pkg")
    done
    if (( ${#missing[@]} )); then
        die "no wheel of ${missing[*]} in $WHEELHOUSE (pip download them there)"
    fi
    echo "pip: offline, from $WHEELHOUSE"
fi
if ! "$PYTHON" -c 'import asv, virtualenv' 2>/dev/null; then
    "$PYTHON" -m pip install -q asv==0.6.6 virtualenv || die "cannot install asv"
fi
"$PYTHON" -m asv --version

say "throwaway clone of $(git -C "$REPO" rev-parse --short HEAD) in $WORK"
rm -rf "$WORK"
git clone -q "$REPO" "$WORK"
cd "$WORK"
git config user.name "asv find demo"
git config user.email "asv-find-demo@example.invalid"
if [ -n "$(git -C "$REPO" status --porcelain)" ]; then
    # The working tree is not HEAD (uncommitted work, or a copied tree whose .git lags): the
    # history starts from a commit of the working tree as it is.
    git rm -rq --cached .
    find . -mindepth 1 -maxdepth 1 ! -name .git -exec rm -rf {} +
    "$PYTHON" - "$REPO" <<'EOF'
import os, shutil, subprocess, sys
repo = sys.argv[1]
names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo,
                       capture_output=True, check=True).stdout.decode().split("\0")
for name in filter(None, names):
    src = os.path.join(repo, name)
    if os.path.lexists(src) and not os.path.isdir(src):
        os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
        shutil.copy2(src, name, follow_symlinks=False)
EOF
    git add -A
    git commit -qm "Working tree of $REPO"
    echo "the working tree differs from HEAD: committed it as $(git rev-parse --short HEAD)"
fi
grep -q '"environment_type": "virtualenv"' asv.conf.json \
    || die "asv.conf.json does not build commits (environment_type virtualenv needed)"
base=$(git rev-parse HEAD)

say "history: $N_COMMITS commits, the slowdown planted in commit $PLANT_AT"
for ((i = 1; i <= N_COMMITS; i++)); do
    if (( i == PLANT_AT )); then
        cat >>src/flash_attention/kernels/fwd_sm80.py <<EOF

# (asv find demo) d_head 128 runs the tile without the shared-memory swizzle
ROWS = tuple(Row(r.key, r.calls, r.d_heads, r.max_seq, "${SLOW#fwd_sm80_bf16_d128_}", r.why)
             if r.key == "sm80 d128" else r for r in ROWS)
EOF
        git commit -q -am "Dispatch: bf16 d_head 128 without the smem swizzle"
        planted=$(git rev-parse HEAD)
    else
        printf 'Demo note %d: a harmless documentation change.\n' "$i" >>docs/asv-demo-notes.md
        git add docs/asv-demo-notes.md
        git commit -q -m "Docs: demo note $i"
    fi
done
last=$(git rev-parse HEAD)
git log --format='%H %s' "$base..$last" >"$OUT/history.txt"
git log --format='%h %s' "$base..$last"
echo "planted: $planted"

# The plant must change what dispatch runs, and only from its commit on.
check_dispatch() {  # check_dispatch COMMIT EXPECTED
    local got
    git checkout -q "$1"
    got=$(PYTHONPATH=src "$PYTHON" -c 'import sys
from flash_attention import dispatch, parse
built = [parse(s) for s in sys.argv[1:]]
print(dispatch.select("bf16", 128, 4096, built).name)' "$ORIG" "$SLOW")
    git checkout -q "$last"
    echo "  at $(git rev-parse --short "$1"): dispatch(bf16, d_head 128, seq 4096) -> $got"
    [ "$got" = "$2" ]
}
check_dispatch "$planted~1" "$ORIG" || die "before the plant dispatch does not run $ORIG"
check_dispatch "$planted" "$SLOW" || die "the plant does not make dispatch run $SLOW"

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || true)
machine=asv-demo-$(echo "${gpu:-cpu}" | tr ' ' '-' | tr '[:upper:]' '[:lower:]')
stats_before=0
if [ -f "$FA_BUILD_CACHE/stats.log" ]; then
    stats_before=$(wc -l <"$FA_BUILD_CACHE/stats.log")
fi
say "asv find $base..$last $BENCH (machine $machine; kernels $FLASH_ATTENTION_KERNELS," \
    "sm_$FLASH_ATTENTION_ARCHS; object cache $FA_BUILD_CACHE)"
"$PYTHON" -m asv machine --yes --machine "$machine" >/dev/null
set +e
"$PYTHON" -m asv find --machine "$machine" --show-stderr "$base..$last" "$BENCH" \
    2>&1 | tee "$OUT/asv-find.log"
rc=${PIPESTATUS[0]}
set -e
say "asv find exited $rc"
if [ -f "$FA_BUILD_CACHE/stats.log" ]; then
    tail -n +"$((stats_before + 1))" "$FA_BUILD_CACHE/stats.log" >"$OUT/cache-stats.log"
    echo "object cache during the demo: $(grep -c ' hit ' "$OUT/cache-stats.log") hits," \
        "$(grep -c ' miss ' "$OUT/cache-stats.log") compiled (per translation unit)"
fi
found=$(grep -oE 'Greatest regression found: [0-9a-f]+' "$OUT/asv-find.log" | awk '{print $NF}' \
    | tail -n1 || true)
if (( rc != 0 )) || [ -z "$found" ]; then
    die "asv find did not name a commit (exit $rc; see $OUT/asv-find.log)"
fi
# What asv measured at the commits it visited (bf16 d_head 128 cases of the benchmark). asv
# stores skipped benchmarks as NaN and bisects them anyway: without timings nothing is judged.
"$PYTHON" - "$BENCH" "$OUT/history.txt" benchmarks/results/"$machine" <<'EOF' \
    | tee "$OUT/measured.txt" || die "asv recorded no timings (no GPU?): nothing to judge"
import ast, glob, itertools, json, math, sys
bench, history, results = sys.argv[1], sys.argv[2], sys.argv[3]
subjects = dict(line.rstrip("\n").split(" ", 1) for line in open(history))
order = list(subjects)
rows, finite = [], 0


def ok(v):
    return v is not None and not math.isnan(v)


for path in glob.glob(f"{results}/*.json"):
    data = json.load(open(path))
    if "commit_hash" not in data or bench not in data["results"]:
        continue
    entry = dict(zip(data["result_columns"], data["results"][bench]))
    params = [[ast.literal_eval(p) for p in axis] for axis in entry["params"]]
    values = dict(zip(itertools.product(*params), entry["result"] or []))
    cells = [values.get(("bf16", 128, shape)) for shape in params[2]]
    finite += sum(ok(v) for v in cells)
    sha = data["commit_hash"]
    rows.append((order.index(sha) if sha in order else -1, sha, cells))
print("commit   " + " ".join(f"{s:>9}" for s in params[2]) + "   (bf16 d_head 128, ms)")
for _, sha, cells in sorted(rows, reverse=True):  # oldest first
    print(f"{sha[:8]} " + " ".join(f"{v:9.3f}" if ok(v) else f"{'-':>9}" for v in cells)
          + f"   {subjects.get(sha, '')}")
sys.exit(0 if finite else 1)
EOF
echo "asv find names:  $(git log -1 --format='%h %s' "$found")"
echo "planted commit:  $(git log -1 --format='%h %s' "$planted")"
if [[ $planted == "$found"* ]]; then
    say "PASS: asv find named the planted commit"
    exit 0
fi
say "FAIL: asv find named another commit"
exit 1
