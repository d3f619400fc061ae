#!/usr/bin/env bash
# Runs each forked-children scenario of tests/multiproc/fork_children.py as a real two-rank job, RUNS
# times: the first half on a quiet machine, the second half while two busy loops compete for the CPU.
# Prints, per scenario and launcher, how many runs failed (a non-zero exit, a missing "OK <rank>", or a
# process of the job still alive after it ended) and the first error line of each failed run.
#
#   scripts/stress_fork_children.sh [RUNS] [CASE ...]
#
# RUNS defaults to 20. A CASE is SCENARIO/LAUNCHER with LAUNCHER one of fork-server, spawn (collsvc run
# --start-method) or torchrun (torch.distributed.run --standalone); the default is every scenario the
# docs report (docs/operations.md, section 10). Environment: PYTHON (default python), JOB_TIMEOUT
# (seconds per job, default 120), KEEP (a directory for the output of each failed run, default a new
# temporary one, named at the end), and anything the ranks should see (GRPC_ENABLE_FORK_SUPPORT, ...).
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
JOB_TIMEOUT=${JOB_TIMEOUT:-120}
RUNS=${1:-20}
shift $(($# > 0 ? 1 : 0))
SCRIPT=$PWD/tests/multiproc/fork_children.py
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CASES=("$@")
if [ ${#CASES[@]} -eq 0 ]; then
    CASES=(
        dataloader/fork-server dataloader/spawn dataloader/torchrun
        ddp/fork-server ddp/spawn ddp/torchrun
        executor/fork-server executor/spawn executor/torchrun
        pool/fork-server pool/spawn pool/torchrun
        fork-exit/fork-server fork-exit/spawn
        child-calls/fork-server child-sigterm/fork-server
    )
fi

BUSY=()
start_busy() {
    for _ in 1 2; do
        "$PYTHON" -c 'while True: pass' &
        BUSY+=($!)
    done
}
stop_busy() {
    for pid in "${BUSY[@]}"; do
        kill "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    BUSY=()
}
trap stop_busy EXIT

LOG=$(mktemp -d)
KEEP=${KEEP:-$(mktemp -d)}
mkdir -p "$KEEP"
# One job; prints "ok", or "FAIL: <why>".
# The processes (ranks, workers, servers) of the job tagged $1: every one inherits its environment.
tagged() {
    grep -lsa "^FORK_STRESS_TAG=$1\$" -z /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
}
run_once() {
    local scenario=$1 launcher=$2 out=$LOG/out rc tag="$$-$RANDOM$RANDOM"
    if [ "$launcher" = torchrun ]; then
        env -u COLLSVC_COORDINATOR FORK_STRESS_TAG="$tag" OMP_NUM_THREADS=1 timeout -k 5 "$JOB_TIMEOUT" "$PYTHON" -m torch.distributed.run \
            --standalone --nproc-per-node 2 "$SCRIPT" "$scenario" >"$out" 2>&1 </dev/null
    else
        env FORK_STRESS_TAG="$tag" timeout -k 5 "$JOB_TIMEOUT" "$PYTHON" -m collsvc run -n 2 --start-method "$launcher" \
            "$SCRIPT" "$scenario" >"$out" 2>&1 </dev/null
    fi
    rc=$?
    # Whatever of the job outlived it (a worker left under PID 1), given 2 s to finish dying: counted,
    # then killed.
    local left tries=0
    left=$(tagged "$tag")
    while [ -n "$left" ] && [ $tries -lt 20 ]; do
        sleep 0.1
        tries=$((tries + 1))
        left=$(tagged "$tag")
    done
    if [ -n "$left" ]; then
        kill -9 $left 2>/dev/null
        echo "FAIL: processes left after the job: $(echo $left)"
        return
    fi
    if [ $rc -ne 0 ]; then
        echo "FAIL: exit $rc: $(grep -m1 -E 'Error|Abort|Segmentation|killed|FAILED|RAW:' "$out" | cut -c1-200)"
    elif [ "$(grep -oE 'OK [01]' "$out" | sort -u | wc -l)" -ne 2 ]; then  # torchrun's ranks share one pipe: "OK 0OK 1"
        echo "FAIL: no OK from every rank"
    else
        echo ok
    fi
}

printf '%-26s %5s %14s %14s\n' case runs "failed (quiet)" "failed (busy)"
for case in "${CASES[@]}"; do
    scenario=${case%/*}
    launcher=${case#*/}
    quiet=0
    busy=0
    for ((i = 1; i <= RUNS; i++)); do
        if [ $i -eq $((RUNS / 2 + 1)) ]; then start_busy; fi
        result=$(run_once "$scenario" "$launcher")
        if [ "$result" != ok ]; then
            if [ $i -le $((RUNS / 2)) ]; then quiet=$((quiet + 1)); else busy=$((busy + 1)); fi
            echo "    $case run $i: $result" >&2
            cp "$LOG/out" "$KEEP/${scenario}-${launcher}-run$i.txt"
        fi
    done
    stop_busy
    printf '%-26s %5d %8d/%-5d %8d/%-5d\n' "$case" "$RUNS" "$quiet" $((RUNS / 2)) "$busy" $((RUNS - RUNS / 2))
done
rm -rf "$LOG"
echo "output of the failed runs: $KEEP" >&2
