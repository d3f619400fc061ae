"""A SIGKILLed ``collsvc run`` takes its ranks with it (issue #12, item 5).

Before, the ranks were orphaned to PID 1: with the embedded coordinator they ran on until their
coordinator grace expired (20 s), with an external coordinator for as long as the script ran.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from collsvc.launch import parent_watch
from collsvc.proto.v1 import coordinator_pb2 as pb
from collsvc.proto.v1 import coordinator_pb2_grpc
from tests.cli._util import NOWHERE, cli_env, gone, script
from tests.harness import TOKEN, coordinator

pytestmark = pytest.mark.skipif(not parent_watch.supported(), reason="parent-death signal is Linux only")

# Generous for a loaded 2-core machine; the kernel signals the ranks as the launcher exits.
GONE_WITHIN = 3.0

PLAIN_RANK = """
import os, threading
print("pid", os.getpid(), flush=True)
threading.Event().wait()
"""

# Joins the job, so that the rank holds a coordinator channel and a heartbeat stream, then never ends.
JOINED_RANK = """
import os, threading
import collsvc
comm = collsvc.init(timeout=60)
comm.barrier()
print("pid", os.getpid(), flush=True)
threading.Event().wait()
"""


@contextlib.contextmanager
def launcher(*args: str, **env: str) -> Iterator[tuple[subprocess.Popen[bytes], list[int]]]:
    """Starts ``collsvc run ARGS`` and yields it with the pids its ranks printed ("pid N" each).

    Every process is SIGKILLed at the end, whatever the test found, so that a failure leaks nothing.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "collsvc", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=cli_env(**env),
    )
    watchdog = threading.Timer(60.0, proc.kill)  # a launcher whose ranks never print must not hang us
    watchdog.start()
    pids: list[int] = []
    try:
        nproc = int(args[args.index("-n") + 1])
        assert proc.stdout is not None
        while len(pids) < nproc:
            line = proc.stdout.readline().decode()
            assert line, "the launcher ended before every rank printed its pid"
            if " pid " in line:
                pids.append(int(line.split()[-1]))
        yield proc, pids
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(10)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def kill_and_time_ranks(proc: subprocess.Popen[bytes], pids: list[int]) -> float:
    """SIGKILLs the launcher; returns the seconds until every rank was gone (asserts the bound)."""
    start = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    survivors = [pid for pid in pids if not gone(pid, within=GONE_WITHIN)]
    assert survivors == [], f"ranks {survivors} outlived their SIGKILLed launcher"
    return time.monotonic() - start


def test_plain_ranks_die_with_a_killed_launcher(tmp_path: Path) -> None:
    path = script(tmp_path, "plain.py", PLAIN_RANK)
    with launcher("-n", "3", "--coordinator", NOWHERE, path) as (proc, pids):
        seconds = kill_and_time_ranks(proc, pids)
    print(f"3 plain ranks gone {seconds:.2f}s after the launcher was SIGKILLed")


def test_ranks_die_with_a_killed_launcher_and_its_embedded_coordinator(tmp_path: Path) -> None:
    path = script(tmp_path, "joined.py", JOINED_RANK)
    with launcher("-n", "2", path) as (proc, pids):
        seconds = kill_and_time_ranks(proc, pids)
    print(f"2 joined ranks (embedded coordinator) gone {seconds:.2f}s after the launcher was SIGKILLed")


def test_ranks_of_an_external_coordinator_die_and_the_job_ends(tmp_path: Path) -> None:
    path = script(tmp_path, "joined.py", JOINED_RANK)
    with coordinator(heartbeat_timeout=30.0) as (_, address):
        with launcher("-n", "2", "--coordinator", address, "--job-id", "orphans", path, COLLSVC_TOKEN=TOKEN) as (
            proc,
            pids,
        ):
            seconds = kill_and_time_ranks(proc, pids)
        # The ranks' heartbeat streams broke with them, so the coordinator failed both members and
        # dropped the job (the 30 s heartbeat timeout plays no part).
        with grpc.insecure_channel(address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            deadline = time.monotonic() + 10.0
            while True:
                jobs = stub.GetStatus(pb.GetStatusRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),)).jobs
                if not jobs or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        assert [job.job_id for job in jobs] == []
    print(f"2 joined ranks (external coordinator) gone {seconds:.2f}s after the launcher was SIGKILLed")


def test_a_rank_whose_launcher_died_before_it_started_does_not_run(tmp_path: Path) -> None:
    """The launcher may die between fork and prctl; the rank must then die rather than run orphaned."""
    marker = tmp_path / "ran"
    not_my_parent = os.getpid()  # the child's parent is the test itself, never this "launcher" pid...
    command = parent_watch.wrap_command(
        [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"], launcher_pid=not_my_parent + 1_000_000
    )
    # ...so it takes itself for orphaned: it kills itself before running the command.
    result = subprocess.run(command, timeout=30, capture_output=True)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert not marker.exists()
    # With the right launcher pid the same command runs normally.
    ok = subprocess.run(parent_watch.wrap_command(command[6:], os.getpid()), timeout=30, capture_output=True)
    assert ok.returncode == 0, ok.stderr
    assert marker.exists()


def test_usage_errors_of_the_wrapper() -> None:
    wrapper = parent_watch.wrap_command(["true"], os.getpid())[:4]
    result = subprocess.run([*wrapper, "not-a-pid", "--", "true"], timeout=30, capture_output=True)
    assert result.returncode == 2
    assert b"usage" in result.stderr
    missing = subprocess.run([*wrapper, str(os.getpid()), "--", "/no/such/program"], timeout=30, capture_output=True)
    assert missing.returncode == 127
    assert b"cannot run '/no/such/program'" in missing.stderr
