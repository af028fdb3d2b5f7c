#!/usr/bin/env bash
# The sanitizer lane: the C++ core and its whole GoogleTest suite built with
# AddressSanitizer + UndefinedBehaviorSanitizer (RESHARD_SANITIZE=ON) in build-asan/, then run.
# Any report fails the run (-fno-sanitize-recover, halt_on_error). Needs the system packages
# that scripts/setup.sh installs (CI runs it after scripts/test.sh). RESHARD_SANITIZE_BUILD_ONLY=1:
# build and stop (.ci/run builds it while the tests run).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${RESHARD_ASAN_BUILD_DIR:-$ROOT/build-asan}
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Debug -DRESHARD_SANITIZE=ON \
  -DRESHARD_BUILD_PYTHON=OFF -DRESHARD_WITH_CUDA=OFF >/dev/null
cmake --build "$BUILD" -j "$(nproc)" --target reshard reshard_core_tests
if [ "${RESHARD_SANITIZE_BUILD_ONLY:-0}" = 1 ]; then
  echo "sanitize: built $BUILD"
  exit 0
fi
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
echo "== C++ unit tests under ASan+UBSan"
ctest --test-dir "$BUILD" -LE gpu --output-on-failure -j "$(nproc)"
