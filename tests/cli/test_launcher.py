"""``collsvc run`` process management, with plain scripts that never join a coordinator."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

import collsvc as collsvc_pkg
from collsvc.launch.rank_processes import describe_exit
from collsvc.launch.spec import LaunchSpec, rank_env
from tests.cli._util import HOST, NOWHERE, gone, run_cli, script, start_cli, summary_lines

BLOCK_FOREVER = "import threading; threading.Event().wait()"


def test_prefixes_both_streams_and_passes_arguments(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "echo.py",
        """
        import os, sys
        e = os.environ
        print("out", e["COLLSVC_RANK"], e["COLLSVC_WORLD_SIZE"], e["COLLSVC_LOCAL_RANK"], e["COLLSVC_JOB_ID"],
              e["COLLSVC_COORDINATOR"], e.get("COLLSVC_TOKEN"), repr(sys.argv[1:]))
        print("err", e["COLLSVC_RANK"], file=sys.stderr)
        sys.stdout.buffer.write(b"bad \\xff bytes\\n")
        sys.stdout.write("no newline at the end")
        """,
    )
    res = run_cli(
        "run",
        "-n",
        "3",
        "--coordinator",
        NOWHERE,
        "--job-id",
        "j1",
        path,
        "a",
        "b c",
        "--flag",
        COLLSVC_TOKEN="tok",
    )
    assert res.returncode == 0, res.stderr
    out = res.lines("stdout")
    for rank in range(3):
        mine = [line for line in out if line.startswith(f"[rank {rank}] ")]
        assert mine == [
            f"[rank {rank}] out {rank} 3 {rank} j1 {NOWHERE} tok ['a', 'b c', '--flag']",
            f"[rank {rank}] bad \ufffd bytes",
            f"[rank {rank}] no newline at the end",
        ]
        assert f"[rank {rank}] err {rank}" in res.lines("stderr")
    assert len(out) == 9  # every line prefixed, none lost or merged
    assert summary_lines(res.stderr) == []


def test_all_ranks_succeed_exits_zero(tmp_path: Path) -> None:
    res = run_cli("run", "-n", "2", "--coordinator", NOWHERE, script(tmp_path, "ok.py", "print('hi')"))
    assert res.returncode == 0
    assert sorted(res.lines("stdout")) == ["[rank 0] hi", "[rank 1] hi"]


def test_failing_rank_stops_the_others_and_is_named(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "fail.py",
        f"""
        import os, sys
        if os.environ["COLLSVC_RANK"] == "1":
            print("boom", file=sys.stderr)
            sys.exit(3)
        {BLOCK_FOREVER}
        """,
    )
    res = run_cli("run", "-n", "3", "--coordinator", NOWHERE, path, timeout=30)
    assert res.returncode == 3
    assert "[rank 1] boom" in res.lines("stderr")
    assert summary_lines(res.stderr) == [f"collsvc run: rank 1 on host {HOST} failed: exit code 3"]
    assert res.lines("stderr")[-1].startswith("collsvc run:")  # the summary comes after the ranks' output
    assert res.seconds < 5.0, "the blocked siblings were not stopped promptly"


def test_rank_killed_by_signal(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "kill.py",
        f"""
        import os, signal
        if os.environ["COLLSVC_RANK"] == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        {BLOCK_FOREVER}
        """,
    )
    res = run_cli("run", "-n", "2", "--coordinator", NOWHERE, path, timeout=30)
    assert res.returncode == 128 + 9
    assert summary_lines(res.stderr) == [f"collsvc run: rank 0 on host {HOST} failed: killed by signal SIGKILL (9)"]
    assert res.seconds < 5.0


def test_sigterm_ignoring_sibling_and_its_children_are_killed_after_grace(tmp_path: Path) -> None:
    ready = tmp_path / "rank0-ready"
    os.mkfifo(ready)  # rank 1 exits only once rank 0 has started its child and said so
    path = script(
        tmp_path,
        "stubborn.py",
        f"""
        import os, signal, subprocess, sys
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c",
            "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); {BLOCK_FOREVER}"])
        print("child", child.pid, flush=True)
        if os.environ["COLLSVC_RANK"] == "1":
            open({str(ready)!r}).read()  # blocks until rank 0 opened the pipe and closed it again
            sys.exit(7)
        with open({str(ready)!r}, "w") as pipe:
            pipe.write("ready")
        {BLOCK_FOREVER}
        """,
    )
    res = run_cli("run", "-n", "2", "--grace", "0.5", "--coordinator", NOWHERE, path, timeout=30)
    assert res.returncode == 7
    assert summary_lines(res.stderr) == [f"collsvc run: rank 1 on host {HOST} failed: exit code 7"]
    assert res.seconds < 4.0
    children = [int(line.split()[-1]) for line in res.lines("stdout") if " child " in line]
    assert len(children) == 2
    assert all(gone(pid, within=3.0) for pid in children)


def test_sigterm_to_run_is_forwarded(tmp_path: Path) -> None:
    path = script(tmp_path, "up.py", f"print('up', flush=True)\n{BLOCK_FOREVER}\n")
    proc = start_cli("run", "-n", "2", "--coordinator", NOWHERE, path)
    watchdog = threading.Timer(30.0, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        seen = {proc.stdout.readline().decode().strip() for _ in range(2)}
        assert seen == {"[rank 0] up", "[rank 1] up"}
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        watchdog.cancel()
    assert proc.returncode == 128 + signal.SIGTERM
    assert summary_lines(err.decode()) == [f"collsvc run: interrupted by SIGTERM; stopped 2 rank(s) on host {HOST}"]


def test_job_timeout(tmp_path: Path) -> None:
    path = script(tmp_path, "hang.py", BLOCK_FOREVER)
    res = run_cli("run", "-n", "2", "--timeout", "0.5", "--coordinator", NOWHERE, path, timeout=30)
    assert res.returncode == 124
    assert "longer than --timeout 0.5 s" in res.stderr
    assert res.seconds < 5.0


def test_module_mode(tmp_path: Path) -> None:
    (tmp_path / "mymod.py").write_text("import sys\nprint('module', sys.argv[1:])\n")
    res = run_cli("run", "-n", "1", "--coordinator", NOWHERE, "-m", "mymod", "x", "-y", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.lines("stdout") == ["[rank 0] module ['x', '-y']"]


def test_multi_node_ranks_and_token(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "env.py",
        "import os; e = os.environ\n"
        "print(e['COLLSVC_RANK'], e['COLLSVC_LOCAL_RANK'], e['COLLSVC_WORLD_SIZE'], e['COLLSVC_TOKEN'])\n",
    )
    token_file = tmp_path / "token"
    token_file.write_text("  s3cret\n")
    res = run_cli(
        "run",
        "--coordinator",
        NOWHERE,
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "-n",
        "2",
        "--token-file",
        str(token_file),
        path,
    )
    assert res.returncode == 0, res.stderr
    assert sorted(res.lines("stdout")) == ["[rank 2] 2 0 4 s3cret", "[rank 3] 3 1 4 s3cret"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "-n", "2", "does-not-exist.py"], "no such script"),
        (["run", "-n", "2"], "nothing to run"),
        (["run", "-n", "0", "--coordinator", NOWHERE, __file__], "-n must be >= 1"),
        (["run", "--nnodes", "2", "-n", "1", __file__], "--coordinator"),
        (["run", "--coordinator", NOWHERE, "--nnodes", "2", "--node-rank", "2", __file__], "--node-rank"),
    ],
)
def test_usage_errors_exit_2(args: list[str], message: str) -> None:
    res = run_cli(*args, timeout=30)
    assert res.returncode == 2
    assert message in res.stderr
    assert len(res.lines("stderr")) == 1


def test_describe_exit() -> None:
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by signal SIGKILL (9)"
    assert describe_exit(-15) == "killed by signal SIGTERM (15)"


def test_rank_env() -> None:
    spec = LaunchSpec(command=["x"], nproc=4, nnodes=3, node_rank=2, coordinator="h:1", job_id="j")
    env = rank_env({"COLLSVC_TOKEN": "stale", "KEEP": "1"}, spec, "h:1", None, 3)
    assert env["COLLSVC_RANK"] == "11" and env["COLLSVC_WORLD_SIZE"] == "12" and env["COLLSVC_LOCAL_RANK"] == "3"
    assert env["COLLSVC_JOB_ID"] == "j" and env["PYTHONUNBUFFERED"] == "1" and env["KEEP"] == "1"
    assert "COLLSVC_TOKEN" not in env
    assert rank_env({}, spec, "h:1", "t", 0)["COLLSVC_TOKEN"] == "t"
    # ranks import the same collsvc as the launcher, even from a source checkout
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(collsvc_pkg.__file__).resolve().parents[1])
