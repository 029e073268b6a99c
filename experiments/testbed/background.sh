# Sourced by the background training scripts (train_long_cpu.sh, train_twin_long_cpu.sh):
#   run_in_background DIR LABEL CMD...
# DRY_RUN=1 prints CMD (one argument per line) and starts nothing; otherwise CMD runs under nohup
# with its output appended to DIR/log.txt and its pid in DIR/pid, unless the process in DIR/pid
# still runs (then it says so and starts nothing).
run_in_background() {
  local dir=$1 label=$2
  shift 2
  if [ -n "${DRY_RUN:-}" ]; then
    printf '%s\n' "$@"
    return 0
  fi
  mkdir -p "$dir"
  if [ -f "$dir/pid" ] && ps -p "$(cat "$dir/pid")" -o args= 2>/dev/null | grep -q experiments; then
    echo "already running: pid $(cat "$dir/pid") (log $dir/log.txt)"
    return 0
  fi
  echo "=== $(date -u) $label start/resume, git $(git rev-parse --short HEAD 2>/dev/null)" >> "$dir/log.txt"
  nohup "$@" >> "$dir/log.txt" 2>&1 &
  echo $! > "$dir/pid"
  echo "pid $! (log $dir/log.txt)"
}
