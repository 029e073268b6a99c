#!/usr/bin/env bash
# One prepared device session (issue 38 item 5), <= ~8 minutes on one H200:
#   1. the kernel tests that need the device (tests/test_kernels.py -k on_device: both Pallas GPU
#      implementations, Mosaic GPU "pallas_gpu" and Triton "pallas_triton", forced by impl= and
#      compiled for real (not interpret), float + packed int4 / int2, against the jnp references
#      at G=7, head_dim 128, 32-token block, 16k context), plus the dispatch tests; the CPU-side
#      kernel tests (interpret mode, CUDA / TPU lowering) run in CI;
#   2. `maskahead profile` at the Fast-dLLM-v2-7B shape (random weights): dense with the fused
#      attention (GenerationConfig attention="auto": the Pallas kernels) vs MaskAhead 10% vs
#      Q-MaskAhead 10% (4-bit), and at 8192 also the unfused XLA dense (dense@reference), 3 repeats, prompts 8192 (batch 1, 8, 32) and 32768 (batch 1, 8;
#      batch 32 at 32k does not fit the time budget), with forward counts, decode ms per forward,
#      tokens/s, peak device memory (memory_stats), serving capacity and the decode forward's
#      roofline fraction (790 TFLOP/s, 4.8 TB/s; maskahead_jax/profile.py decode_roofline);
#   3. (issue 52 item 6) the kernels under a 1-device mesh (kernels/sharded.py's entry point: the
#      testbed's generate with mesh data=1 == without, dense / maskahead / q-maskahead), and the
#      programs `maskahead lower` only lowers in CI compiled for real on the device
#      (experiments/device_compiles.py: the four shapes at 8k, their default policies; compile
#      seconds and XLA's buffer plan), with whatever time is left.
# Everything lands in $OUT (default runs/gpu_profile): kernels.log, profile_<len>.json / .log,
# mesh.jsonl, compiles.jsonl.
#
#   run:      bash experiments/gpu_profile.sh                 (on the device machine; timeout_s ~540)
#   dry run:  MASKAHEAD_DRY_RUN=1 bash experiments/gpu_profile.sh   (CPU, tiny shape, < 1 min:
#             the testbed model, short prompts, 1 repeat, a kernel-test subset in interpret mode)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_profile}
mkdir -p "$OUT"
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
DRY=${MASKAHEAD_DRY_RUN:-0}
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-480} - ($(date +%s) - start) )); }

"$PY" -c 'import jax; print(jax.__version__, jax.default_backend(), jax.devices())' | tee "$OUT/env.txt"

if [ "$DRY" = "1" ]; then
  timeout 180 "$PY" -m pytest -q tests/test_kernels.py -rs \
    -k "dispatch or reference or on_device or triton_float" 2>&1 | tail -8 | tee "$OUT/kernels.log"
  timeout 300 "$PY" -m maskahead_jax.profile --model maskahead_jax/testbed --prompt-len 96 --out-len 64 \
    --batch 1,2 --policies dense@reference,dense,maskahead,q-maskahead --capacity 10 --repeats 1 \
    --out "$OUT/profile_dry.json" 2>&1 | tail -20 | tee "$OUT/profile_dry.log"
  rc=${PIPESTATUS[0]}
  timeout 120 "$PY" experiments/device_compiles.py mesh --policies dense,maskahead > "$OUT/mesh.jsonl" 2>/dev/null || rc=1
  timeout 120 "$PY" experiments/device_compiles.py compile --shapes fast-dllm-v2-7b --prompt-lens 1024 --layers 2 \
    --policies dense,maskahead > "$OUT/compiles.jsonl" 2>/dev/null || rc=1
  cat "$OUT/mesh.jsonl" "$OUT/compiles.jsonl"
  exit $rc
fi

# -rfEs: name every failure / error / skip (a skip here means the device was not seen as a GPU)
timeout 180 "$PY" -m pytest -q tests/test_kernels.py -k "on_device or dispatch" -rfEs 2>&1 \
  | tail -40 | tee "$OUT/kernels.log"
rc=0
for spec in "8192 1,8,32 dense@reference," "32768 1,8 "; do
  set -- $spec
  extra=${3:-}
  t=$(left)
  if [ "$t" -lt 60 ]; then echo "skip prompt $1: ${t}s left" | tee -a "$OUT/skipped.txt"; continue; fi
  timeout "$t" "$PY" -m maskahead_jax.profile --shape fast-dllm-v2-7b --prompt-len "$1" --out-len 128 \
    --batch "$2" --policies "${extra}dense,maskahead,q-maskahead" --capacity 10 --repeats 3 \
    --kv-budget-gb 100 --out "$OUT/profile_$1.json" 2>&1 | tail -40 | tee "$OUT/profile_$1.log"
  rc=$(( rc | PIPESTATUS[0] ))
done
t=$(left)
if [ "$t" -gt 60 ]; then
  timeout "$t" "$PY" experiments/device_compiles.py mesh > "$OUT/mesh.jsonl" 2>"$OUT/mesh.log" || rc=1
fi
t=$(left)
if [ "$t" -gt 60 ]; then
  timeout "$t" "$PY" experiments/device_compiles.py compile --prompt-lens 8192 > "$OUT/compiles.jsonl" \
    2>"$OUT/compiles.log" || rc=1
else
  echo "skip the device compiles: ${t}s left" | tee -a "$OUT/skipped.txt"
fi
exit $rc
