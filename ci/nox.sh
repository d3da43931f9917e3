#!/usr/bin/env bash
# Runs nox on a fresh machine: in the current python3 if it already has torch (a GPU runner
# with a CUDA torch preinstalled), else in .venv (made here). nox comes from PyPI, or from
# $FA_WHEELHOUSE / ./wheelhouse when FA_OFFLINE=1. The sessions install what else they need.
#   ci/nox.sh -s build test        the tests
#   ci/nox.sh -s gate              the main job (static ratchet, tests, A/B perf on a GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    if [ ! -x .venv/bin/python ]; then
        echo "== creating .venv"
        "$PYTHON" -m venv .venv
    fi
    PYTHON=.venv/bin/python
fi
if ! "$PYTHON" -c "import nox" 2>/dev/null; then
    echo "== installing nox"
    if [ "${FA_OFFLINE:-0}" = "1" ]; then
        "$PYTHON" -m pip install -q --no-index --find-links "${FA_WHEELHOUSE:-wheelhouse}" nox
    else
        "$PYTHON" -m pip install -q --progress-bar off nox
    fi
fi
exec "$PYTHON" -m nox "$@"
