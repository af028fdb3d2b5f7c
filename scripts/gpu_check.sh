#!/usr/bin/env bash
# On the GPU machine: build with CUDA, run every test including the `gpu`-labelled ones.
# Needs no network: the machine's own python3 (torch, transformers, pybind11) is used.
# Environment: XXHASH_INCLUDE (dir holding xxhash.h when the system lacks it).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${RESHARD_BUILD_DIR:-$ROOT/build}
PY=${PYTHON:-python3}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DRESHARD_XXHASH_INCLUDE_DIR="${XXHASH_INCLUDE:-}" -DPython_EXECUTABLE="$(command -v $PY)" \
  -Dpybind11_DIR="$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())')" -DRESHARD_WITH_CUDA=ON >/dev/null
cmake --build "$BUILD" -j "$(nproc)"
export RESHARD_BIN=$BUILD/reshard PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
ctest --test-dir "$BUILD" --output-on-failure -j 8
$PY -m pytest -q tests/python "$@"
