#!/usr/bin/env bash
# The test command. Uses the current Python if it already has torch (a GPU runner with a CUDA
# torch preinstalled), else makes .venv and installs torch 2.14.1 there; builds the extension
# with the `ci` kernel set for sm_80 and sm_90; runs the whole test suite. GPU tests run when a
# GPU is present and are skipped with the reason otherwise. Extra arguments go to pytest.
#   FLASH_ATTENTION_KERNELS / FLASH_ATTENTION_ARCHS override the build selection.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
t0=$SECONDS

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    if [ ! -x .venv/bin/python ]; then
        echo "== creating .venv"
        "$PYTHON" -m venv .venv
    fi
    # shellcheck disable=SC1091
    . .venv/bin/activate
    PYTHON=python
fi

need=()
"$PYTHON" -c "import torch" 2>/dev/null || need+=("torch==2.14.1")
for mod in pytest ninja setuptools wheel numpy yaml; do
    "$PYTHON" -c "import $mod" 2>/dev/null || need+=("$([ "$mod" = yaml ] && echo pyyaml || echo "$mod")")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "== installing ${need[*]}"
    "$PYTHON" -m pip install --progress-bar off -q "${need[@]}"
fi
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
# cuobjdump and nvdisasm for the toolchain (fa-tools) and its tests, from PyPI if not present.
if ! PYTHONPATH=src "$PYTHON" -c 'from fa_tools.binaries import find_tool as f; f("cuobjdump"); f("nvdisasm")' 2>/dev/null; then
    echo "== installing cuobjdump and nvdisasm"
    "$PYTHON" -m pip install --progress-bar off -q nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37
fi

echo "== building the extension (kernels: ${FLASH_ATTENTION_KERNELS:-ci}, archs: ${FLASH_ATTENTION_ARCHS:-80,90})"
FLASH_ATTENTION_KERNELS=${FLASH_ATTENTION_KERNELS:-ci} \
FLASH_ATTENTION_ARCHS=${FLASH_ATTENTION_ARCHS:-80,90} \
MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$PYTHON" -m pip install --no-build-isolation --no-deps -q -e .
echo "== build done after $((SECONDS - t0)) s"

FLASH_ATTENTION_REQUIRE_EXT=1 "$PYTHON" -m pytest -p no:cacheprovider "$@" tests
