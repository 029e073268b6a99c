#!/usr/bin/env bash
# The bidirectional twin at long context (issue 53, item 2), on the CPU in the background: the
# twin objective (experiments/testbed/bidirectional.py) from a long-context block-causal export,
# its RoPE scaling carried along (Dynamic-YaRN x16 over 2048), the prompt at skip-wise positions up
# to 32768 (--pose-target; the block-causal stages' recipe), and real 4096- / 8192-token prompts
# (the prompt's pass takes no gradient, so an 8192-token row costs ~12 s and ~1 GB here; with
# windows of <= 2048 alone the twin's pass key at 8192 did not move, with them it did). Niced
# (19); the same command starts or resumes (the run dir's ckpt.npz). docs/testbed_history.md,
# "Twin at long context", says what it measured.
#
#   bash experiments/testbed/train_twin_long_cpu.sh                    # start / resume
#   INIT=experiments/testbed/exports/twin_long_step665 bash ...        # continue the committed long twin
#   tail -f ~/.cache/maskahead-jax/twin-long/log.txt                  # progress, held-out probe at 8192
#
# Extra arguments go to bidirectional.py (e.g. --minutes 120). DRY_RUN=1 prints the command.
set -eu
cd "$(dirname "$0")/../.."
D=${TWIN_LONG_DIR:-$HOME/.cache/maskahead-jax/twin-long}
PY=${PYTHON:-.venv/bin/python}
CMD=(nice -n 19 "$PY" -m experiments.testbed.bidirectional
  --init-from "${INIT:-experiments/testbed/exports/stage35_step790}" --run-dir "$D/run"
  --minutes 60 --steps 600 --lr 5e-5 --warmup 10 --seed 53 --shapes 8192:32:1,1024:160:3,4096:32:2,8192:160:1
  --pose-target 32768 --pose-prob 0.75 --pose-min-len 1024 --pose-tail-blocks 24
  --eval-minutes 30 --eval-length 8192 --ckpt-minutes 5 "$@")
. experiments/testbed/background.sh
run_in_background "$D" "twin (long)" "${CMD[@]}"
