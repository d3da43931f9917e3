#!/usr/bin/env bash
# Hopper config comparison on a GPU machine (lent device): each candidate beside SDPA cuDNN and
# FA2 in the same interleaved rounds, so ours/cuDNN compares candidates across rows despite clock
# drift. Needs the candidates in the build (KERNELS). Logs and tables in $1.
#   KERNELS=ci,default,$(studies/hopper_ab.sh --kernels) ... build, then studies/hopper_ab.sh LOG_DIR
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
D128=sm90_bf16_d128_c128_g2_s2_fwes,sm90_bf16_d128_c128_g2_s2_fwoes,sm90_bf16_d128_c128_g2_s2_fwe
D128+=,sm90_bf16_d128_c128_g2_s2_fwoe,sm90_bf16_d128_c128_g2_s2_fwpoe
D128+=,sm90_bf16_d128_c176_g2_s2_fwoe,sm90_bf16_d128_c128_g2_s2_fwesxqr
D128+=,sm90_bf16_d128_c128_g2_s2_fwoesxqr
CAUSAL=sm90_bf16_d128_c128_g2_s2_fwesdm,sm90_bf16_d128_c128_g2_s2_fwem,sm90_bf16_d128_c128_g2_s2_fwoem
CAUSAL+=,sm90_bf16_d128_c128_g2_s2_fwpoem,sm90_bf16_d128_c128_g2_s2_fwesdqrm
CAUSAL+=,sm90_bf16_d128_c128_g2_s2_fwoesdqrm
DHEADS=sm90_bf16_d64_c96_g3_s3_fwes,sm90_bf16_d64_c96_g3_s3_fwoes,sm90_bf16_d256_c64_g2_s2_fwe
DHEADS+=,sm90_bf16_d256_c64_g2_s2_fwoe,sm90_bf16_d256_c64_g2_s2_fwpoe
DHEADS+=,sm90_bf16_d64_c96_g3_s3_fwesnqr,sm90_bf16_d256_c64_g2_s2_fwpoer
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
