#!/usr/bin/env bash
# The main job on the built-in default checkpoint, from a fresh machine:
# set-up (only the CLI and the Python extension are built; scripts/test.sh builds the rest) →
# a small Llama checkpoint written by transformers → convert → verify against the source →
# inspect → train with FSDP2 processes (CPU/gloo, or one per GPU with NCCL), each loading only
# its own rank file → a summary (what was converted and verified, per-rank load bytes, time,
# GB/s and peak RSS, the loss curve).
#
# World size and steps fit the machine: one process per GPU (at most 8) and 30 steps on a GPU
# node; 2 processes and 10 steps on CPUs. RESHARD_DEMO_WORLD_SIZE and RESHARD_DEMO_STEPS
# override them.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$(date +%s)
RESHARD_BUILD_TARGETS=${RESHARD_BUILD_TARGETS:-"reshard reshard_python"} scripts/setup.sh
T_SETUP=$(date +%s)
BUILD=${RESHARD_BUILD_DIR:-$ROOT/build}
VENV=${RESHARD_VENV:-$ROOT/.venv}
WORK=${RESHARD_DEMO_DIR:-$ROOT/.work/demo}
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
GPUS=$("$VENV/bin/python" -c 'import torch; print(min(torch.cuda.device_count(), 8))')
if [ "$GPUS" -gt 0 ]; then DEF_WS=$GPUS; DEF_STEPS=30; else DEF_WS=2; DEF_STEPS=10; fi
WS=${RESHARD_DEMO_WORLD_SIZE:-$DEF_WS}
STEPS=${RESHARD_DEMO_STEPS:-$DEF_STEPS}
mkdir -p "$WORK"
rm -rf "$WORK/shards" "$WORK/json"

echo "== 1. default checkpoint (transformers save_pretrained)"
"$VENV/bin/python" scripts/make_default_checkpoint.py "$WORK/llama-default"
echo "== 2. reshard convert --world-size $WS"
"$BUILD/reshard" convert "$WORK/llama-default" -o "$WORK/shards" --world-size "$WS"
echo "== 3. reshard verify --source"
"$BUILD/reshard" verify "$WORK/shards" --source "$WORK/llama-default"
echo "== 4. reshard inspect"
"$BUILD/reshard" inspect "$WORK/shards"
echo "== 5. train: $WS FSDP2 processes (torchrun -m reshard.train), $STEPS steps"
OMP_NUM_THREADS=1 "$VENV/bin/torchrun" --nproc-per-node "$WS" --standalone -m reshard.train "$WORK/shards" \
  --steps "$STEPS" --batch-size 2 --seq-len 64 --log-every 5 --check-weights "$WORK/llama-default" \
  --json-out "$WORK/json" 2>&1 \
  | grep -vE "^(W|I)[0-9]{4} |^\*+$|OMP_NUM_THREADS|warnings.warn|UserWarning"
T_END=$(date +%s)

echo "== summary"
"$VENV/bin/python" - "$WORK" "$WS" "$((T_SETUP - T0))" "$((T_END - T_SETUP))" <<'PY'
import glob, json, os, sys
from reshard import format_bytes as size, format_rate  # the CLI's units (reshard::FormatBytes)
work, ws, setup_s, job_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
reps = sorted((json.load(open(p)) for p in glob.glob(os.path.join(work, "json", "rank-*.json"))),
              key=lambda r: r["rank"])
src = os.path.join(work, "llama-default")
src_bytes = sum(os.path.getsize(p) for p in glob.glob(os.path.join(src, "*.safetensors")))
print(f"converted  {src} ({size(src_bytes)} of safetensors) into {ws} rank files: {work}/shards")
print(f"verified   every rank file intact and equal to the source, byte for byte")
print(f"loaded     each rank read only its own file; weights equal from_pretrained bit for bit "
      f"({reps[0].get('params_checked', '?')} parameters)")
for r in reps:
    ld = r["load"]
    print(f"  rank {r['rank']}: {size(ld['bytes'])} in {ld['seconds'] * 1e3:.1f} ms "
          f"({format_rate(ld['gbps'] * 1e9)}), peak RSS {size(r['rss']['peak_final'])}")
losses = reps[0]["losses"]
marks = sorted({0, len(losses) // 2, len(losses) - 1})
print("trained    loss " + " -> ".join(f"{losses[i]:.3f} (step {i + 1})" for i in marks))
print(f"time       set-up {setup_s} s, convert/verify/train {job_s} s")
PY
