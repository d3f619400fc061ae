#!/usr/bin/env bash
# Runs one collsvc job with docker compose and reports its outcome: waits until EVERY worker container
# has exited (not just the first, as `up --abort-on-container-exit` does, which can cut rank 0 off
# before it prints its result), prints each worker's exit code, and exits with the job's status:
# 0 when all workers exited 0, else the first non-zero exit code (1 if a worker never ran).
#
#   WORLD_SIZE=4 scripts/compose_job.sh -f docker/compose.yaml
#   scripts/compose_job.sh -f docker/compose.multihost.yaml --profile coordinator   # multi-host, host A
#   scripts/compose_job.sh -f docker/compose.multihost.yaml                         # other hosts
#   scripts/compose_job.sh -f docker/compose.gpu.yaml                               # one GPU host
#   docker compose -f docker/compose.yaml down                                      # afterwards
#
# Arguments are compose's global options (-f, --profile, -p, --env-file). Steps: start the coordinator
# (when this host runs one) and wait until it is healthy, run the worker services (every other active
# service) attached, their logs streaming to the terminal, then read every worker container's exit
# code. The coordinator keeps running for the next job; `docker compose ... down` removes everything.
set -euo pipefail

if (($# == 0)); then
    echo "usage: scripts/compose_job.sh -f COMPOSE_FILE [compose global options]" >&2
    exit 2
fi
compose=(docker compose "$@")

# Worker services: every service of the active profiles but the coordinator (worker, worker-gpu0, ...).
mapfile -t services < <("${compose[@]}" config --services)
worker_services=()
for service in "${services[@]}"; do
    if [[ "$service" == coordinator ]]; then
        "${compose[@]}" up --detach --wait coordinator
    else
        worker_services+=("$service")
    fi
done
if ((${#worker_services[@]} == 0)); then
    echo "job outcome: no worker service in these compose files" >&2
    exit 2
fi
# Attached to the workers only: returns once every worker container has exited.
"${compose[@]}" up --no-deps "${worker_services[@]}"

mapfile -t workers < <("${compose[@]}" ps --all --quiet "${worker_services[@]}")
if ((${#workers[@]} == 0)); then
    echo "job outcome: no worker container ran" >&2
    exit 1
fi
status=0
finished=0
while read -r name state code; do
    echo "worker ${name#/}: ${state}, exit code ${code}"
    if [[ "$state" == exited ]]; then
        finished=$((finished + 1))
        if ((code != 0 && status == 0)); then status=$code; fi
    elif ((status == 0)); then
        status=1
    fi
done < <(docker inspect --format '{{.Name}} {{.State.Status}} {{.State.ExitCode}}' "${workers[@]}")
if ((status == 0)); then
    echo "job outcome: succeeded (${finished} of ${#workers[@]} workers finished, all exit code 0)"
else
    echo "job outcome: FAILED (${finished} of ${#workers[@]} workers finished; job exit code ${status})"
fi
exit "$status"
