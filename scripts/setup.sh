#!/usr/bin/env bash
# Installs everything reshard needs on a fresh Debian/Ubuntu machine and builds it.
# Idempotent: re-running only does what is missing. Environment:
#   RESHARD_BUILD_DIR (default build), RESHARD_VENV (default .venv), RESHARD_SKIP_APT=1
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${RESHARD_BUILD_DIR:-$ROOT/build}
VENV=${RESHARD_VENV:-$ROOT/.venv}

# 1. System packages (C++ dependencies), only when a header is missing.
need=()
[ -f /usr/include/CLI/CLI.hpp ] || need+=(libcli11-dev)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
[ -f /usr/include/zstd.h ] || need+=(libzstd-dev)
[ -f /usr/include/xxhash.h ] || need+=(libxxhash-dev)
[ -d /usr/include/gtest ] || need+=(libgtest-dev)
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
if [ ${#need[@]} -gt 0 ] && [ "${RESHARD_SKIP_APT:-0}" != 1 ]; then
  echo "setup: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi

# 2. Python environment pinned to the GPU machine's versions.
PY_PINS="torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0 peft==0.21.2 numpy pytest pybind11 scikit-build-core==1.1.2"
STAMP="$VENV/.reshard-deps"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$PY_PINS" ]; then
  echo "setup: installing Python packages ($PY_PINS)"
  "$VENV/bin/pip" install -q --upgrade pip
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q $PY_PINS
  echo "$PY_PINS" > "$STAMP"
fi

# 3. Build (CLI, core library, tests, Python extension; RESHARD_BUILD_TARGETS: only those).
PYBIND_DIR=$("$VENV/bin/python" -c 'import pybind11; print(pybind11.get_cmake_dir())')
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -Dpybind11_DIR="$PYBIND_DIR" -DPython_EXECUTABLE="$VENV/bin/python" \
  ${RESHARD_CMAKE_ARGS:-} >/dev/null
# shellcheck disable=SC2086
cmake --build "$BUILD" -j "$(nproc)" ${RESHARD_BUILD_TARGETS:+--target $RESHARD_BUILD_TARGETS}
echo "setup: built $BUILD/reshard${RESHARD_BUILD_TARGETS:+ (targets: $RESHARD_BUILD_TARGETS)}"
