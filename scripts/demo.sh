#!/usr/bin/env bash
# The main job on the built-in default checkpoint, from a fresh machine:
# set-up → make a small Llama checkpoint with transformers → convert for world size 8 →
# verify against the source → inspect → load it in 8 FSDP2 processes (CPU/gloo, or GPUs).
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
echo "== 5. load: $WS FSDP2 processes, each reading only its own rank file"
"$VENV/bin/torchrun" --nproc-per-node "$WS" --standalone scripts/demo_load.py "$WORK/shards" 2>&1 \
  | grep -E "^rank |Error|error"
