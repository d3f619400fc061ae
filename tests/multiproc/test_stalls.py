"""A stalled observer blames no one: the coordinator or a rank that was not scheduled for a while
(SIGSTOP/SIGCONT, as ``docker pause``, a CPU-throttled container or a VM migration look) fails no job,
and neither does a rank busy for seconds in one C call that holds the GIL.

The coordinator runs as its own process (tests/multiproc/test_coordinator_loss.py's daemon) so that a
rank can stop and continue it; the stall is the scenario's duration, not a wait.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collsvc
from tests.harness import run_ranks
from tests.multiproc.test_coordinator_loss import Coordinator

KV_WAIT = 30.0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Coordinator]:
    coordinator = Coordinator(tmp_path)
    try:
        yield coordinator
    finally:
        coordinator.stop()


def work_through_a_stall(comm: collsvc.Communicator, pid: int, stall: float, how: str) -> dict[str, Any]:
    """Every rank keeps creating groups (a coordinator call each) and reducing over them; meanwhile
    rank 0 stops ``pid`` (the coordinator) for ``stall`` seconds with ``how="stop"`` (rank 1 with
    ``how="rank"``), or rank 1 spends
    ``stall`` seconds in one C call that holds the GIL with ``how="gil"``. The loop goes on until the
    stall is over and 20 more rounds passed."""
    stalled = threading.Event()
    if how == "rank":  # rank 0 stops rank 1
        pids = comm.all_reduce(np.array([float(os.getpid()) if r == comm.rank else 0.0 for r in range(comm.size)]))
        pid = int(pids[1])
    if how in ("stop", "rank") and comm.rank == 0:

        def stop_and_continue() -> None:
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(stall)  # the stall itself (a paused container), not a wait for something
            finally:
                os.kill(pid, signal.SIGCONT)
                stalled.set()

        threading.Thread(target=stop_and_continue, daemon=True).start()
    rounds, after = 0, 0
    while True:
        rounds += 1
        if how == "gil" and comm.rank == 1 and rounds == 5:
            # One C call that holds the GIL for `stall` seconds, like list.sort of tens of millions of
            # floats or pickling a big checkpoint: libc's sleep called without releasing the GIL.
            ctypes.PyDLL(None).sleep(int(stall))
            stalled.set()
        group = comm.new_group(list(range(comm.size)))
        assert group is not None
        after += int(stalled.is_set())
        done = group.all_reduce(np.array([float(after >= 20)]))
        if done[0] > 0:
            break
    total = comm.all_reduce(np.ones(4)).tolist()
    comm.barrier()
    return {"total": total, "rounds": rounds}


def _expect_healthy(result: Any, world_size: int) -> None:
    for outcome in result.outcomes:
        assert outcome.error is None, f"rank {outcome.rank}: {outcome.error}"
        assert outcome.value["total"] == [world_size] * 4


@pytest.mark.parametrize("stall", [6.0, 10.0])
def test_a_stopped_coordinator_fails_no_job(daemon: Coordinator, stall: float) -> None:
    result = run_ranks(
        work_through_a_stall,
        3,
        address=daemon.address,
        args=(daemon.proc.pid, stall, "stop"),
        env={"COLLSVC_HOST": "stall-host"},
        timeout=60,
    )
    _expect_healthy(result, 3)


def init_against(rank: int, address: str, timeout: float) -> dict[str, Any]:
    """``collsvc.init(timeout=...)`` of rank 0 of 2; what it raised and how long the call took."""
    init = collsvc.init  # imports the client side: not part of the call
    started = time.monotonic()
    try:
        init(coordinator=address, world_size=2, rank=0, timeout=timeout)
    except collsvc.CollsvcError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - started}
    return {"type": None, "elapsed": time.monotonic() - started}


@pytest.mark.parametrize("timeout", [3.0, 10.0])
def test_init_against_a_frozen_coordinator_gives_up_within_its_timeout(daemon: Coordinator, timeout: float) -> None:
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        result = run_ranks(init_against, 1, address=daemon.address, args=(daemon.address, timeout), use_init=False)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    (seen,) = result.values
    assert seen["type"] == "RendezvousError", seen
    assert seen["elapsed"] < timeout + 1.0, seen
    print(f"MEASURED init(timeout={timeout:g}) against a frozen coordinator: {seen['elapsed']:.2f}s")


def test_a_rank_stopped_for_less_than_the_heartbeat_timeout_is_not_failed(daemon: Coordinator) -> None:
    # Its own keepalive must not give up on the coordinator because the rank itself was not running.
    result = run_ranks(
        work_through_a_stall,
        3,
        address=daemon.address,
        args=(0, 3.5, "rank"),
        env={"COLLSVC_HOST": "stall-host"},
        timeout=60,
    )
    _expect_healthy(result, 3)


def test_a_rank_holding_the_gil_longer_than_the_timeout_needs_a_longer_timeout(tmp_path: Path) -> None:
    # A rank's heartbeats are sent by a Python thread: a C call that holds the GIL for 10 s (a huge
    # list.sort, pickling a big checkpoint) silences them, and a 5 s timeout fails the rank
    # (docs/operations.md). A coordinator whose timeout covers the longest such call keeps it.
    patient = Coordinator(tmp_path, extra=("--heartbeat-timeout", "15"))
    try:
        result = run_ranks(
            work_through_a_stall,
            3,
            address=patient.address,
            args=(0, 10.0, "gil"),
            env={"COLLSVC_HOST": "stall-host"},
            timeout=90,
        )
    finally:
        patient.stop()
    _expect_healthy(result, 3)
