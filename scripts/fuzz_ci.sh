#!/usr/bin/env bash
# The fuzz lane: builds the libFuzzer targets (tests/fuzz, clang, ASan+UBSan) in
# build-fuzz-ci/, replays the regression corpus (tests/fuzz/regressions/<target>/: every
# input that once crashed a target), then fuzzes each target for RESHARD_FUZZ_SECONDS (default
# 40) on seeds made from real files (tests/fuzz/make_seeds.py: transformers checkpoints and
# their conversion by build/reshard). Any crash, sanitizer report, leak, timeout or
# out-of-memory fails the run; the input is kept in build-fuzz-ci/artifacts/.
#
# Environment: RESHARD_FUZZ_SECONDS (per target), RESHARD_FUZZ_JOBS (parallel fuzzing
# processes per target, libFuzzer -fork), RESHARD_FUZZ_TARGETS (space-separated subset),
# RESHARD_FUZZ_BUILD_DIR, RESHARD_FUZZ_SEEDS (seed directory; made when missing),
# RESHARD_FUZZ_BIN_DIR (prebuilt targets: skip the build), RESHARD_FUZZ_BUILD_ONLY=1 (build the
# targets and stop: .ci/run builds them while the tests run), RESHARD_FUZZ_DEPS_ONLY=1 (install
# clang when missing, and stop), RESHARD_FUZZ_PARALLEL (targets
# fuzzed at once, default the core count: each still gets RESHARD_FUZZ_SECONDS of its own),
# RESHARD_BIN (the CLI used to make
# rank file and manifest seeds; default build/reshard, built by scripts/setup.sh),
# RESHARD_VENV, RESHARD_SKIP_APT=1. Long run (RELIABILITY.md):
#   RESHARD_FUZZ_SECONDS=3600 RESHARD_FUZZ_JOBS=$(nproc) scripts/fuzz_ci.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${RESHARD_FUZZ_BUILD_DIR:-$ROOT/build-fuzz-ci}
VENV=${RESHARD_VENV:-$ROOT/.venv}
SECS=${RESHARD_FUZZ_SECONDS:-40}
JOBS=${RESHARD_FUZZ_JOBS:-1}
PARALLEL=${RESHARD_FUZZ_PARALLEL:-$(nproc)}
SEEDS=${RESHARD_FUZZ_SEEDS:-$BUILD/seeds}
TARGETS=${RESHARD_FUZZ_TARGETS:-"safetensors_header index_json rank_file manifest torch_pickle zip_directory parallel_plan"}
REGRESSIONS=$ROOT/tests/fuzz/regressions

# target -> seed subdirectory, dictionary, -max_len
declare -A SEED_DIR=([safetensors_header]=safetensors [index_json]=index [rank_file]=rank
                     [manifest]=manifest [torch_pickle]=pickle [zip_directory]=zip [parallel_plan]=plan)
declare -A DICT=([safetensors_header]=safetensors [index_json]=index [rank_file]=rank
                 [manifest]=manifest [torch_pickle]=pickle [zip_directory]=zip [parallel_plan]=plan)
declare -A MAX_LEN=([safetensors_header]=16384 [index_json]=8192 [rank_file]=16384
                    [manifest]=8192 [torch_pickle]=8192 [zip_directory]=65536 [parallel_plan]=4096)

# 1. clang with libFuzzer (Debian/Ubuntu package "clang" ships the compiler-rt runtimes).
if [ -z "${RESHARD_FUZZ_BIN_DIR:-}" ] && ! command -v clang++ >/dev/null; then
  if [ "${RESHARD_SKIP_APT:-0}" = 1 ]; then
    echo "fuzz: clang++ is missing (needed for -fsanitize=fuzzer) and RESHARD_SKIP_APT=1" >&2
    exit 1
  fi
  echo "fuzz: installing clang"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq clang >/dev/null
fi

[ "${RESHARD_FUZZ_DEPS_ONLY:-0}" = 1 ] && exit 0  # only the compiler (.ci/run, before its background builds)

# 2. Build.
if [ -n "${RESHARD_FUZZ_BIN_DIR:-}" ]; then
  BIN=$RESHARD_FUZZ_BIN_DIR
else
  CC=clang CXX=clang++ cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DRESHARD_BUILD_FUZZERS=ON -DRESHARD_BUILD_TESTS=OFF -DRESHARD_BUILD_PYTHON=OFF \
    -DRESHARD_WITH_CUDA=OFF >/dev/null
  # shellcheck disable=SC2086
  cmake --build "$BUILD" -j "$(nproc)" --target $(printf 'reshard_fuzz_%s ' $TARGETS)
  BIN=$BUILD/tests/fuzz
fi
if [ "${RESHARD_FUZZ_BUILD_ONLY:-0}" = 1 ]; then
  echo "fuzz: built $(echo $TARGETS | wc -w) targets into $BIN"
  exit 0
fi

# 3. Seeds from real files.
if [ ! -d "$SEEDS/rank" ]; then
  echo "fuzz: writing seeds into $SEEDS"
  RESHARD_BIN=${RESHARD_BIN:-$ROOT/build/reshard}
  [ -x "$RESHARD_BIN" ] || { echo "fuzz: $RESHARD_BIN missing (run scripts/setup.sh)" >&2; exit 1; }
  rm -rf "$SEEDS.tmp"
  "$VENV/bin/python" "$ROOT/tests/fuzz/make_seeds.py" "$SEEDS.tmp" "$RESHARD_BIN" >/dev/null 2>&1
  mv "$SEEDS.tmp" "$SEEDS"
fi

export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=1:allocator_may_return_null=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
mkdir -p "$BUILD/artifacts" "$BUILD/logs"

# 4. Regression corpus: every input that once crashed, replayed once each.
for t in $TARGETS; do
  if [ -d "$REGRESSIONS/$t" ] && [ -n "$(ls -A "$REGRESSIONS/$t")" ]; then
    n=$(find "$REGRESSIONS/$t" -type f | wc -l)
    echo "== fuzz $t: replaying $n regression input(s)"
    "$BIN/reshard_fuzz_$t" -runs=1 "$REGRESSIONS/$t"/* >"$BUILD/logs/$t-regressions.log" 2>&1 || {
      tail -40 "$BUILD/logs/$t-regressions.log"; echo "fuzz: $t regression input crashes" >&2; exit 1; }
  fi
done

# 5. Fuzz each target on a fresh working corpus (the seeds stay as they are), PARALLEL
#    targets at a time (each one libFuzzer process, or JOBS with -fork).
fuzz_one() {
  local t=$1 corpus=$BUILD/corpus/$1
  rm -rf "$corpus" && mkdir -p "$corpus"
  local fork=()
  [ "$JOBS" -gt 1 ] && fork=(-fork="$JOBS")
  "$BIN/reshard_fuzz_$t" "$corpus" "$SEEDS/${SEED_DIR[$t]}" \
      -dict="$ROOT/tests/fuzz/${DICT[$t]}.dict" -max_len="${MAX_LEN[$t]}" \
      -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 \
      -print_final_stats=1 "${fork[@]}" -artifact_prefix="$BUILD/artifacts/$t-" \
      >"$BUILD/logs/$t.log" 2>&1
}
report_one() {
  local t=$1 corpus=$BUILD/corpus/$1 execs cov
  execs=$(grep -E 'stat::number_of_executed_units' "$BUILD/logs/$t.log" | tail -1 | awk '{print $2}')
  [ -n "$execs" ] || execs=$(grep -oE '^#[0-9]+' "$BUILD/logs/$t.log" | tail -1 | tr -d '#')
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$BUILD/logs/$t.log" | tail -1)
  echo "   $t: ${execs:-?} executions, $cov, corpus $(ls "$corpus" | wc -l) new inputs"
}
set -- $TARGETS
while [ $# -gt 0 ]; do
  batch=() pids=()
  while [ $# -gt 0 ] && [ ${#batch[@]} -lt "$PARALLEL" ]; do
    batch+=("$1"); shift
  done
  for t in "${batch[@]}"; do
    echo "== fuzz $t: ${SECS}s, ${JOBS} process(es)"
    fuzz_one "$t" & pids+=($!)
  done
  failed=()
  for i in "${!batch[@]}"; do
    wait "${pids[$i]}" || failed+=("${batch[$i]}")
  done
  for t in "${failed[@]}"; do
    tail -60 "$BUILD/logs/$t.log"
    echo "fuzz: $t failed; the input is in $BUILD/artifacts/" >&2
  done
  [ ${#failed[@]} -eq 0 ] || exit 1
  for t in "${batch[@]}"; do report_one "$t"; done
done
echo "fuzz: no crash in $(echo $TARGETS | wc -w) targets"
