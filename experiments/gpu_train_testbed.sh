#!/usr/bin/env bash
# Train the testbed in one GPU lease. Run from the repository root on a CUDA machine that has jax,
# flax, optax, orbax, tokenizers and safetensors (PYTHONPATH=. is enough: nothing is installed).
# This script's arguments go to experiments/train_testbed.py as they are, followed by
#   --workers (CPU cores - 2) --run-dir /tmp/tb --out $OUT/export
# so batches are built by CPU worker processes ahead of the accelerator. Pass --export-minutes
# so that a lease which ends early still returns weights; LIMIT (seconds, default 560) bounds the
# whole training process, under a lease's 10-minute command limit.
# Everything it returns is under $OUT (default /tmp/gpu_out): export/{config.json,
# model.safetensors,tokenizer.json}, train.log (versions, progress, final eval) and metrics.jsonl.
# Example: docs/testbed_history.md, "Stage 29".
set -u
OUT=${OUT:-/tmp/gpu_out}
LIMIT=${LIMIT:-560}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, optax, orbax.checkpoint; print('jax', jax.__version__, jax.devices(), 'optax', optax.__version__)"
} > "$OUT/train.log" 2>&1
workers=$(( $(nproc) - 2 ))
[ "$workers" -lt 1 ] && workers=1
timeout "$LIMIT" python3 experiments/train_testbed.py "$@" \
  --workers "$workers" --run-dir /tmp/tb --out "$OUT/export" >> "$OUT/train.log" 2>&1
echo "train exit $?" >> "$OUT/train.log"
cp /tmp/tb/metrics.jsonl "$OUT/" 2>/dev/null
exit 0
