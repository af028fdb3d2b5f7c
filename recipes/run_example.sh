#!/usr/bin/env bash
# Both recipes end to end on the built-in default checkpoint (a ~31 M-parameter Llama, bf16):
# convert for N ranks, train with torchrun (python -m reshard.train), then with accelerate.
# CPU/gloo without a GPU, NCCL with GPUs (one process per GPU).
#   NPROC (default 2), STEPS (default 20), RESHARD_BUILD_DIR, RESHARD_VENV, RESHARD_RECIPE_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${RESHARD_BUILD_DIR:-$ROOT/build}
VENV=${RESHARD_VENV:-$ROOT/.venv}
WORK=${RESHARD_RECIPE_DIR:-$ROOT/.work/recipes}
N=${NPROC:-2}
STEPS=${STEPS:-20}
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$WORK"

echo "== 1. default checkpoint and reshard convert --world-size $N"
"$VENV/bin/python" scripts/make_default_checkpoint.py "$WORK/llama-default"
"$BUILD/reshard" convert "$WORK/llama-default" -o "$WORK/shards" --world-size "$N"

echo "== 2. torchrun recipe: python -m reshard.train ($N processes)"
"$VENV/bin/torchrun" --standalone --nproc-per-node "$N" -m reshard.train "$WORK/shards" \
  --steps "$STEPS" --batch-size 4 --seq-len 128 --lr 1e-3 --log-every 5 \
  --check-weights "$WORK/llama-default" --json-out "$WORK/train-json"

echo "== 3. accelerate recipe: recipes/accelerate/train_accelerate.py ($N processes)"
"$VENV/bin/accelerate" launch --config_file recipes/accelerate/fsdp2.yaml --num_processes "$N" \
  --main_process_port "${MAIN_PROCESS_PORT:-29517}" \
  recipes/accelerate/train_accelerate.py "$WORK/shards" \
  --steps "$STEPS" --batch-size 4 --seq-len 128 --lr 1e-3 --log-every 5 \
  --check-weights "$WORK/llama-default" --json-out "$WORK/accelerate-json"
echo "== per-rank JSON: $WORK/train-json, $WORK/accelerate-json"
