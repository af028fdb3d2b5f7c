#!/usr/bin/env bash
# Run AF (issue 20): build, one standard bench_load repetition (also makes the 14 GB checkpoint),
# then bench/cold_rounds/cold2.py: rounds of seq-read ceiling, O_DIRECT 8x4MiB ceiling, and the loader's
# cold variants A (not prepared), B (prepared, as bench_load), C (prepared after the drop) in
# rotating order, until the deadline (T0 + ${AF_BUDGET_S:-540} s). Knobs: AF_BENCH_ONLY (bench_load --only),
# AF_VARIANTS (three of A B C E), AF_DIO8_EVERY (O_DIRECT ceiling every N-th round).
set -uo pipefail
T0=$(date +%s)
cd "$(dirname "$0")/.."
exec > >(tee $OUT/run.log) 2>&1
echo "start $(date -u '+%F %T') UTC; $(nproc) cpus; $(uname -r); loadavg $(cat /proc/loadavg)"
free -g | head -2
echo "thp enabled: $(cat /sys/kernel/mm/transparent_hugepage/enabled); defrag: $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
for d in /sys/block/vd*; do echo "$d: $(for k in rotational max_sectors_kb max_hw_sectors_kb max_segments max_segment_size read_ahead_kb nr_requests scheduler; do printf '%s=%s ' $k "$(cat $d/queue/$k 2>/dev/null)"; done)"; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export RESHARD_XXHASH_INCLUDE_DIR=${RESHARD_XXHASH_INCLUDE_DIR:-$PWD/gpu-carry/include}  # the GPU machine lacks xxhash.h: carry it
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DRESHARD_WITH_CUDA=ON -DRESHARD_BUILD_TESTS=OFF \
  -DRESHARD_XXHASH_INCLUDE_DIR=$RESHARD_XXHASH_INCLUDE_DIR -DPython_EXECUTABLE=$(which python3) > /tmp/cmake.log 2>&1 || { tail -30 /tmp/cmake.log; exit 1; }
cmake --build build-gpu -j16 > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
echo "build done at +$(( $(date +%s) - T0 )) s"
export PYTHONPATH=$PWD/python RESHARD_MODEL_CAPTURE=0 PYTHONUNBUFFERED=1
python3 bench/bench_load.py --build-dir build-gpu --size-gb 14 --world-size 8 --cases rank \
  --only ${AF_BENCH_ONLY:-ceil-seq-read,reshard-t16,reshard-t16-prepared} --threads 16 --reps 1 --budget-s 300 \
  --outdir $OUT/bench --png /tmp/bench-load.png
echo "bench_load rc=$? at +$(( $(date +%s) - T0 )) s"
F=$PWD/.work/bench-load/out-14gb/fsdp2-ws8/rank-00000-of-00008.reshard
ls -la $F
python3 bench/cold_rounds/cold2.py --rank-file $F --ceilings build-gpu/tools/bench/reshard_bench_ceilings \
  --rounds 24 --variants ${AF_VARIANTS:-ABC} --dio8-every ${AF_DIO8_EVERY:-1} --deadline $(( T0 + ${AF_BUDGET_S:-540} )) --out $OUT
echo "cold2 rc=$? at +$(( $(date +%s) - T0 )) s; end $(date -u '+%F %T') UTC; loadavg $(cat /proc/loadavg)"
