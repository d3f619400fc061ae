#!/usr/bin/env bash
# Runs the whole conformance product (tests/conformance with COLLSVC_CONFORMANCE=full: every job of
# FULL_CONFIGS, world sizes 1-4 over shared memory, gRPC frames, one host without shared memory and two
# hosts) and prints the counts docs/conformance.md records: cases, passed, failed, seconds, commit.
#
#   scripts/conformance.sh [OUT] [JOB ...]        # OUT: where the per-job JSON reports go (default out/conformance)
#   scripts/conformance.sh out/conformance 2-shm 4-hier    # only these jobs (pytest -k on their ids)
#
# COLLSVC_CONFORMANCE_SEED changes the seeded order in which each job interleaves its cases.
# The CI slice (every axis value, not every combination) is the default `python -m pytest tests/conformance`.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT="${1:-out/conformance}"
shift || true
SELECT=()
if [ "$#" -gt 0 ]; then
  SELECT=(-k "$(printf '%s or ' "$@" | sed 's/ or $//')")
fi
mkdir -p "$OUT"
rm -f "$OUT"/*.json
export PYTHONPATH="${PYTHONPATH:-$PWD}"
START=$(date +%s)
COLLSVC_CONFORMANCE=full COLLSVC_CONFORMANCE_REPORT="$OUT" \
  python -m pytest -q -p no:cacheprovider -o timeout=0 tests/conformance "${SELECT[@]}"
STATUS=$?
END=$(date +%s)
python - "$OUT" "$((END - START))" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" <<'EOF'
import json, pathlib, sys

out, seconds, commit = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "summary.json"]
total = {k: sum(r[k] for r in rows) for k in ("cases", "passed", "failed", "calls")}
print(f"{'job':10} {'cases':>7} {'passed':>7} {'failed':>7} {'jobs':>5} {'seconds':>8}")
for r in rows:
    job = f"{r['world_size']}-{r['transport']}"
    print(f"{job:10} {r['cases']:7} {r['passed']:7} {r['failed']:7} {r['jobs']:5} {r['seconds']:8}")
print(f"{'total':10} {total['cases']:7} {total['passed']:7} {total['failed']:7} {'':5} {seconds:8}  commit {commit}")
for r in rows:
    for case, messages in sorted(r["failures"].items()):
        print(f"FAILED {r['world_size']}-{r['transport']}: {case}: {messages[0][:200]}")
summary = {"commit": commit, "seconds": seconds, **total, "jobs": rows and [
    {k: r[k] for k in ("world_size", "transport", "cases", "passed", "failed", "seconds")} for r in rows]}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
EOF
exit $STATUS
