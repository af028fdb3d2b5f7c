#!/usr/bin/env bash
# The main job on the built-in default checkpoint, from a fresh machine:
# set-up → make a small Llama checkpoint with transformers → convert for world size 8 →
# verify against the source → inspect → train it with 8 FSDP2 processes (CPU/gloo, or GPUs),
# each loading only its own rank file (load time and memory shown per rank).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
scripts/setup.sh
BUILD=${RESHARD_BUILD_DIR:-$ROOT/build}
VENV=${RESHARD_VENV:-$ROOT/.venv}
WORK=${RESHARD_DEMO_DIR:-$ROOT/.work/demo}
WS=${RESHARD_DEMO_WORLD_SIZE:-8}
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$WORK"

echo "== 1. default checkpoint (transformers save_pretrained)"
"$VENV/bin/python" scripts/make_default_checkpoint.py "$WORK/llama-default"
echo "== 2. reshard convert --world-size $WS"
"$BUILD/reshard" convert "$WORK/llama-default" -o "$WORK/shards" --world-size "$WS"
echo "== 3. reshard verify --source"
"$BUILD/reshard" verify "$WORK/shards" --source "$WORK/llama-default"
echo "== 4. reshard inspect"
"$BUILD/reshard" inspect "$WORK/shards"
STEPS=${RESHARD_DEMO_STEPS:-30}
echo "== 5. train: $WS FSDP2 processes (torchrun -m reshard.train), $STEPS steps"
OMP_NUM_THREADS=1 "$VENV/bin/torchrun" --nproc-per-node "$WS" --standalone -m reshard.train "$WORK/shards" \
  --steps "$STEPS" --batch-size 2 --seq-len 64 --log-every 5 --check-weights "$WORK/llama-default" 2>&1 \
  | grep -vE "^(W|I)[0-9]{4} |^\*+$|OMP_NUM_THREADS|warnings.warn|UserWarning"
