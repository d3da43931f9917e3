#!/usr/bin/env bash
# Hopper config comparison on a GPU machine (lent device): each candidate beside SDPA cuDNN and
# FA2 in the same interleaved rounds, so ours/cuDNN compares candidates across rows despite clock
# drift. Needs the candidates in the build (KERNELS). Logs and tables in $1.
#   KERNELS=ci,default,$(studies/hopper_ab.sh --kernels) ... build, then studies/hopper_ab.sh LOG_DIR
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
D128=fwd_sm90_bf16_d128_r128_c128_s2_fwal,fwd_sm90_bf16_d128_r128_c128_s2_fwial
D128+=,fwd_sm90_bf16_d128_r128_c128_s2_fwa,fwd_sm90_bf16_d128_r128_c128_s2_fwia
D128+=,fwd_sm90_bf16_d128_r128_c128_s2_fwpia,fwd_sm90_bf16_d128_r128_c176_s2_fwia
D128+=,fwd_sm90_bf16_d128_r128_c128_s2_fwalxgz,fwd_sm90_bf16_d128_r128_c128_s2_fwialxgz
CAUSAL=fwd_sm90_bf16_d128_r128_c128_s2_fwaldm,fwd_sm90_bf16_d128_r128_c128_s2_fwam
CAUSAL+=,fwd_sm90_bf16_d128_r128_c128_s2_fwiam,fwd_sm90_bf16_d128_r128_c128_s2_fwpiam
CAUSAL+=,fwd_sm90_bf16_d128_r128_c128_s2_fwaldgzm,fwd_sm90_bf16_d128_r128_c128_s2_fwialdgzm
DHEADS=fwd_sm90_bf16_d64_r192_c96_s3_fwal,fwd_sm90_bf16_d64_r192_c96_s3_fwial
DHEADS+=,fwd_sm90_bf16_d256_r128_c64_s2_fwa,fwd_sm90_bf16_d256_r128_c64_s2_fwia
DHEADS+=,fwd_sm90_bf16_d256_r128_c64_s2_fwpia,fwd_sm90_bf16_d64_r192_c96_s3_fwalngz
DHEADS+=,fwd_sm90_bf16_d256_r128_c64_s2_fwpiaz
if [ "${1:-}" = --kernels ]; then
    echo "$D128,$CAUSAL,$DHEADS"
    exit 0
fi
L=${1:?log dir}
mkdir -p "$L"
B=(python3 -m fa_tools bench --dtypes bf16 --rounds "${ROUNDS:-8}")
"${B[@]}" --shapes 16x4096,4x16384 --configs "$D128" --json "$L/ab128.json" --md "$L/ab128.md" \
    >"$L/ab128.log" 2>&1
"${B[@]}" --causal --shapes 16x4096 --configs "$CAUSAL" --json "$L/abcausal.json" \
    --md "$L/abcausal.md" >"$L/abcausal.log" 2>&1
"${B[@]}" --d-heads 64,256 --shapes 16x4096 --configs "$DHEADS" --json "$L/abdheads.json" \
    --md "$L/abdheads.md" >"$L/abdheads.log" 2>&1
for t in ab128 abcausal abdheads; do
    grep '^|' "$L/$t.md" | cut -d'|' -f3,4,6,10,11
done
