"""A running job outlives a coordinator restart on the same address within the grace period.

The coordinator is a real ``collsvc coordinator`` process with a token, SIGKILLed mid-training and
started again 1.5 s later on the same port: the members re-register and the job is rebuilt from them.
Rank 0 talks to the test through two FIFOs: it reports (``ready``, ``resumed``), the test commands
(``restarted``, ``stop``). Collectives run on without the coordinator; barriers wait for it.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collsvc
from tests.harness import run_ranks
from tests.multiproc.test_coordinator_loss import Coordinator, finish, run_in_thread
from tests.multiproc.test_faults import attempt, kv

GRACE = 20.0  # COLLSVC_COORDINATOR_GRACE for these jobs: far longer than a restart takes
DOWNTIME = 1.5  # seconds between the kill and the restart
BOUND = 90.0  # the whole job
SIZE = 3
ENV = {"COLLSVC_COORDINATOR_GRACE": str(GRACE), "COLLSVC_HEARTBEAT_INTERVAL": "0.3"}


class Pipes:
    """Rank 0's report FIFO (rank 0 -> test) and command FIFO (test -> rank 0)."""

    def __init__(self, tmp: Path) -> None:
        self.report_path, self.command_path = str(tmp / "report"), str(tmp / "command")
        os.mkfifo(self.report_path)
        os.mkfifo(self.command_path)
        # The test holds both ends of both FIFOs, so that the rank's opens return at once, and so that a
        # FIFO never reads as ended between two of the rank's writes (select then waits for data).
        self.report = os.open(self.report_path, os.O_RDONLY | os.O_NONBLOCK)
        self.report_keep = os.open(self.report_path, os.O_WRONLY)
        self.command_keep = os.open(self.command_path, os.O_RDONLY | os.O_NONBLOCK)
        self.command = os.open(self.command_path, os.O_WRONLY)
        self._buffer = b""

    def expect(self, word: str, bound: float = 60.0) -> str:
        """Waits (bounded) for the next report line from rank 0, which must start with ``word``."""
        deadline = time.monotonic() + bound
        while b"\n" not in self._buffer:
            readable, _, _ = select.select([self.report], [], [], max(deadline - time.monotonic(), 0))
            assert readable, f"rank 0 never reported {word!r}"
            with contextlib.suppress(BlockingIOError):
                self._buffer += os.read(self.report, 256)
        line, _, self._buffer = self._buffer.partition(b"\n")
        text = line.decode()
        assert text.startswith(word), (word, text)
        return text

    def send(self, word: str) -> None:
        os.write(self.command, f"{word}\n".encode())

    def close(self) -> None:
        for fd in (self.report, self.report_keep, self.command, self.command_keep):
            os.close(fd)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Coordinator]:
    coordinator = Coordinator(tmp_path)
    try:
        yield coordinator
    finally:
        coordinator.stop()


def _report(path: str, text: str) -> None:
    with open(path, "w") as fifo:
        fifo.write(text + "\n")


def train(comm: collsvc.Communicator, report_path: str, command_path: str) -> dict[str, Any]:
    """All-reduce steps with a barrier every 5 steps until the test says stop; sums checked each step.

    Rank 0 relays: ``ready <pids>`` once, and ``resumed`` after the first barrier that follows each
    ``restarted`` command. The stop decision travels inside the all-reduce itself (last element).
    """
    commands = os.open(command_path, os.O_RDONLY | os.O_NONBLOCK) if comm.rank == 0 else -1
    expected = float(sum(range(1, comm.size + 1)))
    pids = comm.all_gather(np.array([os.getpid()], dtype=np.int64))
    if comm.rank == 0:
        _report(report_path, "ready " + ",".join(str(int(p)) for p in pids))
    step, longest, stop, awaiting_barrier = 0, 0.0, 0.0, False
    pending = b""
    while True:
        started = time.monotonic()
        values = np.full(257, comm.rank + 1.0)
        values[-1] = stop
        out = comm.all_reduce(values)
        assert np.all(out[:-1] == expected), (step, out[:4])
        if step % 5 == 4:
            comm.barrier()
            if awaiting_barrier:
                _report(report_path, "resumed")
                awaiting_barrier = False
        longest = max(longest, time.monotonic() - started)
        step += 1
        if out[-1] > 0:
            break
        if comm.rank == 0:
            with contextlib.suppress(BlockingIOError):
                pending += os.read(commands, 64)
            while b"\n" in pending:
                word, _, pending = pending.partition(b"\n")
                if word == b"restarted":
                    awaiting_barrier = True
                elif word == b"stop":
                    stop = 1.0
    comm.barrier()  # one more coordinator round trip after the last restart, on every rank
    return {"steps": step, "longest": longest}


@pytest.mark.parametrize("restarts", [1, 2])
def test_training_outlives_coordinator_restarts(daemon: Coordinator, tmp_path: Path, restarts: int) -> None:
    pipes = Pipes(tmp_path)
    box: dict[str, Any] = {}
    runner = run_in_thread(
        run_ranks, box, train, SIZE, address=daemon.address, args=(pipes.report_path, pipes.command_path),
        env=ENV, timeout=BOUND,
    )  # fmt: skip
    current = daemon
    try:
        pipes.expect("ready")
        for _ in range(restarts):
            current.kill()
            time.sleep(DOWNTIME)  # the outage itself, not a wait for something to happen
            current = Coordinator(tmp_path, port=daemon.port)
            pipes.send("restarted")
            pipes.expect("resumed")
        pipes.send("stop")
        result = finish(runner, box, BOUND + 30)
    finally:
        pipes.close()
        if current is not daemon:
            current.stop()
    assert all(o.exitcode == 0 for o in result.outcomes), result.outcomes
    longest = max(o.value["longest"] for o in result.outcomes)
    print(f"MEASURED {restarts} coordinator restart(s), {DOWNTIME}s down each: longest step {longest:.2f}s")
    assert longest < DOWNTIME + GRACE


def wait_in_barrier(comm: collsvc.Communicator, report_path: str, killed_path: str) -> dict[str, Any]:
    """Ranks 1.. enter a barrier; rank 0 tells the test, and enters only after the coordinator died."""
    store = kv(comm)
    comm.all_reduce(np.ones(4))
    if comm.rank == 0:
        for rank in range(1, comm.size):
            store.get(f"entering/{rank}", 30.0)
        _report(report_path, "ready")
        with open(killed_path) as fifo:  # blocks until the test killed the coordinator
            fifo.read()
    else:
        store.set(f"entering/{comm.rank}", b"1")
    started = time.monotonic()
    comm.barrier()
    waited = time.monotonic() - started
    out = comm.all_reduce(np.full(8, comm.rank + 1.0))
    assert np.all(out == sum(range(1, comm.size + 1)))
    comm.barrier()
    return {"waited": waited}


def test_barrier_half_full_when_the_coordinator_died_completes(daemon: Coordinator, tmp_path: Path) -> None:
    pipes = Pipes(tmp_path)
    killed = tmp_path / "killed"
    os.mkfifo(killed)
    box: dict[str, Any] = {}
    runner = run_in_thread(
        run_ranks, box, wait_in_barrier, SIZE, address=daemon.address, args=(pipes.report_path, str(killed)),
        env=ENV, timeout=BOUND,
    )  # fmt: skip
    again = None
    try:
        pipes.expect("ready")
        daemon.kill()
        with open(killed, "w") as fifo:
            fifo.write("killed")
        time.sleep(DOWNTIME)  # the outage itself
        again = Coordinator(tmp_path, port=daemon.port)
        result = finish(runner, box, BOUND + 30)
    finally:
        pipes.close()
        if again is not None:
            again.stop()
    assert all(o.exitcode == 0 for o in result.outcomes), result.outcomes
    waits = [o.value["waited"] for o in result.outcomes]
    print(f"MEASURED barrier across a coordinator restart: waits {[f'{w:.2f}' for w in waits]}s")


def train_until_failure(comm: collsvc.Communicator, report_path: str, command_path: str) -> dict[str, Any]:
    return attempt(train, comm, report_path, command_path)


def test_rank_killed_while_the_coordinator_is_down_is_detected(daemon: Coordinator, tmp_path: Path) -> None:
    pipes = Pipes(tmp_path)
    box: dict[str, Any] = {}
    runner = run_in_thread(
        run_ranks, box, train_until_failure, SIZE, address=daemon.address,
        args=(pipes.report_path, pipes.command_path), env=ENV, timeout=BOUND, allow_failures=True,
    )  # fmt: skip
    again = None
    try:
        pids = [int(p) for p in pipes.expect("ready").split()[1].split(",")]
        daemon.kill()
        os.kill(pids[2], 9)
        killed_at = time.monotonic()
        time.sleep(DOWNTIME)  # the outage itself
        again = Coordinator(tmp_path, port=daemon.port)
        result = finish(runner, box, BOUND + 30)
    finally:
        pipes.close()
        if again is not None:
            again.stop()
    took = time.monotonic() - killed_at
    assert result.outcomes[2].exitcode != 0
    for outcome in result.outcomes[:2]:
        assert outcome.exitcode == 0, outcome
        error = outcome.value
        assert error["type"] == "RankFailedError", error
        assert 2 in error["ranks"], error
    print(f"MEASURED rank killed while the coordinator was down: survivors done {took:.2f}s after the kill")
