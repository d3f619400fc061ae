"""Members that leave: never a failure for what they finished, always a fast one for what they did not.

A member that completed collective ``k`` and then left is a failure only for collectives that need it
after ``k``. Over shared memory with three or more ranks, local rank 0 releases the others one at a
time, so a rank released early can finish ``k`` and leave while a later one still waits for its
release: that later rank must complete ``k``, not raise. And a member that exits before its peers'
first collective (cleanly, abruptly or by returning) must fail that collective at once, on every
path, naming the member.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np
import pytest

import collsvc
from collsvc.errors import CollsvcError
from tests.harness import coordinator, run_ranks

HOST = "departures-host"
FAST_HEARTBEAT = {"COLLSVC_HEARTBEAT_INTERVAL": "0.3"}
JOBS = 8  # back-to-back jobs per test run: each one's last collective races the departures
EARLY_EXIT_BOUND = 1.0  # promise: a member gone before the first collective fails it within 1 s


def finish_and_leave(comm: collsvc.Communicator, jobs: int) -> list[list[int]]:
    """Runs ``jobs`` jobs one after another; each ends with a collective and an immediate leave."""
    job_id = os.environ["COLLSVC_JOB_ID"]
    results = []
    for index in range(jobs):
        if index:
            comm = collsvc.init(job_id=f"{job_id}-{index}")
        total = comm.all_reduce(np.full(4, 0b111, np.int32), op=collsvc.BAND)
        results.append(total.tolist())
        collsvc.destroy()
    comm = collsvc.init(job_id=f"{job_id}-last")  # the harness destroys this one
    return results


@pytest.mark.parametrize(("world_size", "transport"), [(4, "shm"), (6, "shm"), (4, "grpc")])
def test_a_member_that_finished_and_left_fails_no_one(world_size: int, transport: str) -> None:
    env = {**FAST_HEARTBEAT, "COLLSVC_HOST": HOST}
    rank_env = None if transport == "shm" else (lambda rank: {"COLLSVC_HOST": f"host{rank}"})
    with coordinator(heartbeat_timeout=2.0, heartbeat_interval=0.3) as (_, address):
        result = run_ranks(
            finish_and_leave, world_size, address=address, args=(JOBS,), env=env, rank_env=rank_env, timeout=120
        )
    for outcome in result.outcomes:
        assert outcome.value == [[0b111] * 4] * JOBS, outcome


def leave_before_the_first_collective(comm: collsvc.Communicator, how: str) -> dict[str, Any] | None:
    """Rank 1 goes away ``how`` before anyone's first collective; the others time that collective."""
    if comm.rank == 1:
        comm.job.store.set("leaving", b"1")
        if how == "destroy":
            collsvc.destroy()
            return None
        sys.stdout.flush()
        os._exit(0)  # "exit": no leave at all; the coordinator sees the stream break
    comm.job.store.get("leaving", 30)
    started = time.monotonic()
    try:
        comm.all_reduce(np.ones(4, np.float32))
    except CollsvcError as exc:
        return {
            "type": type(exc).__name__,
            "ranks": getattr(exc, "ranks", None),
            "message": str(exc),
            "elapsed": time.monotonic() - started,
        }
    return {"type": None, "elapsed": time.monotonic() - started}


@pytest.mark.parametrize("how", ["destroy", "exit"])
@pytest.mark.parametrize(("world_size", "transport"), [(3, "shm"), (2, "shm"), (3, "grpc")])
def test_a_member_gone_before_the_first_collective_fails_it_at_once(how: str, world_size: int, transport: str) -> None:
    env = {**FAST_HEARTBEAT, "COLLSVC_HOST": HOST}
    rank_env = None if transport == "shm" else (lambda rank: {"COLLSVC_HOST": f"host{rank}"})
    with coordinator(heartbeat_timeout=2.0, heartbeat_interval=0.3) as (_, address):
        # Before the fix the survivors waited for the collective timeout (300 s) over shared memory.
        result = run_ranks(
            leave_before_the_first_collective,
            world_size,
            address=address,
            args=(how,),
            env=env,
            rank_env=rank_env,
            allow_failures=True,
            timeout=50,
        )
    for outcome in result.outcomes:
        if outcome.rank == 1:
            continue
        assert outcome.error is None, outcome.error
        seen = outcome.value
        assert seen["type"] == "RankFailedError", seen
        assert seen["ranks"] == [1], seen
        assert seen["elapsed"] < EARLY_EXIT_BOUND, seen
        print(f"MEASURED early {how} ws={world_size} {transport}: {seen['elapsed']:.3f}s: {seen['message']}")
