"""Runs a function on N real rank processes against a real coordinator.

- Ranks are started by a fork server (``multiprocessing``'s ``forkserver`` method): a clean process that
  imported numpy, pytest, collsvc's client and, when installed, torch once, and forks each rank from that
  state. It never joins a job nor opens a gRPC channel, so its children start as fresh as ``spawn``'s (gRPC
  does not survive ``fork`` once a channel exists), in ~0.1 s instead of the ~0.5-2 s of CPU a spawned
  rank spends importing (tests/harness.py's three ranks: 1.6 s with ``spawn``, 0.4 s from the fork
  server). A rank's environment is the fork server's (the test process's when it started) plus ``env``.
- Each rank's return value or traceback comes back to the parent through a queue.
- The first failing rank stops every other rank; the parent raises with that rank's traceback.
- On timeout, every rank dumps its Python stacks (faulthandler) before it is killed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from collsvc.options import CoordinatorOptions
from collsvc.server.app import CoordinatorThread

TOKEN = "harness-token"
# What the fork server imports before it forks ranks (a module that is not installed is skipped).
RANK_PRELOAD = [
    "collsvc",  # first: it turns gRPC's fork handlers off before gRPC is imported
    "collsvc._api",
    "collsvc.client.communicator",
    "collsvc.client.backends.ring.backend",
    "collsvc.client.backends.shm",
    "numpy",
    "pytest",
    "tests.harness",
    "torch",
    "torch.distributed",
]


def rank_context() -> Any:
    """The ``multiprocessing`` context that starts rank processes (see the module docstring)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)  # takes effect when the fork server starts, once a session
    return ctx


@dataclass
class RankOutcome:
    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


@dataclass
class JobResult:
    outcomes: list[RankOutcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def values(self) -> list[Any]:
        return [o.value for o in self.outcomes]


class RankFailure(AssertionError):
    """A rank raised; the message holds its traceback."""


@contextlib.contextmanager
def coordinator(**overrides: Any) -> Iterator[tuple[CoordinatorThread, str]]:
    """A real coordinator on 127.0.0.1, port 0; yields (thread, "host:port")."""
    options = CoordinatorOptions(host="127.0.0.1", port=0, token=overrides.pop("token", TOKEN), **overrides)
    thread = CoordinatorThread(options)
    port = thread.start()
    try:
        yield thread, f"127.0.0.1:{port}"
    finally:
        thread.stop()


def _child(
    fn: Callable[..., Any],
    rank: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    use_init: bool,
    results: Any,
    timeout: float,
) -> None:
    os.environ.update(env)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # A rank still running just before the parent gives up dumps its stacks and exits by itself.
    faulthandler.dump_traceback_later(max(timeout - 1.0, 1.0), exit=True)
    try:
        if use_init:
            import collsvc

            comm = collsvc.init()
            try:
                value = fn(comm, *args)
            finally:
                collsvc.destroy()
        else:
            value = fn(rank, *args)
        status, payload, code = "ok", value, 0
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        status, payload, code = "error", traceback.format_exc(), 1
    results.put((rank, status, payload))
    results.close()
    results.join_thread()  # the queue's feeder thread must flush before the hard exit below
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # leftover library threads must not keep a finished rank alive


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    address: str,
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    rank_env: Callable[[int], dict[str, str]] | None = None,
    use_init: bool = True,
    assign_ranks: bool = True,
    allow_failures: bool = False,
    job_id: str | None = None,
) -> JobResult:
    """Runs ``fn(comm, *args)`` (or ``fn(rank, *args)`` with ``use_init=False``) on ``world_size`` ranks.

    Args:
        address: the coordinator's host:port.
        timeout: bound on the whole job; on expiry stacks are dumped and the test fails.
        rank_env: extra environment per rank index.
        assign_ranks: set COLLSVC_RANK per process (else the coordinator assigns ranks).
        allow_failures: collect failed ranks instead of failing fast (fault tests).

    Raises:
        RankFailure: a rank raised (unless ``allow_failures``), or the job timed out.
    """
    ctx = rank_context()
    results: Any = ctx.Queue()
    job = job_id or f"job-{os.getpid()}-{time.monotonic_ns()}"
    procs = []
    start = time.monotonic()
    for rank in range(world_size):
        child_env = {
            "COLLSVC_COORDINATOR": address,
            "COLLSVC_WORLD_SIZE": str(world_size),
            "COLLSVC_LOCAL_RANK": str(rank),
            "COLLSVC_TOKEN": TOKEN,
            "COLLSVC_JOB_ID": job,
            **(env or {}),
            **(rank_env(rank) if rank_env else {}),
        }
        if assign_ranks:
            child_env["COLLSVC_RANK"] = str(rank)
        proc = ctx.Process(target=_child, args=(fn, rank, child_env, args, use_init, results, timeout), daemon=True)
        proc.start()
        procs.append(proc)
    outcomes: dict[int, RankOutcome] = {}
    deadline = start + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _dump_and_kill(procs)
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise RankFailure(f"job timed out after {timeout:g}s; ranks {missing} never finished (stacks above)")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                for index, proc in enumerate(procs):
                    if index not in outcomes and proc.exitcode is not None and results.empty():
                        outcomes[index] = RankOutcome(
                            index,
                            error=f"exited with code {proc.exitcode} without a result",
                            exitcode=proc.exitcode,
                        )
                        if not allow_failures:
                            raise RankFailure(
                                f"rank {index} exited with code {proc.exitcode} without a result"
                            ) from None
                continue
            if status == "ok":
                outcomes[rank] = RankOutcome(rank, value=payload)
            else:
                outcomes[rank] = RankOutcome(rank, error=payload)
                if not allow_failures:
                    raise RankFailure(f"rank {rank} failed:\n{payload}")
    finally:
        for proc in procs:
            proc.join(timeout=max(deadline - time.monotonic(), 5.0))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    for rank, proc in enumerate(procs):
        outcomes[rank].exitcode = proc.exitcode
    return JobResult([outcomes[r] for r in range(world_size)], time.monotonic() - start)


def _dump_and_kill(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive() and proc.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
    for proc in procs:
        proc.join(2.0)  # let faulthandler write the stacks, then kill
        if proc.is_alive():
            proc.kill()
