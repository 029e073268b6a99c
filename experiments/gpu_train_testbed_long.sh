#!/usr/bin/env bash
# The testbed's long-context stage (issue 39): 2048 -> 8192-token prompts, in one lease per run,
# resumable across leases. Run from the repository root on a CUDA machine with jax, flax, optax,
# orbax, tokenizers and safetensors (PYTHONPATH=. is enough):
#
#   OUT=$OUT bash experiments/gpu_train_testbed_long.sh            # first lease: from the shipped export
#   OUT=$OUT bash experiments/gpu_train_testbed_long.sh            # next lease, with runs/testbed_long_state
#                                                                  # carried (auto-detected), or RESUME=DIR
#
# Each run trains until its time is up, then writes under $OUT (7 files, what a lease returns:
# at most 8 files of 16 MiB, two folders deep):
#   state/params.npz, state/opt.npz, state/metrics.jsonl   the portable state (float32 params,
#       AdamW moments, step, training seconds, the metrics of every run so far): copy the folder
#       to runs/testbed_long_state and carry it to the next lease, which continues from it
#       (same step counter, same learning rate, same data stream) instead of from INIT
#   export/{config.json,model.safetensors,tokenizer.json}   the HF export (bfloat16)
#   train.log                                              versions, progress, held-out evals
# The recipe and its reasons: docs/testbed_history.md, "Long-context stage". Every knob is an
# environment variable (defaults below); arguments are appended to train_testbed.py's.
#   LIMIT     seconds the whole command may take (default 500: start-up, training, export, eval)
#   EVAL_S    seconds kept for the final held-out eval (default 100; 0 with FINAL_LENGTHS='')
#   RESUME    a state folder to continue from (default runs/testbed_long_state if it holds one)
#   INIT      the export a first run starts from (default maskahead_jax/testbed, stage 29)
#   THETA     RoPE base (default 10000, the shipped export's: a higher one costs its short-context
#             skills at once, see the docs; THETA=40000 is the variant to try if 8192 stays short)
#   LR        constant learning rate (default 5e-5: stage 29's final rate), WARMUP steps (50)
#   STAGES    the curriculum (default '0:512|8192|2048|4096:32|2|8|6:0.3'); STAGES_SMALL is the
#             one retried with if the first attempt runs out of GPU memory
#   FINAL_LENGTHS (default 4096,8192), FINAL_N (16 per task), SEED (39), WORKERS (nproc - 2),
#   PYTHON (python3), RUN_DIR (/tmp/tb_long: orbax checkpoints, not returned)
set -u
T0=$(date +%s)
OUT=${OUT:-/tmp/gpu_out}
LIMIT=${LIMIT:-500}
EVAL_S=${EVAL_S:-100}
INIT=${INIT:-maskahead_jax/testbed}
THETA=${THETA:-10000}
LR=${LR:-5e-5}
WARMUP=${WARMUP:-50}
STAGES=${STAGES:-'0:512|8192|2048|4096:32|2|8|6:0.3'}
STAGES_SMALL=${STAGES_SMALL:-'0:512|8192|2048|4096:32|1|8|3:0.3'}
FINAL_LENGTHS=${FINAL_LENGTHS-4096,8192}
FINAL_N=${FINAL_N:-16}
SEED=${SEED:-39}
PY=${PYTHON:-python3}
RUN_DIR=${RUN_DIR:-/tmp/tb_long}
if [ -z "${RESUME:-}" ] && [ -f runs/testbed_long_state/params.npz ]; then
  RESUME=runs/testbed_long_state
fi
RESUME=${RESUME:-}
[ -z "$FINAL_LENGTHS" ] && EVAL_S=0
mkdir -p "$OUT/state"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
LOG="$OUT/train.log"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
  $PY -c "import jax, optax, orbax.checkpoint; print('jax', jax.__version__, jax.devices(), 'optax', optax.__version__)"
  echo "RESUME=${RESUME:-none} INIT=$INIT THETA=$THETA LR=$LR STAGES=$STAGES LIMIT=$LIMIT git $(git rev-parse --short HEAD 2>/dev/null)"
} > "$LOG" 2>&1
workers=${WORKERS:-$(( $(nproc) - 2 ))}
[ "$workers" -lt 1 ] && workers=1

# the shipped export's data mix (stage 23 / 29); lengths, RoPE base and rate are this stage's
COMMON=(--init-from "$INIT" --logits-shift --seed "$SEED" --layers 6 --heads 8 --kv-heads 4 --head-dim 32
  --rope-theta "$THETA" --max-positions 8704
  --mqar-prob 0.15 --mqar-templates list,sentence,question --copy-prob 0.05
  --task-weights 0.05,0.30,0.15,0.30,0.20 --packed-weights 0.25,0.25,0.3,0.2 --prompt-frac 0.5:0.92
  --edge-depths 0.2 --answer-mask-prob 0.3 --answer-mask-max-len 32
  --lr "$LR" --constant-lr --warmup "$WARMUP" --gate 0 --minutes 600 --eval-minutes 1000
  --ckpt-minutes 1 --export-minutes 1 --log-every 10
  --final-lengths "$FINAL_LENGTHS" --final-n "$FINAL_N"
  --workers "$workers" --run-dir "$RUN_DIR" --out "$OUT/export" --save-state "$OUT/state")

attempt() {  # attempt STAGES [ARGS]: train until LIMIT less the eval's share, from the newest state
  local stages=$1; shift
  local left=$(( LIMIT - ($(date +%s) - T0) ))
  local wall=$(( left - EVAL_S - 45 ))  # 45 s: start-up (imports, load, worker pool) and the final save
  if [ "$wall" -lt 60 ]; then echo "only ${left}s left: no attempt" >> "$LOG"; return 1; fi
  local from=()
  if [ -f "$OUT/state/params.npz" ]; then from=(--resume-state "$OUT/state")
  elif [ -n "$RESUME" ]; then from=(--resume-state "$RESUME"); fi
  echo "== attempt: stages $stages, ${wall}s of training, ${left}s left, ${from[*]:-from $INIT}" >> "$LOG"
  timeout -k 10 "$left" $PY experiments/train_testbed.py "${COMMON[@]}" "${from[@]}" --stages "$stages" \
    --wall-minutes "$(awk "BEGIN{print $wall / 60}")" "$@" >> "$LOG" 2>&1
  local rc=$?
  echo "train exit $rc after $(( $(date +%s) - T0 ))s" >> "$LOG"
  return $rc
}

attempt "$STAGES" "$@"
rc=$?
if [ $rc -ne 0 ] && grep -qE "RESOURCE_EXHAUSTED|[Oo]ut of memory" "$LOG"; then
  echo "== out of GPU memory: again with STAGES_SMALL" >> "$LOG"
  attempt "$STAGES_SMALL" "$@"
fi
# the state folder keeps the whole metrics log even if the run was killed after its last save
[ -f "$RUN_DIR/metrics.jsonl" ] && cp "$RUN_DIR/metrics.jsonl" "$OUT/state/metrics.jsonl"
rm -f "$OUT"/state/*.tmp.npz
ls -la "$OUT" "$OUT/state" "$OUT/export" >> "$LOG" 2>&1
echo "done after $(( $(date +%s) - T0 ))s" >> "$LOG"
exit 0
