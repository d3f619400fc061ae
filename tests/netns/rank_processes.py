"""Rank and coordinator processes started inside host namespaces, and their output read with deadlines."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.netns import topology

ROOT = Path(__file__).resolve().parents[2]


class Output:
    """A rank's stdout read line by line with a deadline (its own buffer: select() on a file object
    whose buffer already holds the next line would wait for more)."""

    def __init__(self, proc: subprocess.Popen[bytes], who: str) -> None:
        assert proc.stdout is not None
        self._proc, self._fd, self._who = proc, proc.stdout.fileno(), who
        self._buffer = b""
        self.seen: list[str] = []  # every line read so far

    def line_with(self, marker: str, deadline: float) -> str:
        """The next line containing ``marker``, read before ``deadline`` (monotonic).

        Raises:
            AssertionError: the deadline passed or the process ended first.
        """
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                self.seen.append(line.decode(errors="replace"))
                if marker.encode() in line:
                    return self.seen[-1]
            ready, _, _ = select.select([self._fd], [], [], max(deadline - time.monotonic(), 0))
            assert ready, f"{self._who}: no {marker!r} line before the deadline"
            chunk = os.read(self._fd, 65536)
            if not chunk:
                raise AssertionError(f"{self._who}: ended (exit {self._proc.wait(5)}) before printing {marker!r}")
            self._buffer += chunk


def start(argv: list[str], host: topology.Host, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as stderr:  # the child keeps its own descriptor
        return subprocess.Popen(
            host.command(argv), cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr
        )


def dump_stacks(ranks: list[subprocess.Popen[bytes]]) -> None:
    """Asks every rank still running to write its threads' stacks to its log (rank_main registers it)."""
    for proc in ranks:
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
    for proc in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)  # gives the dump time to reach the log; the rank keeps running


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def clean_env() -> dict[str, str]:
    """This process's environment without any ``COLLSVC_*`` variable, with the checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLSVC_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def start_ranks(
    args: list[str], placement: list[topology.Host], env: dict[str, str], log_dir: Path
) -> list[subprocess.Popen[bytes]]:
    """Starts ``tests/netns/rank_main.py ARGS`` as rank r on ``placement[r]``: ``env`` plus the rank, the
    world size, the host name ``host-<name>`` and ``log_dir`` for dumps; stderr to ``log_dir/rank<r>.log``."""
    argv = [sys.executable, str(ROOT / "tests/netns/rank_main.py"), *args]
    ranks = []
    for rank, host in enumerate(placement):
        rank_env = dict(
            env,
            COLLSVC_WORLD_SIZE=str(len(placement)),
            COLLSVC_RANK=str(rank),
            COLLSVC_HOST=f"host-{host.name}",
            COLLSVC_DUMP_DIR=str(log_dir),
        )
        ranks.append(start(argv, host, log_dir / f"rank{rank}.log", rank_env))
    return ranks


def wait_training(ranks: list[subprocess.Popen[bytes]], bound: float) -> list[Output]:
    """The ranks' outputs, once each printed TRAINING (within ``bound`` seconds).

    Raises:
        AssertionError: a rank did not, in time.
    """
    deadline = time.monotonic() + bound
    outputs = [Output(proc, f"rank {rank}") for rank, proc in enumerate(ranks)]
    for output in outputs:
        output.line_with("TRAINING", deadline)
    return outputs


def result_of(output: Output, deadline: float) -> dict[str, Any]:
    """The JSON a rank printed on its RESULT line (before ``deadline``, monotonic)."""
    return json.loads(output.line_with("RESULT ", deadline).split("RESULT ", 1)[1])  # type: ignore[no-any-return]


def failure_with_logs(error: BaseException, procs: list[subprocess.Popen[bytes]], log_dir: Path) -> AssertionError:
    """``error`` retold with the processes' logs: the ranks (``procs`` after the coordinator, the first)
    dump their stacks first, then every process is stopped."""
    dump_stacks(procs[1:])
    stop(procs)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-6000:]}" for p in sorted(log_dir.glob("*.log")))
    return AssertionError(f"{error}\nlogs:\n{logs}")
