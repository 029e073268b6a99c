#!/usr/bin/env bash
# Stages 32-42 (issue 53): long positions from short windows on the CPU, in the background.
# Starts the run, or resumes it where its last checkpoint left it (the same command every time;
# a session's end kills the process, the next session runs this again). Niced (19), so it takes
# only the CPU time nobody else wants. docs/testbed_history.md, "Stage 32" ... "Stage 42",
# says what and why.
#
#   bash experiments/testbed/train_long_cpu.sh          # stage 42 (the running one): start / resume
#   STAGE=41 bash experiments/testbed/train_long_cpu.sh # stage 41 (stage 40, the whole prefix pass with gradient)
#   STAGE=40 bash experiments/testbed/train_long_cpu.sh # stage 40 (stage 39, the prefix K / V with gradient)
#   STAGE=39 bash experiments/testbed/train_long_cpu.sh # stage 39 (stage 38, long rows with the most distractors)
#   STAGE=38 bash experiments/testbed/train_long_cpu.sh # stage 38 (stage 37, long rows weighted to multi-key)
#   STAGE=37 bash experiments/testbed/train_long_cpu.sh # stage 37 (stage 36 plus real long rows)
#   STAGE=36 bash experiments/testbed/train_long_cpu.sh # stage 36 (stage 35 plus hard keys)
#   STAGE=35 bash experiments/testbed/train_long_cpu.sh # stage 35 (stage 34 plus the answer's tail)
#   STAGE=34 bash experiments/testbed/train_long_cpu.sh # stage 34 (stage 29 under Dynamic-YaRN)
#   STAGE=33 bash experiments/testbed/train_long_cpu.sh # stage 33 (stage 32 under static YaRN x16)
#   STAGE=32 bash experiments/testbed/train_long_cpu.sh # stage 32 as it ran (PoSE, plain RoPE)
#   tail -c 600 ~/.cache/maskahead-jax/tb-dyn42/log.txt # progress, [eval] lines
#   CARRY=1 bash experiments/testbed/train_long_cpu.sh  # before a session stops: the last saved state,
#                                                       # slim, into experiments/testbed/carry/stage42 (commit it)
#
# Stage 33 is stage 32's flags plus YaRN (x16 over 2048 positions: the frequencies and attention
# temperature the export then carries in its config.json) and the long answer in the probe; its
# first start copies stage 32's portable state (tb-long/state) and continues from it.
# Stage 34 starts again from stage 29's export (the shipped testbed) under Dynamic-YaRN x16 over
# 2048: plain RoPE wherever a window's (or, at inference, a run's) last position is within 2048,
# so the short skills train as stage 29's did; YaRN of the factor each skip-wise window's extent
# needs beyond (x13 over 2560 was tried first: stage 29 under it finds multi-key at 4096 depth 0
# in 5 of 20, under x16 over 2048 in 13 of 20). A lower rate (stage 29's last), the 2560-token
# windows stage 29 trained on, the context's ends oversampled more.
# Stage 35 is stage 34 continued from its portable state (tb-dyn/state, copied on the first start)
# with the answer's chunk starting 1-24 blocks before the answer (--pose-tail-blocks 24): what
# sits right before the answer (the long answer's station list, a needle at depth 1) is then also
# trained next to it at far positions, the layout inference has; stage 34 cut a gap one block
# before the answer, and those two were its worst cells at 8192 (its step-790 export: the long
# answer climbed on, the near needle did not). The probe runs every 90 minutes, an export is
# written every 45.
# Stage 36 is stage 35 continued (from tb-dyn35/state) with hard keys (--hard-keys 0.5: 1-4
# distractor keys sharing one word with the asked key): every multi-key miss at 8192 depth 1 was
# such a key's value, far away, preferred over the asked key right before the question.
# Stage 37 is stage 36 continued (from tb-dyn36/state, or on a new machine stage 36's carried state)
# with real long rows (--real-long 8192:512:3, testbed/real_long.py): every third step one real
# 8192-token task row, its first 7680 tokens a cache from a forward without gradient, its last 512
# (the prompt's end, the question, the answers) trained on top; skip-wise ids on 3 in 4 of them as
# on the short rows. Stages 32-36 never saw a context longer than 2560 real tokens: at 8192 every
# query spreads over 3-4x the keys (the twin's pass key at 8192 moved only with real long prompts).
# Stage 38 is stage 37 continued (from tb-dyn37/state, or stage 37's carried state) with the long
# rows' own mix: multi-key 0.55 of them, the needle at an end 0.6 (--real-long-task-weights,
# --real-long-edge-depths): stage 37's long rows fixed the long answer at 8192 (~18 such rows),
# while its multi-key misses at depth 1 (one-word-overlap keys) had ~4 rows.
# Stage 39 is stage 38 continued (from tb-dyn38/state, or stage 38's carried state) with half the
# long multi-key / document-QA rows holding the most keys / documents their length allows (64 / 24
# at 8192, what the evaluation there holds; --real-long-most-distractors 0.5) and document QA 0.3 of
# the long rows: stage 38's misses at 8192 (multi-key depth 1, document QA depth 0) both answer for
# a key / building sharing one word with the asked one, among the evaluation's 64 keys / 24 documents,
# while a long row drew a uniform count (about half as many on average).
# Stage 40 is stage 39 continued (from tb-dyn39/state, or stage 39's carried state) with the long
# rows' prefix keys / values taking gradient through their own layer's K / V projections
# (--real-long-prefix-kv-grad): stage 39's multi-key misses at 8192 depth 1 copy a far key's value,
# and until now the far keys sat in the cache without gradient (only the query and the tail's keys
# could learn to tell them apart).
# Stage 41 is stage 40 continued (from tb-dyn40/state, or stage 40's carried state) with the whole
# prefix pass taking gradient (--real-long-prefix-full-grad; each layer rematerialised in the
# backward: a long step ~25 s and 7.3 GB against stage 40's ~14 s and 5.6 GB): stage 40 let only
# each layer's last K / V projection of a far key learn, not what that key is built from.
# Stage 42 is stage 41 continued (from tb-dyn41/state, or stage 41's carried state) with more of the
# long rows in the layout multi-key still misses at 8192 (a key sharing one word with the asked one,
# far back, the asked one at depth 1): the long rows' own hard keys 1 (--real-long-hard-keys, was
# --hard-keys' 0.5), the needle at an end 0.8 (was 0.6), multi-key 0.5 of them (was 0.45, the long
# answer 0.1, was 0.15: it scores 0.98 at 8192): ~1 step in 15 such a row, against ~1 in 44.
#
# State (never in the work tree): $TB_LONG_DIR (default ~/.cache/maskahead-jax/ + tb-long for
# stage 32, tb-yarn for 33, tb-dyn for 34, tb-dyn35 ... tb-dyn42 for 35 ... 42):
#   run/ckpt/          orbax checkpoints (every 10 training minutes; the two newest kept)
#   run/metrics.jsonl  loss every 5 steps, held-out evals ({"eval": ..., "eval_L": 512|4096|8192})
#   state/             the portable state (params.npz, opt.npz, metrics.jsonl) at every checkpoint
#   export/            an HF export every 60 training minutes (45 from stage 35) and at the end
#   log.txt, pid       stdout/stderr of every run, the running process's id
# Extra arguments are appended to train_testbed.py's (e.g. --wall-minutes 100). DRY_RUN=1 prints the
# command (one argument per line) and starts nothing (stages 33, 35 and 36 still copy their start state).
set -eu
cd "$(dirname "$0")/../.."
STAGE=${STAGE:-42}
# start_from STATE [EXPORT]: a stage's first start copies the previous stage's portable state into
# $D/state. On a new machine (nothing outside the work tree survives) it resumes this stage's
# carried state, experiments/testbed/carry/stage$STAGE (`CARRY=1 bash ...` writes it from $D/state
# before a session stops: bfloat16 params, the step count and the metrics log, no optimizer moments),
# else starts from the previous stage's committed EXPORT (fresh optimizer moments, steps from 0), or,
# with none given, refuses to start
start_from() {
  [ -f "$D/state/params.npz" ] && return 0
  if [ -f "$CARRIED/params.npz" ]; then  # a new machine: this stage's state as the last session left it
    mkdir -p "$D" && cp -r "$CARRIED" "$D/state" && echo "stage $STAGE: resuming the carried state $CARRIED" >&2
  elif [ -f "$1/params.npz" ]; then
    mkdir -p "$D" && cp -r "$1" "$D/state" && echo "stage $STAGE: copied the previous stage's state from $1" >&2
  elif [ -n "${2:-}" ]; then
    echo "stage $STAGE: no previous state at $1; starting from $2" >&2
    EXTRA+=(--init-from "$2")
  else
    echo "stage $STAGE starts from the previous stage's state: none at $1"; exit 1
  fi
}
# start_after N: start_from stage N's state ($STAGE<N>_STATE, default tb-dynN/state), else its carried
# state ($STAGE<N>_CARRIED, default carry/stageN), else stage 35's committed export (stages 37-42)
start_after() {
  local state="STAGE$1_STATE" carried="STAGE$1_CARRIED" prev
  prev=${!state:-$HOME/.cache/maskahead-jax/tb-dyn$1/state}
  [ -f "$prev/params.npz" ] || prev=${!carried:-experiments/testbed/carry/stage$1}
  start_from "$prev" experiments/testbed/exports/stage35_step790
}
PY=${PYTHON:-.venv/bin/python}
CARRIED=${CARRIED:-experiments/testbed/carry/stage$STAGE}
case "$STAGE" in
  32) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-long}; EXTRA=(--eval-tasks passkey,multikey --minutes 480) ;;
  33) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-yarn}
      EXTRA=(--rope-scaling yarn:16:2048 --eval-tasks passkey,multikey,longanswer --minutes 1200)
      start_from "${STAGE32_STATE:-$HOME/.cache/maskahead-jax/tb-long/state}" ;;
  34|35|36|37|38|39|40|41|42) DYN=(--rope-scaling dynamic_yarn:16:2048 --seed 34 --lr 5e-5 --edge-depths 0.3
             --stages '0:512|2560|1024|2560|4096:8|2|4|2|1:0.3'
             --eval-tasks passkey,multikey,longanswer --minutes 1200) ;;&
  34) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-dyn}  # from stage 29's export itself, no copied state
      EXTRA=("${DYN[@]}") ;;
  35) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-dyn35}
      EXTRA=("${DYN[@]}" --pose-tail-blocks 24 --eval-minutes 90 --export-minutes 45)
      start_from "${STAGE34_STATE:-$HOME/.cache/maskahead-jax/tb-dyn/state}" experiments/testbed/exports/stage34_step234 ;;
  36) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-dyn36}
      EXTRA=("${DYN[@]}" --pose-tail-blocks 24 --hard-keys 0.5 --eval-minutes 90 --export-minutes 45)
      start_from "${STAGE35_STATE:-$HOME/.cache/maskahead-jax/tb-dyn35/state}" experiments/testbed/exports/stage35_step790 ;;
  37) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-dyn37}
      EXTRA=("${DYN[@]}" --pose-tail-blocks 24 --hard-keys 0.5 --eval-minutes 90 --export-minutes 45
             --real-long 8192:512:3)
      start_after 36 ;;
  38) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-dyn38}
      EXTRA=("${DYN[@]}" --pose-tail-blocks 24 --hard-keys 0.5 --eval-minutes 90 --export-minutes 45
             --real-long 8192:512:3 --real-long-task-weights 0.05,0.55,0.1,0.15,0.15 --real-long-edge-depths 0.6)
      start_after 37 ;;
  39|40|41|42) ROWS39=(--pose-tail-blocks 24 --hard-keys 0.5 --eval-minutes 90 --export-minutes 45 --real-long 8192:512:3
             --real-long-most-distractors 0.5)  # stage 39's flags, which 40-42 extend, less its long rows' mix:
             MIX39=(--real-long-task-weights 0.05,0.45,0.05,0.3,0.15 --real-long-edge-depths 0.6) ;;&
  39) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-dyn39}
      EXTRA=("${DYN[@]}" "${ROWS39[@]}" "${MIX39[@]}")
      start_after 38 ;;
  40) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-dyn40}
      EXTRA=("${DYN[@]}" "${ROWS39[@]}" "${MIX39[@]}" --real-long-prefix-kv-grad)
      start_after 39 ;;
  41) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-dyn41}
      EXTRA=("${DYN[@]}" "${ROWS39[@]}" "${MIX39[@]}" --real-long-prefix-full-grad)
      start_after 40 ;;
  42) D=${TB_LONG_DIR:-$HOME/.cache/maskahead-jax/tb-dyn42}
      EXTRA=("${DYN[@]}" "${ROWS39[@]}" --real-long-prefix-full-grad --real-long-hard-keys 1
             --real-long-edge-depths 0.8 --real-long-task-weights 0.05,0.5,0.05,0.3,0.1)
      start_after 41 ;;
  *) echo "STAGE must be one of 32-42, got $STAGE"; exit 1 ;;
esac
CMD=(nice -n 19 "$PY" experiments/train_testbed.py
  --init-from maskahead_jax/testbed --logits-shift --seed 53 --layers 6 --heads 8 --kv-heads 4 --head-dim 32
  --mqar-prob 0.15 --mqar-templates list,sentence,question --copy-prob 0.05
  --task-weights 0.10,0.30,0.15,0.25,0.20 --packed-weights 0.25,0.25,0.3,0.2 --prompt-frac 0.5:0.92
  --edge-depths 0.2 --answer-mask-prob 0.3 --answer-mask-max-len 32
  --stages '0:512|2048|1024|2048|4096:8|2|4|2|1:0.3'
  --pose-target 32768 --pose-prob 0.75 --pose-min-len 2048 --pose-chunks 3 --max-positions 33280
  --lr 1e-4 --constant-lr --warmup 30 --gate 0 --log-every 5
  --eval-minutes 30 --eval-lengths 512,4096,8192 --eval-n 8 --eval-long-n 4
  --ckpt-minutes 10 --export-minutes 60 --final-lengths 4096,8192 --final-n 8
  --run-dir "$D/run" --save-state "$D/state" --resume-state "$D/state" --out "$D/export"
  "${EXTRA[@]}" "$@")
if [ -n "${CARRY:-}" ]; then  # before a session stops: the state, slim, into the work tree (commit it)
  "$PY" -m experiments.testbed.state carry "$D/state" "$CARRIED"
  exit 0
fi
. experiments/testbed/background.sh
run_in_background "$D" "stage $STAGE" "${CMD[@]}"
