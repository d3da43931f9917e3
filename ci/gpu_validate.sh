#!/usr/bin/env bash
# One pass on a GPU machine without network (the lent device or a runner): build in place,
# then the chosen steps, each logged to $LOG_DIR/<step>.log with a summary printed last.
#   KERNELS=ci,default ARCHS=90 STEPS="build test bench sanitize debug" ci/gpu_validate.sh
# Steps: build test fp8 fp8-cache hopper-varlen hopper-varlen-bench hopper-varlen-bwd cluster-probe decode short fuzz toolkit sweep bench bench64 features prog hopper hopper-tune ab window
#        sanitize debug asv calibrate hang profile profile-decode profile-bwd profile-bwd80 gate-aa bwd-planted
#        bwd90-planted dec-planted fp8-planted bwd-prog bwd80-table
#        workflow workflow-planted
#   toolkit   the binary-tool tests with the CUDA toolkit's own cuobjdump/nvdisasm
#   fp8       the FP8 forward (issue 46): tests, sanitizers, studies/fp8_bench.py (FP8_BENCH_ARGS),
#             the Llama FP8 logits check (ci/llama_fp8_logits.py)
#   fp8-cache the FP8 KV cache (issue 46): tests, sanitizers, decode steps with e4m3 and e5m2
#             caches beside the 16-bit one (studies/decode_bench.py --fp8, FP8_CACHE_BENCH_ARGS)
#   hopper-varlen  the Hopper varlen and softcap forwards (issue 45): tests and sanitizers;
#             hopper-varlen-bench: studies/hopper_varlen_bench.py (HV_BENCH_ARGS)
#   hopper-varlen-bwd  the Hopper varlen backward (bwd_sm90 flag j): its tests, the varlen
#             backward tests through dispatch, memcheck and racecheck, and the bench's
#             --backward rows (HV_BWD_BENCH_ARGS)
#   decode    the KV-cache tests, memcheck and racecheck of some, decode steps against SDPA
#             (studies/decode_bench.py with DECODE_BENCH_ARGS); on sm_90 the 8-warp deep
#             kernel's dispatch and sanitizers too (it is in dec_sm80's default set)
#   cluster-probe  thread block clusters on this GPU: occupancy at a decode CTA's shape, CTA
#             placement, launch and barrier costs (studies/cluster_probe.cu)
#   clients   the inference clients: ci/llama_generate_client.py (Hugging Face Llama generating
#             through flash_attn_with_kvcache against SDPA) and ci/serving_loop.py (a page pool
#             shared by sequences of many lengths, prefill and decode in one varlen call per
#             step, page sizes SERVING_PAGES), with their GPU tests
#   short     short sequences (issue 45): the one-wave tiers' tests, studies/short_seq_bench.py
#             (ViT shapes against SDPA's backends) and ci/vit_client.py (Hugging Face ViT
#             encoders end to end against SDPA)
#   distributed  context parallelism on every GPU of the host (2 or more): the ring's operators
#             and the multi-GPU tests, then studies/ring_bench.py (ring and all-gather against
#             torch's context_parallel over SDPA and one GPU alone; RING_SEQS, RING_HEADS,
#             RING_LONG tokens) and studies/ring_profile.py (where the ring's time goes)
#   fuzz      the property-based GPU tests in their long profile (FA_FUZZ_PROFILE=long, 10x the
#             examples of the test step's run, new examples every run)
#   hopper    the sm90 kernels' tests (time-limited), the Hopper progression, the dispatched
#             d_head 128 table against SDPA FA2/cuDNN and a cuBLAS GEMM
#   features  causal table against SDPA FA2 causal, d_head 64/96/256 tables against SDPA FA2,
#             host cost per call, window, GQA, varlen against a padded batch
#   calibrate power study: planted slowdowns (CAL_SIZES %) on each of CAL_CASE, CAL_RUNS runs per
#             size, then AA_RUNS whole A/A gate runs
#   ab        candidates (AB_CONFIGS; AB_CAUSAL=1 for causal) tested, sanitized and benchmarked
#             side by side
#   window    the dispatched sliding-window kernel and candidates (WINDOW_CONFIGS, space-
#             separated, built) against the full kernel, per dtype of WINDOW_DTYPES ("bf16
#             fp16"): studies/window_ab.py, WINDOW_ROUNDS rounds
#   hang      a head whose attention() never returns on one case: the gate must end in exit 2
#   gate-aa   the A/B gate's comparison of this build with itself (fa-tools gate perf --aa), all
#             cases, forward and backward: every verdict must be "same" (exit 0)
#   bwd-planted  the A/B gate on a copy of this tree whose sm80-family softcap backward kernels
#             spin 400 cycles per query block: the backward cases that run them (and those the
#             SASS diff adds for the other ones) must be "slower", all else "same" (exit 1)
#   bwd90-planted  the same with the spin in the Hopper backward's softcap kernels
#   dec-planted  the same with the spin (PLANT_CYCLES) per KV block in the decode kernels: the
#             decode steps must be "slower" (GATE_KINDS=decode: only the gate's decode steps,
#             for gate-aa too)
#   fp8-planted  the same with the spin per KV block in the Hopper forward's softcap kernels:
#             the FP8 softcap cases must be "slower" (GATE_KINDS=fp8: the FP8 cases alone;
#             the 16-bit softcap forward cases slow down too)
#   bwd80-table  issue 28's table: the sm80 family's d_head 64/128 kernels by name against SDPA
#             FA2 and cuDNN, bf16/fp16, seq 1024-16384, causal and not, 2 rounds in rotated
#             order (about 6 minutes on an H100)
#   bwd-prog  the backward's progression: one kernel per technique at d_head 64 and 128, bf16,
#             16x1024, 16x4096, 4x16384, causal and not (fa-tools bench --pass bwd)
#   profile   Nsight Compute (full set, clocks untouched) of the dispatched kernel and SDPA
#             cuDNN's at PROFILE_SHAPE ("bf16 128 16 4096 16"): details and per-SASS-line
#             stall samples of ours, details of cuDNN's
#   profile-decode  the same for the decode kernel (ours, the split heuristic) and SDPA cuDNN's at
#             PROFILE_SHAPE ("16 32768 32 8 128": batch, seqlen, heads, kv_heads, d_head), and
#             ours over pages of each size in PROFILE_PAGES (e.g. "16 64"; none by default) and
#             over an e4m3 cache with PROFILE_FP8=1
#   profile-bwd  the same for the backward's main kernel (the Hopper one) and cuDNN's, at
#             PROFILE_SHAPE ("bf16 128 4 4096 16")
#   profile-bwd80  the sm80 family's backward kernel by name (as on an sm_80 GPU or a varlen
#             call) and SDPA FA2's, at PROFILE_SHAPE ("bf16 64 4 4096 16"), with both SASS pages
#   workflow  the GPU job of .github/workflows/pr.yml as a runner runs it, in a clone of
#             $BUNDLE (a git bundle of the repo, main = the PR's base): an unchanged head
#   workflow-planted  the same for a head whose Hopper kernels mask every KV block
#   (workflow steps need nox and the pinned SASS tools in $FA_WHEELHOUSE)
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
    run test env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q -p no:cacheprovider \
        --hypothesis-show-statistics tests
fi
if step cluster-probe; then
    # Thread block clusters on this GPU (studies/cluster_probe.cu): how many fit at once at a
    # decode CTA's shape, where their CTAs land, and what a cluster launch and its barriers cost.
    run cluster_probe bash -c "nvcc -O2 -gencode=arch=compute_90,code=sm_90 \
        -o /tmp/cluster_probe studies/cluster_probe.cu && /tmp/cluster_probe"
fi
if step decode; then
    # The KV-cache path (issue 44): its tests, the sanitizers on a few of them (the decode and
    # combine kernels, the append; the warps' merge through shared memory), then decode steps
    # against SDPA and the copy bandwidth (studies/decode_bench.py).
    run decode_tests timeout 400 env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q \
        -p no:cacheprovider tests/test_gpu_kvcache.py
    run decode_memcheck timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kvcache.py \
        -k "case00 or case03 or case05 or case09 or bad_device or (long_cache and 7-16) or forced or wide or deep or leftpad or small_pages or groups"
    run decode_racecheck timeout 300 compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kvcache.py -k "case00 or case03"
    # the 32-row kernels' merge of 4 warps x 32 rows (a run of its own: the reference's cuBLAS
    # GEMMs report hazards at some shapes)
    run decode_racecheck_wide timeout 300 compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kvcache.py \
        -k "(wide and bf16-128) or deep or (small_pages and bf16)"
    # shellcheck disable=SC2086  # DECODE_BENCH_ARGS: the bench's options, split on spaces
    run decode_bench timeout 500 python3 studies/decode_bench.py ${DECODE_BENCH_ARGS:-} \
        --json "$LOG_DIR/decode.json"
fi
if step fp8-cache; then
    # Issue 46's FP8 KV cache: its tests (random grid, long caches, every FP8-cache decode kernel
    # by name, varlen over FP8 pages and packed keys, graph replay, bad input), the sanitizers
    # on a few (the FP8 fragments' loads, the quantising append), then decode steps with FP8
    # caches beside the 16-bit one (studies/decode_bench.py --fp8, FP8_CACHE_BENCH_ARGS).
    run fp8_cache_tests timeout 400 env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q \
        -p no:cacheprovider tests/test_gpu_kvcache_fp8.py
    run fp8_cache_memcheck timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kvcache_fp8.py \
        -k "case00 or case01 or case02 or case04 or varlen or by_name or groups"
    run fp8_cache_racecheck timeout 300 compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kvcache_fp8.py -k "case00 or case02"
    # shellcheck disable=SC2086  # FP8_CACHE_BENCH_ARGS: the bench's options, split on spaces
    run fp8_cache_bench timeout 500 python3 studies/decode_bench.py --fp8 e4m3,e5m2 \
        ${FP8_CACHE_BENCH_ARGS:-} --json "$LOG_DIR/fp8_cache.json"
fi
if step fp8; then
    # Issue 46's FP8 forward: its tests (every e4m3 kernel by name, dispatch, flash_attn_func's
    # descales, views, bad input, varlen packs), memcheck and racecheck on two shapes and a
    # varlen pack (the producer's V transpose in shared memory, its zeroed tails), then
    # studies/fp8_bench.py (FP8_BENCH_ARGS).
    run fp8_tests timeout 400 env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q \
        -p no:cacheprovider tests/test_gpu_fp8.py tests/test_fp8_cpu.py tests/test_gpu_gate_fp8.py
    run fp8_memcheck timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py \
        -k "(by_name and (2x113x203 or 1x1x300)) or (varlen_kernel_by_name and tails)"
    run fp8_racecheck timeout 300 compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py \
        -k "(by_name and 2x113x203) or (varlen_kernel_by_name and tails and fwpiajmt)"
    # shellcheck disable=SC2086  # FP8_BENCH_ARGS: the bench's options, split on spaces
    run fp8_bench timeout 400 python3 studies/fp8_bench.py ${FP8_BENCH_ARGS:-} \
        --out "$LOG_DIR/fp8.json"
    # a Hugging Face Llama's logits with our FP8 attention and with FA3's algorithm emulated,
    # against its bf16 and fp32 logits (issue 46, item 3)
    run fp8_llama timeout 300 python3 ci/llama_fp8_logits.py --json "$LOG_DIR/fp8_llama.json"
fi
if step hopper-varlen; then
    # Issue 45's Hopper varlen and softcap forwards: their tests (every varlen kernel by name,
    # dispatch, values past a sequence's end, views; the varlen and softcap grids through
    # dispatch; the sm90 softcap kernels of the kernel grid) and the sanitizers on the varlen
    # kernels (the V-tail zeroing in shared memory, the mixed TMA and register stores); step
    # hopper-varlen-bench: the targets' bench (studies/hopper_varlen_bench.py, HV_BENCH_ARGS).
    run hv_tests timeout 500 env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q \
        -p no:cacheprovider tests/test_gpu_varlen_hopper.py tests/test_gpu_varlen.py
    run hv_kernel_tests timeout 400 env FLASH_ATTENTION_REQUIRE_EXT=1 FA_TEST_GRID=gate \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py \
        -k "fwd_sm90 and (fwaldt or fwaldmt or fwpiazt or fwpiazmt)"
    run hv_memcheck timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_varlen_hopper.py \
        -k "tails and bf16 and (fwpiazj- or fwpiazjm or fwaldngzj)"
    run hv_racecheck timeout 300 compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_varlen_hopper.py \
        -k "tails and bf16 and fwpiazjmt"
fi
if step hopper-varlen-bench; then
    # shellcheck disable=SC2086  # HV_BENCH_ARGS: the bench's options, split on spaces
    run hv_bench timeout 500 python3 studies/hopper_varlen_bench.py ${HV_BENCH_ARGS:-} \
        --out "$LOG_DIR/hopper_varlen.json"
fi
if step hopper-varlen-bwd; then
    run hvb_tests timeout 500 env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q \
        -p no:cacheprovider tests/test_gpu_varlen_hopper.py tests/test_gpu_backward.py \
        -k "backward or varlen or debug_log"
    run hvb_memcheck timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_varlen_hopper.py \
        -k "backward and ((tails and bf16) or deterministic or nan)"
    run hvb_racecheck timeout 300 compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 -m pytest -q -p no:cacheprovider tests/test_gpu_varlen_hopper.py \
        -k "backward_kernel and tails and bf16 and (d128_r64_c128_fj- or d256_r64_c64_fjt)"
    # shellcheck disable=SC2086  # HV_BWD_BENCH_ARGS: the bench's options, split on spaces
    run hvb_bench timeout 400 python3 studies/hopper_varlen_bench.py --backward \
        ${HV_BWD_BENCH_ARGS:-} --out "$LOG_DIR/hopper_varlen_bwd.json"
fi
if step clients; then
    run generate_tests timeout 300 env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q \
        -p no:cacheprovider tests/test_llama_generate_client.py tests/test_serving_loop.py
    run generate_client timeout 300 python3 ci/llama_generate_client.py \
        --json "$LOG_DIR/generate.json"
    for ps in ${SERVING_PAGES:-16 1 256}; do
        run "serving_p$ps" timeout 240 python3 ci/serving_loop.py --page-size "$ps" \
            --json "$LOG_DIR/serving_p$ps.json"
    done
fi
if step short; then
    run short_tests timeout 300 env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q \
        -p no:cacheprovider tests/test_vit_client.py tests/test_gpu_kernels.py \
        -k "vit or r64_c128 or dispatched"
    run short_bench timeout 300 python3 studies/short_seq_bench.py --out "$LOG_DIR/short.json"
    run vit_client timeout 300 python3 ci/vit_client.py --json "$LOG_DIR/vit.json"
fi
if step distributed; then
    run distributed_tests timeout 400 env FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q \
        -p no:cacheprovider tests/test_gpu_ring_ops.py tests/test_gpu_distributed.py
    run ring_bench timeout 500 python3 studies/ring_bench.py --seqs "${RING_SEQS:-32768,65536,131072}" \
        --heads "${RING_HEADS:-32/32}" --long "${RING_LONG:-0}" --json "$LOG_DIR/ring.json"
    run ring_profile timeout 200 python3 studies/ring_profile.py
fi
if step fuzz; then
    run fuzz env FA_FUZZ_PROFILE=long FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q \
        -p no:cacheprovider --hypothesis-show-statistics tests/test_gpu_fuzz.py
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
            res[f"{dtype}/d{d}/{s}"] = [(c.name, ms, attention_flops(b, 16, s, s, d) / ms / 1e9)
                                        for c, ms in ranked]
            print(f"{dtype} d{d} seq {s}:")
            for c, ms, tf in res[f"{dtype}/d{d}/{s}"][:8]:
                print(f"  {c:42s} {ms:8.3f} ms {tf:6.1f} TFLOP/s")
json.dump(res, open(sys.argv[1], "w"), indent=1)
' "$LOG_DIR/sweep.json"
fi
if step bench; then
    run bench python3 -m fa_tools bench --json "$LOG_DIR/bench.json" --md "$LOG_DIR/bench.md"
fi
if step features; then
    run features python3 -m fa_tools bench --causal --json "$LOG_DIR/causal.json" \
        --md "$LOG_DIR/causal.md"
    run dheads python3 -m fa_tools bench --dtypes bf16 --d-heads 64,96,256 \
        --json "$LOG_DIR/dheads.json" --md "$LOG_DIR/dheads.md"
    run probe python3 studies/feature_probe.py
fi
if step bench64; then
    run bench64 python3 -m fa_tools bench --d-heads 64 --json "$LOG_DIR/bench64.json" \
        --md "$LOG_DIR/bench64.md"
fi
if step prog; then
    run prog python3 -m fa_tools bench --dtypes bf16 --shapes 16x4096 --configs fwd_sm80:prog \
        --json "$LOG_DIR/prog.json" --md "$LOG_DIR/prog.md"
fi
if step hopper; then
    # The sm90 kernels alone first (a deadlocked pipeline ends in the timeout, not the job
    # limit), then the progression and the dispatched table against cuDNN and cuBLAS.
    run hopper_smoke timeout 120 python3 -m pytest -q -p no:cacheprovider -x \
        tests/test_gpu_kernels.py -k "sm90 and 2x128x128x4x4"
    run hopper_tests timeout 300 python3 -m pytest -q -p no:cacheprovider -x \
        tests/test_gpu_kernels.py -k "sm90 or dispatched"
    run hopper_prog timeout 120 python3 -m fa_tools bench --dtypes bf16 --shapes 16x4096 \
        --configs fwd_sm90:prog --json "$LOG_DIR/hopper_prog.json" --md "$LOG_DIR/hopper_prog.md"
    run hopper_bench timeout 200 python3 -m fa_tools bench --gemm \
        --json "$LOG_DIR/hopper_bench.json" --md "$LOG_DIR/hopper_bench.md"
    run hopper_causal timeout 200 python3 -m fa_tools bench --causal \
        --json "$LOG_DIR/hopper_causal.json" --md "$LOG_DIR/hopper_causal.md"
    run hopper_dheads timeout 200 python3 -m fa_tools bench --dtypes bf16 --d-heads 64,256 \
        --json "$LOG_DIR/hopper_dheads.json" --md "$LOG_DIR/hopper_dheads.md"
fi
if step ab; then
    # Candidates (AB_CONFIGS, in the build; d_head AB_D_HEADS; causal with AB_CAUSAL=1) side by
    # side against SDPA cuDNN/FA2 at the table's shapes, after their tests (AB_TESTS: a pytest
    # -k expression) and a sanitizer pass of the first
    cc=${AB_CONFIGS:?AB_CONFIGS: candidates, comma-separated}
    causal=()
    [ "${AB_CAUSAL:-0}" = 1 ] && causal=(--causal)
    run ab_tests env FLASH_ATTENTION_TEST_CONFIGS=built timeout 240 python3 -m pytest -q \
        -p no:cacheprovider -x tests/test_gpu_kernels.py -k "${AB_TESTS:-sm90}"
    run ab_sanitize timeout 180 python3 -m fa_tools sanitize "${cc%%,*}"
    run ab timeout "${AB_LIMIT_S:-300}" python3 -m fa_tools bench "${causal[@]}" \
        --dtypes "${AB_DTYPES:-bf16,fp16}" --d-heads "${AB_D_HEADS:-128}" --rounds "${AB_ROUNDS:-3}" \
        --shapes "${AB_SHAPES:-16x1024,16x2048,16x4096,8x8192,4x16384}" --configs "$cc" \
        --json "$LOG_DIR/ab.json" --md "$LOG_DIR/ab.md"
fi
if step window; then
    for dt in ${WINDOW_DTYPES:-bf16 fp16}; do
        cands=()  # the candidates of this dtype
        for c in ${WINDOW_CONFIGS:-}; do [[ $c == *_${dt}_* ]] && cands+=("$c"); done
        run "window_$dt" timeout 300 python3 studies/window_ab.py --dtype "$dt" \
            --rounds "${WINDOW_ROUNDS:-3}" dispatched "${cands[@]}"
    done
fi
if step hopper-tune; then  # needs fwd_sm90:tune in the build
    run hopper_tune timeout 400 python3 -m fa_tools bench --dtypes bf16 --d-heads 64,128,256 \
        --shapes 16x4096 --configs fwd_sm90:tune --json "$LOG_DIR/hopper_tune.json" \
        --md "$LOG_DIR/hopper_tune.md"
fi
if step sanitize; then
    # SANITIZE: by default every forward kernel of the default set (all that dispatch runs,
    # Hopper kernels and their sm80 fallbacks) and the ci set, four tools side by side; each
    # config runs tail shapes, masks, a smaller d_head and (sm80) a varlen batch, in drawn
    # layouts (the backward's: ci/gpu_backward.sh SANITIZE=1)
    # shellcheck disable=SC2086
    run sanitize python3 -m fa_tools sanitize ${SANITIZE:-fwd:ci fwd:default} \
        --timeout "${SANITIZE_TIMEOUT_S:-420}"
fi
if step debug; then
    for k in $(python3 -c 'import flash_attention as fa
from flash_attention.kernels import resolve
default = set(resolve("fwd:default"))
print(" ".join(c.name for c in fa.available_configs() if c in default))'); do
        run "debug-$k" python3 -m fa_tools debug "$k"
    done
fi
if step asv; then
    run asv python3 -m nox --no-venv -s bench
fi
if step toolkit; then
    run toolkit env FA_SASS_TOOLS_DIR="${CUDA_HOME:-/usr/local/cuda}/bin" \
        FLASH_ATTENTION_REQUIRE_EXT=1 python3 -m pytest -q -p no:cacheprovider \
        tests/test_tools.py tests/test_gpu_tools.py
    FA_SASS_TOOLS_DIR="${CUDA_HOME:-/usr/local/cuda}/bin" python3 -m fa_tools tools \
        >>"$LOG_DIR/toolkit.log" 2>&1
fi
if step calibrate; then
    # CAL_CASE: one or more gate cases (space-separated); CAL_LIMIT_S: stop the study there
    # (it saves its tables after every block, so a study cut short keeps what it measured)
    cal_cases=()
    for c in ${CAL_CASE:-bf16_d128_b4_s16384}; do cal_cases+=(--case "$c"); done
    run calibrate timeout "${CAL_LIMIT_S:-86400}" python3 -m fa_tools gate calibrate \
        "${cal_cases[@]}" --sizes "${CAL_SIZES-1.5,2,3,5,10}" --runs "${CAL_RUNS:-10}" \
        --aa-runs "${AA_RUNS:-20}" --out "$LOG_DIR/calibrate"
fi
if step hang; then
    # head: a copy of this built tree whose attention() sleeps for an hour at seqlen 16384
    rm -rf /tmp/fa-hang && cp -r . /tmp/fa-hang
    python3 - <<'PY' || exit 3
import pathlib
p = pathlib.Path("/tmp/fa-hang/src/flash_attention/api.py")
t = p.read_text()
marker = "def attention("
i = t.index(marker)
body = t.index('"""', t.index('"""', i) + 3) + 3  # after the docstring
t = t[:body] + "\n    if q.shape[1] == 16384:  # planted hang\n        import time\n        time.sleep(3600)\n" + t[body:]
p.write_text(t)
PY
    run hang bash -c "cd /tmp/fa-hang && time PYTHONPATH=/tmp/fa-hang/src python3 -m fa_tools \
        gate perf --base-dir '$PWD' --out '$LOG_DIR/hang'; echo exit \$?"
fi
if step gate-aa; then
    run gate-aa bash -c "time python3 -m fa_tools gate perf --aa ${GATE_KINDS:+--kinds $GATE_KINDS} \
        --out '$LOG_DIR/gate-aa'; echo exit \$?"
fi
# A planted backward slowdown: head = a copy of this built tree, rebuilt with a 400-cycle spin per
# query block (PLANT_CYCLES) in the softcap kernels of one backward family; base = this tree. The plant is
# applied in the copy, so no planted source is ever committed; it anchors on a line of the
# family's per-query-block code (every occurrence of it) and refuses (exit 3) if that line
# moved.
#   bwd-planted    the sm80 family (on sm_90: the varlen softcap cases and d_head 256)
#   bwd90-planted  the Hopper family (on sm_90: the fixed-length softcap cases)
bwd_plant() {  # bwd_plant STEP FILE ANCHOR
    local name=$1 file=$2 anchor=$3 copy=/tmp/fa-$1
    rm -rf "$copy" && cp -r . "$copy"
    PLANT_FILE="$copy/$file" PLANT_ANCHOR="$anchor" PLANT_STEP="$name" \
        PLANT_CYCLES="${PLANT_CYCLES:-400}" python3 - <<'PY' || exit 3
import os
import pathlib
p = pathlib.Path(os.environ["PLANT_FILE"])
t = p.read_text()
key = os.environ["PLANT_ANCHOR"]
anchors = [i for i in range(len(t)) if t.startswith(key, i)]  # every block loop that has it
if not anchors:
    raise SystemExit(f"{os.environ['PLANT_STEP']}: the anchor {key!r} is "
                     f"not in {p.name} any more; update the plant")
cycles = int(os.environ.get("PLANT_CYCLES", "400"))
spin = (f"if constexpr (Cfg::kSoftcap) {{  // planted: {cycles} cycles per query block\n"
        "    const long long planted_t0 = clock64();\n"
        f"    while (clock64() - planted_t0 < {cycles}) {{\n"
        "    }\n"
        "}\n")
for anchor in reversed(anchors):
    line = t.rindex("\n", 0, anchor) + 1
    indent = t[line:anchor]
    t = t[:line] + "".join(indent + s + "\n" for s in spin.splitlines()) + t[line:]
p.write_text(t)
PY
    run "$name-build" bash -c "cd $copy && FLASH_ATTENTION_KERNELS='$KERNELS' \
        FLASH_ATTENTION_ARCHS='$ARCHS' MAX_JOBS='${MAX_JOBS:-16}' python3 setup.py -q \
        build_ext --inplace" || exit 2
    run "$name" bash -c "cd $copy && time PYTHONPATH=$copy/src \
        python3 -m fa_tools gate perf --base-dir '$PWD' ${GATE_KINDS:+--kinds $GATE_KINDS} \
        --out '$LOG_DIR/$name'; \
        echo exit \$?"
}
if step dec-planted; then
    bwd_plant dec-planted src/csrc/sm80/decode_kernel.cuh \
        "gemm_qk<Cfg>(S, qbuf, q_at, k_addr<Cfg>(sK, lane));"
fi
if step fp8-planted; then
    bwd_plant fp8-planted src/csrc/sm90/forward_mainloop.cuh \
        "softmax.template scores<kFirst>(S, scale_log2(), corr);"
fi
if step bwd-prog; then
    # One row per technique (needs KERNELS=ci,default,bwd_sm90:r64 for the B_r 64 row at
    # d_head 64): results/2026-11-27-h200-backward-progression.md.
    prog_64=bwd_sm80_bf16_d64_r128_c128_w8_fh,bwd_sm90_bf16_d64_r64_c128_f
    prog_64=$prog_64,bwd_sm90_bf16_d64_r128_c128_f
    prog_128=bwd_sm80_bf16_d128_r64_c128_w8_fh,bwd_sm90_bf16_d128_r64_c128_f
    for d in 64 128; do
        configs=$prog_64
        [ "$d" = 128 ] && configs=$prog_128
        for c in "" --causal; do
            run "bwd-prog-d$d${c:+-causal}" timeout 150 python3 -m fa_tools bench --pass bwd \
                --configs "$configs" --dtypes bf16 --d-heads "$d" \
                --shapes 16x1024,16x4096,4x16384 $c \
                --json "$LOG_DIR/bwd-prog-d$d${c:+-causal}.json" \
                --md "$LOG_DIR/bwd-prog-d$d${c:+-causal}.md"
        done
    done
fi
if step bwd80-table; then
    # Issue 28's table: the sm80 family's d_head 64 and 128 kernels by name (as on an sm_80 GPU)
    # against SDPA FA2 and cuDNN, bf16 and fp16, seq 1024-16384 (batch 16/16/16/8/4), causal
    # and not, two rounds in rotated order (results/2026-11-27-h100-sm80-backward-table.md has
    # one).
    variants=$(python3 -c "from flash_attention import ops
from flash_attention.backward import built
from flash_attention.kernels.bwd_sm80 import Sm80BwdConfig
ops.require()
print(','.join(c.name for c in built() if isinstance(c, Sm80BwdConfig) and c.d_head in (64, 128)
               and not c.softcap))")
    run bwd80-table timeout 540 python3 studies/backward_bench.py --d 64,128 \
        --seqs 1024,2048,4096,8192,16384 --dtypes bf16,fp16 --peers fa2,cudnn --no-train \
        --no-det --rounds 2 --variants "$variants"
fi
if step bwd-planted; then
    bwd_plant bwd-planted src/csrc/sm80/backward_kernel.cuh "probabilities(i, stage(buf)"
fi
if step bwd90-planted; then
    # (after dO has landed, before the dP^T GEMM: at d_head 256 a spin before the block's
    # first wait was hidden, 0.99x)
    bwd_plant bwd90-planted src/csrc/sm90/backward_mainloop.cuh \
        "wgmma_fence();  // (dP^T's registers were last written by the previous block)"
fi
# ncu_run NAME KERNEL_REGEX WHO [TARGET ARGS...]: Nsight Compute (full set, clocks untouched) of
# the last of 4 launches of the matching kernel (the regex over its demangled name: our kernels
# are flash::<family>::<direction>_kernel) in studies/ncu_target.py WHO $shape ARGS, and its
# details page.
# shellcheck disable=SC2086
ncu_run() {
    run "ncu-$1" timeout 240 ncu --clock-control none --set full --kernel-name-base demangled \
        -k "regex:$2" \
        --launch-skip 3 --launch-count 1 -f -o "$LOG_DIR/ncu-$1" \
        python3 "${NCU_TARGET:-studies/ncu_target.py}" "$3" $shape "${@:4}"
    ncu --import "$LOG_DIR/ncu-$1.ncu-rep" --page details >"$LOG_DIR/ncu-$1-details.txt" 2>&1
}
ncu_sass() {  # ncu_sass NAME: the per-SASS-line page of ncu_run NAME's report
    ncu --import "$LOG_DIR/ncu-$1.ncu-rep" --page source --csv --print-source sass \
        >"$LOG_DIR/ncu-$1-sass.csv" 2>&1
}
if step profile; then
    shape=${PROFILE_SHAPE:-bf16 128 16 4096 16}
    ncu_run ours 'sm90::fwd_kernel' ours
    ncu_sass ours
    ncu_run cudnn 'cudnn|sdpa|fprop|fmha' cudnn
fi
if step profile-decode; then
    shape=${PROFILE_SHAPE:-16 32768 32 8 128}
    NCU_TARGET=studies/decode_ncu_target.py ncu_run dec-ours 'dec_kernel' ours
    ncu_sass dec-ours
    NCU_TARGET=studies/decode_ncu_target.py ncu_run dec-cudnn 'cudnn|sdpa|fprop|fmha' sdpa
    for page in ${PROFILE_PAGES:-}; do
        NCU_TARGET=studies/decode_ncu_target.py ncu_run "dec-ours-page$page" 'dec_kernel' ours \
            --page "$page"
        ncu_sass "dec-ours-page$page"
    done
    if [ -n "${PROFILE_FP8:-}" ]; then
        NCU_TARGET=studies/decode_ncu_target.py ncu_run dec-ours-e4m3 'dec_kernel' ours --fp8
        ncu_sass dec-ours-e4m3
    fi
fi
if step profile-bwd; then
    shape=${PROFILE_SHAPE:-bf16 128 4 4096 16}
    ncu_run bwd-ours 'sm90::bwd_kernel' ours --backward
    ncu_sass bwd-ours
    ncu_run bwd-cudnn 'bprop' cudnn --backward
fi
if step profile-bwd80; then
    shape=${PROFILE_SHAPE:-bf16 64 4 4096 16}
    read -r dt d _ <<<"$shape"
    sm80=$(python3 -c "from flash_attention import ops
from flash_attention.backward import built
from flash_attention.kernels import Call, bwd_sm80
ops.require()
c = bwd_sm80.select(Call('$dt', $d), built())
print(c.name if c else '')")
    if [ -n "$sm80" ]; then
        ncu_run bwd80-ours 'sm80::bwd_kernel' ours --backward --config "$sm80"
        ncu_sass bwd80-ours
        ncu_run bwd80-fa2 'flash_bwd_dq_dk_dv' fa2 --backward
        ncu_sass bwd80-fa2
    else
        summary+=("profile-bwd80: no sm80 backward kernel built for $dt d_head $d")
    fi
fi
workflow() (  # workflow NAME [planted]: the PR workflow's GPU job in a fresh clone, in one
    # workspace path as on a runner (so the object cache serves a later job as it would there)
    name=$1 dir=/tmp/runner
    unset PYTHONPATH FLASH_ATTENTION_TUNING_FILE  # nothing of this tree leaks into the job
    rm -rf "$dir" && git clone -q "$BUNDLE" "$dir" && cd "$dir" || return 3
    git config user.email gate@example.invalid && git config user.name gate
    git checkout -q -b pr origin/main
    if [ "${2:-}" = planted ]; then
        # The Hopper kernels without masks apply the key-tail mask to every KV block instead of
        # the last one only (what dispatch runs on these H100/H200 runners, all cases but the
        # causal and varlen ones).
        sed -i 's|return (j + 1) \* Cfg::kBc > seqlen_k;|return j >= 0;  // planted|' \
            src/csrc/sm90/forward_tile.cuh
        grep -q 'return j >= 0;  // planted' src/csrc/sm90/forward_tile.cuh || return 3
        git commit -qam "planted: key-tail mask on every KV block of the Hopper kernels" \
            || return 3
    fi
    export FA_OFFLINE=1 GATE_BASE=origin/main FA_GATE_CACHE=/tmp/fa-gate-cache
    python3 -m pip install -q --no-index --find-links "$FA_WHEELHOUSE" nox
    t0=$SECONDS
    python3 -m nox -s gate -- --base "$GATE_BASE"
    PYTHONPATH=src python3 -m fa_tools gate report --out gate-report >/dev/null
    rc=$?
    echo "gate exit code $rc, wall time $((SECONDS - t0)) s (builds included)"
    cp gate-report/report.md "$LOG_DIR/$name-report.md"
    return $rc
)
if step workflow; then
    run workflow workflow workflow
fi
if step workflow-planted; then
    run workflow-planted workflow workflow-planted planted
fi
echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$LOG_DIR/summary.log"
