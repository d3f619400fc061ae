"""Promise 5: losing the coordinator for good ends every member with a typed error, in bounded time.

The coordinator runs as its own process (``python -m collsvc coordinator --port 0``) so that it can be
SIGKILLed like a crashed daemon. Ranks learn of the loss from their heartbeat watcher after
``COLLSVC_COORDINATOR_GRACE`` seconds (3 s here, default 20 s); a coordinator call waiting meanwhile
(rank 0's barrier) fails with the same error. A coordinator restarted within the grace period takes
the job back: see test_coordinator_restart.py.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collsvc
from tests.harness import TOKEN, JobResult, run_ranks
from tests.multiproc.test_faults import attempt, kv

REPO = Path(__file__).resolve().parents[2]
GRACE = 3.0
BOUND = 30.0  # promise 5: every member fails within 30 s (much less with a short grace)
KV_WAIT = 30.0


class Coordinator:
    """A coordinator daemon process on 127.0.0.1 (a fixed port once known, so it can be restarted)."""

    def __init__(self, tmp: Path, port: int = 0, extra: tuple[str, ...] = ()) -> None:
        token = tmp / "token"
        token.write_text(TOKEN)
        env = {k: v for k, v in os.environ.items() if not k.startswith("COLLSVC_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "collsvc", "coordinator", "--port", str(port), "--token-file", str(token), *extra],
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # ends at EOF if the daemon dies: the assert below reports it
            if "collsvc coordinator listening on " in line:
                self.address = line.rsplit(" ", 1)[1].strip()
                break
        else:
            raise AssertionError(f"coordinator did not start (exit code {self.proc.wait(10)})")
        self.port = int(self.address.rsplit(":", 1)[1])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Coordinator]:
    coordinator = Coordinator(tmp_path)
    try:
        yield coordinator
    finally:
        coordinator.stop()


def block_until_coordinator_dies(comm: collsvc.Communicator, ready_fifo: str) -> dict[str, Any]:
    """Every rank finishes one collective; rank 0 tells the parent; then all wait in another one."""
    comm.all_reduce(np.ones(4))
    store = kv(comm)
    store.set(f"ready/{comm.rank}", b"1")
    if comm.rank == 0:
        for rank in range(comm.size):
            store.get(f"ready/{rank}", KV_WAIT)
        with open(ready_fifo, "w") as fifo:  # the parent waits on this FIFO, then kills the daemon
            fifo.write("ready")
    started = time.monotonic()
    # A collective that cannot finish (rank 0 never enters it) so every rank is mid-call when the
    # coordinator goes; its own timeout (init default 300 s) is far beyond the bound.
    blocked = attempt(comm.barrier) if comm.rank == 0 else attempt(comm.all_reduce, np.ones(4))
    blocked["since_ready"] = time.monotonic() - started
    later = attempt(comm.all_reduce, np.ones(4))
    return {"blocked": blocked, "later": later}


def _wait_for_ready(fd: int, bound: float) -> None:
    readable, _, _ = select.select([fd], [], [], bound)
    assert readable and os.read(fd, 16) == b"ready", "ranks never became ready"


def run_in_thread(target: Any, box: dict[str, Any], *args: Any, **kwargs: Any) -> threading.Thread:
    """Starts ``target(*args, **kwargs)`` on a thread; its result lands in ``box["result"]``, or what it
    raised in ``box["error"]`` (handed to the test thread by :func:`finish`)."""

    def body() -> None:
        try:
            box["result"] = target(*args, **kwargs)
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    return thread


def finish(runner: threading.Thread, box: dict[str, Any], bound: float) -> JobResult:
    """The JobResult of the job :func:`run_in_thread` runs, once it ended (within ``bound`` seconds)."""
    runner.join(bound)
    assert not runner.is_alive(), "the job never ended"
    assert "error" not in box, box.get("error")
    result: JobResult = box["result"]
    return result


def run_and_kill_when_ready(
    daemon: Coordinator, ready: Path, fn: Any, args: tuple[Any, ...], env: dict[str, str]
) -> tuple[JobResult, float]:
    """Runs ``fn(comm, str(ready), *args)`` on 3 ranks of ``daemon``; once a rank writes "ready" into
    the FIFO ``ready``, SIGKILLs the daemon. Returns (the ranks' JobResult, when the daemon was killed)."""
    os.mkfifo(ready)
    fd = os.open(ready, os.O_RDONLY | os.O_NONBLOCK)  # opened first, so the rank's open for writing returns
    box: dict[str, Any] = {}
    runner = run_in_thread(
        run_ranks, box, fn, 3, address=daemon.address, args=(str(ready), *args), env=env, timeout=BOUND + 20
    )
    try:
        _wait_for_ready(fd, 30.0)
    finally:
        os.close(fd)
    killed_at = time.monotonic()
    daemon.kill()
    return finish(runner, box, BOUND + 30), killed_at


def test_coordinator_never_restarted_ends_the_job_naming_it(daemon: Coordinator, tmp_path: Path) -> None:
    env = {"COLLSVC_COORDINATOR_GRACE": str(GRACE), "COLLSVC_HEARTBEAT_INTERVAL": "0.3"}
    result, killed_at = run_and_kill_when_ready(daemon, tmp_path / "ready", block_until_coordinator_dies, (), env)
    took = time.monotonic() - killed_at
    for outcome in result.outcomes:
        blocked, later = outcome.value["blocked"], outcome.value["later"]
        assert blocked["type"] == "RendezvousError", (outcome.rank, blocked)
        # Rank 0 waits in a coordinator barrier RPC, which breaks at once and then waits for the
        # coordinator to come back; the others wait for data. All hear from their heartbeat watcher,
        # after the grace period, that the coordinator is gone for good.
        assert "lost the coordinator" in blocked["message"], blocked["message"]
        assert daemon.address in blocked["message"], blocked["message"]
        assert GRACE <= blocked["since_ready"] < BOUND, blocked
        assert later["type"] == "RendezvousError" and later["elapsed"] < 1.0, later
        print(
            f"MEASURED coordinator killed: rank {outcome.rank} "
            f"raised {blocked['since_ready']:.2f}s after the job was ready: {blocked['message']}"
        )
    assert took < BOUND, took
    print(f"MEASURED all ranks finished {took:.2f}s after the coordinator was killed")


def subgroup_times_out_without_the_coordinator(comm: collsvc.Communicator, ready_fifo: str, release_fifo: str) -> Any:
    """Ranks 1 and 2 form a group and run one call in it; once the coordinator is gone, rank 1 enters
    a barrier of that group that rank 2 stays away from (until rank 1 gave up)."""
    sub = comm.new_group([1, 2])
    if sub is not None:
        sub.all_reduce(np.ones(4))  # the group's shared memory is set up while the coordinator lives
    store = kv(comm)
    store.set(f"ready/{comm.rank}", b"1")
    if comm.rank == 0:
        for rank in range(comm.size):
            store.get(f"ready/{rank}", KV_WAIT)
        with open(ready_fifo, "w") as fifo:  # the parent waits on this FIFO, then kills the daemon
            fifo.write("ready")
        return None
    if comm.rank == 2:
        with open(release_fifo) as fifo:  # blocks until rank 1 opens it for writing
            fifo.read()
        return None
    assert sub is not None
    try:
        return attempt(sub.barrier, timeout=1.0)
    finally:
        with open(release_fifo, "w") as fifo:
            fifo.write("done")


def test_a_timeout_without_the_coordinator_names_the_late_rank_by_its_global_rank(
    daemon: Coordinator, tmp_path: Path
) -> None:
    """Who is late then comes from the shared-memory group itself, which numbers its members 0..n-1
    among those on the host: rank 2 is its member 1. The error names global rank 2, not rank 1."""
    release = tmp_path / "release"
    os.mkfifo(release)
    result, _ = run_and_kill_when_ready(
        daemon,
        tmp_path / "ready",
        subgroup_times_out_without_the_coordinator,
        (str(release),),
        {"COLLSVC_COORDINATOR_GRACE": "30"},
    )
    seen = result.outcomes[1].value
    assert seen["type"] == "CollectiveTimeoutError", seen
    assert [w["rank"] for w in seen["waiting_on"]] == [2], seen
    assert "waiting on rank 2 (" in seen["message"], seen["message"]
    # The coordinator is known lost by then: nobody waits for it to say who is missing.
    assert seen["elapsed"] < 5.0, seen
