"""Rank processes seen from the process that starts them: how one ended, and waiting for all of them.

``collsvc run`` (collsvc/launch/launcher.py, collsvc/elastic/launch.py) supervises its ranks with
:class:`Supervision`; the benchmarks (``collsvc bench``, benchmarks/compare_gloo.py) start N ranks and
wait for them with :func:`run_ranks`. Standard library only: ``collsvc run`` imports this module
before it starts its ranks.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from collsvc.launch.output import LinePump

if TYPE_CHECKING:
    from collsvc.launch.forked_ranks import ForkedProcess

_STDERR_TAIL_BYTES = 4000  # of a failed rank's stderr, in its error


def describe_exit(returncode: int) -> str:
    """``"exit code 3"`` or ``"killed by signal SIGKILL (9)"`` for a ``Popen.returncode``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    signum = -returncode
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"killed by signal {name} ({signum})"


@dataclasses.dataclass
class RankProcess:
    """One process a launcher started, its output copiers, and its exit status once it ended.

    Attributes:
        rank: the global rank, or an identifier above every rank for a replacement (elastic).
    """

    rank: int
    process: subprocess.Popen[bytes] | ForkedProcess
    pumps: tuple[LinePump, LinePump]
    returncode: int | None = None


@dataclasses.dataclass
class Supervision:
    """One supervision loop: the processes still running, its deadlines, and the first cause of stopping."""

    running: dict[int, RankProcess]
    job_deadline: float | None  # --timeout
    kill_deadline: float | None = None  # SIGTERM was sent: SIGKILL then
    give_up: float | None = None  # SIGKILL was sent: stop waiting for the processes then
    failed: RankProcess | None = None  # the exit that made the launcher stop the job
    stopped_by: int | None = None  # the signal that stopped the launcher
    timed_out: bool = False

    @property
    def stopping(self) -> bool:
        """Whether the launcher is stopping every process (exits from then on are its doing)."""
        return self.kill_deadline is not None or self.give_up is not None

    @property
    def cause_known(self) -> bool:
        """Whether a failure, a signal or the timeout stopped the job already: the first one counts."""
        return self.failed is not None or self.stopped_by is not None or self.timed_out


def wait_ranks(procs: Sequence[subprocess.Popen[bytes]], timeout: float, *, label: str = "rank") -> str:
    """Waits until every process exited 0; returns what process 0 wrote on its stdout (if piped).

    Woken by each process's pipes closing (it ended), so the first failure is reported at once rather
    than after its peers time out waiting for it. On error the other processes are left running
    (:func:`run_ranks` stops them).

    Args:
        procs: rank ``r``'s process at index ``r``, started with ``stderr=subprocess.PIPE``.
        timeout: seconds all of them may take.
        label: what the errors call one process (``"rank"``, ``"gloo rank"``).

    Raises:
        RuntimeError: a process exited non-zero (its stderr's tail is in the message).
        TimeoutError: ``timeout`` seconds passed first (the message names the processes left).
        ValueError: a process was started without ``stderr=subprocess.PIPE``.
    """
    deadline = time.monotonic() + timeout
    stderr_tails = [b""] * len(procs)
    stdout = bytearray()
    open_pipes = [0] * len(procs)
    with selectors.DefaultSelector() as selector:
        for rank, proc in enumerate(procs):
            if proc.stderr is None:
                raise ValueError("wait_ranks needs stderr=subprocess.PIPE")
            pipes = [proc.stderr, *([proc.stdout] if rank == 0 and proc.stdout is not None else [])]
            for pipe in pipes:
                selector.register(pipe.fileno(), selectors.EVENT_READ, (rank, pipe is proc.stderr))
            open_pipes[rank] = len(pipes)
        while selector.get_map():
            ready = selector.select(timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                missing = sorted({key.data[0] for key in selector.get_map().values()})
                raise TimeoutError(f"{label}s {missing} still running after {timeout:.0f} s")
            for key, _ in ready:
                rank, is_stderr = key.data
                chunk = os.read(key.fd, 1 << 16)
                if chunk and is_stderr:
                    stderr_tails[rank] = (stderr_tails[rank] + chunk)[-_STDERR_TAIL_BYTES:]
                elif chunk:
                    stdout += chunk
                else:
                    selector.unregister(key.fd)
                    open_pipes[rank] -= 1
                    if not open_pipes[rank]:
                        _check_exit(procs[rank], f"{label} {rank}", deadline, stderr_tails[rank])
    return stdout.decode(errors="replace")


def _check_exit(proc: subprocess.Popen[bytes], name: str, deadline: float, stderr_tail: bytes) -> None:
    """After ``proc`` closed its pipes: waits for it to exit (1 s of grace even past the deadline).

    Raises:
        RuntimeError: it exited non-zero.
        TimeoutError: it did not exit.
    """
    try:
        returncode = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{name} closed its output but did not exit") from None
    if returncode:
        raise RuntimeError(f"{name} exited {returncode}: {stderr_tail.decode(errors='replace')}")


def run_ranks(argv: Sequence[str], envs: Sequence[Mapping[str, str]], timeout: float, *, label: str = "rank") -> str:
    """Runs one process of ``argv`` per environment (rank ``r`` gets ``envs[r]``) until all exit 0.

    Every process is stopped (SIGKILL) and reaped before this returns or raises, so a failed rank's
    peers, which would wait for it, do not outlive the run.

    Returns:
        What rank 0 wrote on its stdout (the other ranks' stdout is discarded).

    Raises:
        RuntimeError: a rank exited non-zero (the first to do so; its stderr's tail is in the message).
        TimeoutError: ``timeout`` seconds passed first.
        OSError: a process could not be started.
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank, env in enumerate(envs):
            stdout = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
            procs.append(subprocess.Popen(list(argv), env=dict(env), stdout=stdout, stderr=subprocess.PIPE))
        return wait_ranks(procs, timeout, label=label)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
