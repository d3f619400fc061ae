"""A link shaped down to 10 Mbit/s in the middle of a job slows it and fails nothing.

Two namespaces, one or two ranks each, the coordinator on host "a" next to rank 0 (host b's
heartbeats cross the link too). The ranks all_reduce 1 MiB in a loop over the bulk lane (with two per
host: the hierarchical all_reduce by slices, every rank crossing the link); once they train, both hosts'
outgoing traffic is capped with ``tc tbf`` at 10 Mbit/s for longer than the heartbeat timeout and
the lanes' dead-path limit (5 s), then the cap is lifted. Every step must stay correct, the ranks must
make progress under the cap, and no rank may raise: a slow link is not a dead one.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns import topology
from tests.netns.rank_processes import (
    clean_env,
    failure_with_logs,
    result_of,
    start,
    start_ranks,
    stop,
    wait_training,
)

pytestmark = pytest.mark.netns
TOKEN = "netns-slow-link-token"
STEP_BYTES = 1 << 20
SLOW_RATE = "10mbit"
SLOW_SECONDS = 8.0  # longer than the heartbeat timeout (5 s) and the lanes' dead-path limit (5 s)
START_BOUND = 60.0
END_BOUND = 60.0

reason = topology.available()
if reason:
    pytest.skip(reason, allow_module_level=True)


@pytest.fixture
def hosts() -> Iterator[dict[str, topology.Host]]:
    with topology.hosts(["a", "b"]) as made:
        yield made


def steps_between(output_lines: list[str], start: float, end: float) -> int:
    return sum(1 for line in output_lines if line.startswith("STEP ") and start <= float(line.split()[2]) <= end)


@pytest.mark.parametrize("per_host", [1, 2])
def test_a_link_slowed_to_10_mbit_mid_job_fails_no_one(
    hosts: dict[str, topology.Host], tmp_path: Path, per_host: int
) -> None:
    a, b = hosts["a"], hosts["b"]
    stop_file = tmp_path / "stop"
    base = clean_env()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        coordinator = start(
            [sys.executable, "-m", "collsvc", "coordinator", "--host", a.address, "--port", "29400"],
            a,
            tmp_path / "coordinator.log",
            dict(base, COLLSVC_TOKEN=TOKEN),
        )
        procs.append(coordinator)
        env = dict(base, COLLSVC_COORDINATOR=f"{a.address}:29400", COLLSVC_TOKEN=TOKEN, COLLSVC_JOB_ID="slow-link")
        ranks = start_ranks(["steady", str(STEP_BYTES), str(stop_file)], [a] * per_host + [b] * per_host, env, tmp_path)
        procs.extend(ranks)
        outputs = wait_training(ranks, START_BOUND)
        slowed_at = time.monotonic()
        for host in (a, b):
            host.limit(SLOW_RATE)
        threading.Event().wait(SLOW_SECONDS)  # the slow period itself is what the test measures
        for host in (a, b):
            host.unlimit()
        lifted_at = time.monotonic()
        stop_file.write_text("stop\n")
        results = [result_of(output, lifted_at + END_BOUND) for output in outputs]
        lines = [output.seen for output in outputs]
    except AssertionError as exc:
        raise failure_with_logs(exc, procs, tmp_path) from None
    finally:
        stop(procs)
    slow_steps = steps_between(lines[-1], slowed_at, lifted_at)
    print(f"\n{SLOW_RATE} for {SLOW_SECONDS:g} s: {slow_steps} steps of {STEP_BYTES >> 20} MiB meanwhile; {results}")
    for result in results:
        assert result["error"] is None, result
    assert slow_steps >= 1, "no progress while the link was slow"
