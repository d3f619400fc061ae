"""``collsvc coordinator``, ``status``, ``health``, and ``run`` with real coordinators."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli._util import HOST, cli_env, run_cli, script, summary_lines

pytest.importorskip("collsvc.server.app", reason="the coordinator server is not written yet")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Daemon:
    """A ``collsvc coordinator`` process on port 0; ``address`` is read from its ready line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "collsvc", "coordinator", "--port", "0", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=cli_env(),
        )
        self._watchdog = threading.Timer(120.0, self.proc.kill)
        self._watchdog.start()
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline().decode()
        match = re.fullmatch(r"collsvc coordinator listening on (127\.0\.0\.1:(\d+))\n", line)
        assert match, f"unexpected first line {line!r}"
        self.address, self.port = match.group(1), int(match.group(2))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.communicate(timeout=20)
        finally:
            self._watchdog.cancel()
            self.proc.kill()
        return self.proc.returncode


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon()
    yield d
    d.stop()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("the-secret\n")
    return path


def test_coordinator_stops_cleanly_on_sigterm() -> None:
    assert Daemon().stop() == 0


def test_second_coordinator_on_the_same_port_fails_fast(daemon: Daemon) -> None:
    res = run_cli("coordinator", "--port", str(daemon.port), timeout=30)
    assert res.returncode == 1
    assert len(res.lines("stderr")) == 1 and "already in use" in res.stderr
    assert res.seconds < 10


def test_non_loopback_without_auth_exits_2() -> None:
    res = run_cli("coordinator", "--host", "0.0.0.0", "--port", "0", timeout=30)
    assert res.returncode == 2
    assert len(res.lines("stderr")) == 1
    for flag in ("--token-file", "--tls-cert", "--insecure"):
        assert flag in res.stderr


def test_incomplete_tls_flags_exit_2(tmp_path: Path) -> None:
    res = run_cli("coordinator", "--port", "0", "--tls-cert", str(tmp_path / "c.pem"), timeout=30)
    assert res.returncode == 2 and "--tls-key" in res.stderr


def test_health_serving(daemon: Daemon) -> None:
    res = run_cli("health", "--coordinator", daemon.address, timeout=30)
    assert (res.returncode, res.stdout) == (0, "SERVING\n")


def test_health_unknown_service(daemon: Daemon) -> None:
    res = run_cli("health", "--coordinator", daemon.address, "--service", "nope", timeout=30)
    assert res.returncode == 1


def test_health_and_status_unreachable_exit_1_quickly() -> None:
    port = closed_port()
    for command in ("health", "status"):
        res = run_cli(command, "--coordinator", f"127.0.0.1:{port}", "--timeout", "3", timeout=30)
        assert res.returncode == 1, command
        assert len(res.lines("stderr")) == 1 and "unreachable" in res.stderr
        assert res.seconds < 10


def test_status_without_jobs(daemon: Daemon) -> None:
    res = run_cli("status", "--coordinator", daemon.address, timeout=30)
    assert (res.returncode, res.stdout.strip()) == (0, "no jobs")
    res = run_cli("status", "--coordinator", daemon.address, "--json", timeout=30)
    assert json.loads(res.stdout) == {"jobs": []}


def test_status_with_a_wrong_token_exits_1(token_file: Path, tmp_path: Path) -> None:
    d = Daemon("--token-file", str(token_file))
    try:
        wrong = tmp_path / "wrong"
        wrong.write_text("nope")
        res = run_cli("status", "--coordinator", d.address, "--token-file", str(wrong), timeout=30)
        assert res.returncode == 1 and "token" in res.stderr
        ok = run_cli("status", "--coordinator", d.address, "--token-file", str(token_file), timeout=30)
        assert ok.returncode == 0, ok.stderr
        # the health service needs no token (load balancers probe it)
        assert run_cli("health", "--coordinator", d.address, timeout=30).returncode == 0
    finally:
        d.stop()


STATUS_JOB = """
import json, subprocess, sys
import collsvc
comm = collsvc.init()
comm.barrier()
if comm.rank == 0:
    out = subprocess.run([sys.executable, "-m", "collsvc", "status", "--json", "--job", "j7"],
                         capture_output=True, text=True, timeout=30)
    print("STATUS", out.returncode, json.dumps(json.loads(out.stdout)) if out.returncode == 0 else out.stderr)
comm.barrier()
comm.close()
"""


def test_status_of_a_running_multi_node_job(token_file: Path, tmp_path: Path) -> None:
    d = Daemon("--token-file", str(token_file))
    try:
        path = script(tmp_path, "job.py", STATUS_JOB)
        args = [
            "--coordinator",
            d.address,
            "--token-file",
            str(token_file),
            "--job-id",
            "j7",
            "--nnodes",
            "2",
        ]
        node1 = subprocess.Popen(
            [sys.executable, "-m", "collsvc", "run", *args, "--node-rank", "1", "-n", "2", path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=cli_env(COLLSVC_HOST="otherhost"),
        )
        # rank 0 passes the coordinator to its own `collsvc status` through COLLSVC_COORDINATOR/_TOKEN
        try:
            res = run_cli("run", *args, "--node-rank", "0", "-n", "2", path, timeout=90)
            out1, err1 = node1.communicate(timeout=60)
        finally:
            node1.kill()
            node1.wait()
    finally:
        d.stop()
    assert res.returncode == 0, res.stderr
    assert node1.returncode == 0, err1.decode()
    line = next(line for line in res.lines("stdout") if "STATUS" in line)
    assert line.startswith("[rank 0] STATUS ")
    _, rc, payload = line.removeprefix("[rank 0] ").split(" ", 2)
    assert rc == "0", payload
    (job,) = json.loads(payload)["jobs"]
    assert job["job_id"] == "j7" and job["world_size"] == 4 and job["state"] == "running"
    members = {m["rank"]: m for m in job["members"]}
    assert sorted(members) == [0, 1, 2, 3]
    assert [members[r]["host"] for r in range(4)] == [HOST, HOST, "otherhost", "otherhost"]
    assert [members[r]["node_rank"] for r in range(4)] == [0, 0, 1, 1]
    assert sorted(line for line in out1.decode().splitlines() if "STATUS" in line) == []
    assert all(m["state"] == "alive" for m in members.values())


def test_run_with_the_embedded_coordinator(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "sum.py",
        """
        import numpy as np
        import collsvc
        comm = collsvc.init()
        total = comm.all_reduce(np.array([comm.rank + 1.0]))
        print("sum", comm.rank, comm.size, float(total[0]))
        comm.barrier()
        comm.close()
        """,
    )
    res = run_cli("run", "-n", "3", path, timeout=90)
    assert res.returncode == 0, res.stderr
    assert sorted(line for line in res.lines("stdout") if " sum " in line) == [
        f"[rank {r}] sum {r} 3 6.0" for r in range(3)
    ]


def test_run_embedded_failure_stops_ranks_blocked_in_a_collective(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "fail.py",
        """
        import collsvc
        comm = collsvc.init(timeout=600)
        if comm.rank == 1:
            raise SystemExit("rank 1 gives up")
        comm.barrier()
        """,
    )
    res = run_cli("run", "-n", "3", path, timeout=90)
    assert res.returncode == 1
    assert "[rank 1] rank 1 gives up" in res.lines("stderr")
    # The others either fail because of rank 1 first (named as its victims) or are stopped before that.
    (summary,) = summary_lines(res.stderr)
    assert summary in (
        f"collsvc run: rank 1 on host {HOST} failed: exit code 1",
        f"collsvc run: rank 1 on host {HOST} failed: exit code 1 (rank 0 failed because of it)",
        f"collsvc run: rank 1 on host {HOST} failed: exit code 1 (rank 2 failed because of it)",
        f"collsvc run: rank 1 on host {HOST} failed: exit code 1 (ranks 0, 2 failed because of it)",
    ), summary
    assert res.seconds < 30
