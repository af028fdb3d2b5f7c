#!/usr/bin/env bash
# Runs every CPU test: GoogleTest (via CTest) and pytest (multi-process FSDP on gloo included).
# GPU tests carry the CTest label / pytest marker "gpu" and run on the GPU machine with
# scripts/gpu_check.sh; here they are deselected by label, and the count is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
"$ROOT/scripts/setup.sh"
BUILD=${RESHARD_BUILD_DIR:-$ROOT/build}
VENV=${RESHARD_VENV:-$ROOT/.venv}
export RESHARD_BIN=$BUILD/reshard
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

echo "== C++ unit tests (ctest, label cpu)"
ctest --test-dir "$BUILD" -LE gpu --output-on-failure -j "$(nproc)"

echo "== Python tests (pytest, not gpu)"
"$VENV/bin/python" -m pytest -q -m "not gpu" "$ROOT/tests/python" "$@"
