"""Processes forked from a rank run as they would without collsvc, and never speak for the rank.

Each check is a real job: ``collsvc run -n 2`` (or torchrun) of tests/multiproc/fork_children.py, whose
rank 1 forks (DataLoader workers, a pool, an executor, ``os.fork()``) after a first barrier; then both
ranks run a collective and a barrier and print ``OK``. Before collsvc kept gRPC's fork handlers off,
workers aborted in gRPC at random (about half the DataLoader runs); before its hooks checked which
process joined, a child's exit or SIGTERM left the job for its rank, failing the other rank every time.
The random failures are measured 20 times each by scripts/stress_fork_children.sh
(docs/operations.md, section 10); here each runs a few times.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from collsvc.launch import parent_watch
from tests.cli._util import REPO, cli_env, run_cli, summary_lines

pytestmark = pytest.mark.skipif(not parent_watch.supported(), reason="collsvc run's ranks: Linux only")
torch = pytest.importorskip("torch")

SCRIPT = str(Path(__file__).with_name("fork_children.py"))
JOB_TIMEOUT = 90.0  # a whole job of two ranks with torch on a loaded 2-core machine takes ~3-10 s


def assert_job_ok(returncode: int, stdout: str, stderr: str) -> None:
    assert returncode == 0, f"exit {returncode}\nstdout:\n{stdout}\nstderr:\n{stderr[-4000:]}"
    # Under torchrun the ranks share one stdout pipe unprefixed, so two ranks' lines may interleave.
    assert set(re.findall(r"OK (\d+)", stdout)) == {"0", "1"}, stdout
    assert "fork_posix.cc" not in stderr  # gRPC's fork handlers stay off


@pytest.mark.parametrize(
    ("scenario", "method", "attempt"),
    [
        ("dataloader", "fork-server", 1),
        ("dataloader", "fork-server", 2),
        ("dataloader", "spawn", 1),
        ("ddp", "fork-server", 1),
        ("executor", "fork-server", 1),
        ("executor", "fork-server", 2),
        ("pool", "fork-server", 1),
        ("pool", "spawn", 1),
        ("fork-exit", "fork-server", 1),
        ("fork-exit", "spawn", 1),
        ("child-calls", "fork-server", 1),
        ("child-sigterm", "fork-server", 1),
    ],
)
def test_a_rank_s_children_run_and_the_job_goes_on(scenario: str, method: str, attempt: int) -> None:
    done = run_cli("run", "-n", "2", "--start-method", method, SCRIPT, scenario, timeout=JOB_TIMEOUT)
    assert not summary_lines(done.stderr), done.stderr
    assert_job_ok(done.returncode, done.stdout, done.stderr)


def test_dataloader_workers_under_torchrun() -> None:
    env = {k: v for k, v in cli_env(OMP_NUM_THREADS="1").items() if k != "COLLSVC_HOST"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, SCRIPT, "dataloader"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=JOB_TIMEOUT,
        stdin=subprocess.DEVNULL,
    )
    assert_job_ok(done.returncode, done.stdout, done.stderr)


def test_import_turns_grpc_fork_handlers_off_unless_the_environment_says() -> None:
    probe = (
        "import os, sys\n"
        "if sys.argv[1] == 'grpc-first': import grpc\n"
        "import collsvc, grpc\n"
        "from collsvc.client import fork_guard\n"
        "print(os.environ['GRPC_ENABLE_FORK_SUPPORT'], fork_guard.grpc_forks())"
    )
    env = {k: v for k, v in cli_env().items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    cases = (
        (None, "collsvc-first", "false False"),
        ("1", "collsvc-first", "1 True"),  # the user's choice stands; joining warns
        (None, "grpc-first", "false True"),  # too late for gRPC, which read it when loaded; joining warns
    )
    for given, order, expected in cases:
        extra = {} if given is None else {"GRPC_ENABLE_FORK_SUPPORT": given}
        done = subprocess.run(
            [sys.executable, "-c", probe, order], capture_output=True, text=True, env={**env, **extra}, timeout=60
        )
        assert done.stdout.strip() == expected, (given, order, done.stderr)


def _in_child(check: Callable[[], bool]) -> bool:
    """Runs ``check`` in a forked child; returns its answer."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child answers through the pipe
        os.write(write, b"1" if check() else b"0")
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    return answer == b"1"


def _refused() -> bool:
    from collsvc.client import fork_guard
    from collsvc.errors import ForkedChildError

    try:
        fork_guard.check_member("a test call")
    except ForkedChildError as exc:
        return "forked from rank process" in str(exc)
    return False


def test_children_of_a_member_are_refused_and_of_another_process_not() -> None:
    from collsvc.client import fork_guard

    assert not _in_child(fork_guard.forked_child)  # nobody joined: a fork changes nothing
    saved = fork_guard._member_pid
    fork_guard.note_member()
    try:
        assert not fork_guard.forked_child()
        assert _in_child(fork_guard.forked_child)
        assert _in_child(_refused)
        assert _in_child(lambda: _in_child(fork_guard.forked_child))  # a grandchild neither
    finally:
        fork_guard._member_pid = saved
