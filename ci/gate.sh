#!/usr/bin/env bash
# The main job: build and test (ci/test.sh), then, on a GPU, the benchmark table of attention()
# against PyTorch SDPA (FA2 and cuDNN backends) measured in the same run. On a machine without
# a GPU the benchmark is skipped with the reason. Exit status: non-zero if anything failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/test.sh "$@"
if [ -x .venv/bin/python ] && ! python3 -c "import torch" 2>/dev/null; then
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
if python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    python -m fa_tools bench
else
    echo "== benchmark skipped: no CUDA GPU on this machine"
fi
