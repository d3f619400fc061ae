#!/usr/bin/env bash
# Runs the README's main job RUNS times while BUSY busy-loop processes compete for the CPU, and counts
# the runs that failed. A job that fails one time in twenty on a small shared machine is a race.
#
#   scripts/stress_main_job.sh [RUNS=30] [BUSY=2] [EPOCHS=40]
#
# Prints one line per failed run (its log is kept), then "stress: N passed, M failed"; exits 1 when
# any run failed. The busy loops end with the script, also when it is interrupted.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-30}
busy=${2:-2}
epochs=${3:-40}
python=${PYTHON:-python}
logs=$(mktemp -d "${TMPDIR:-/tmp}/collsvc-stress.XXXXXX")
loops=()
stop_loops() {
  for pid in "${loops[@]}"; do kill "$pid" 2>/dev/null; done
  wait 2>/dev/null
}
trap stop_loops EXIT
trap 'exit 130' INT TERM
for _ in $(seq 1 "$busy"); do
  "$python" -c 'while True: pass' &
  loops+=($!)
done
passed=0
failed=0
for run in $(seq 1 "$runs"); do
  log="$logs/run-$run.log"
  if timeout 300 "$python" -m collsvc run -n 4 examples/train_data_parallel.py --epochs "$epochs" >"$log" 2>&1 \
    && grep -q "weights identical on all 4 ranks: True" "$log" \
    && grep -q "(matches: True)" "$log" \
    && ! grep -q "WARNING" "$log"; then
    passed=$((passed + 1))
    rm -f "$log"
  else
    failed=$((failed + 1))
    echo "run $run failed: $(tail -n 1 "$log") (log: $log)"
  fi
done
echo "stress: $passed passed, $failed failed"
[ "$failed" -eq 0 ] && rmdir "$logs" 2>/dev/null
[ "$failed" -eq 0 ]
