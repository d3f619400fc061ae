"""How a script's end reads to the job: a normal end without ``collsvc.destroy()`` is a clean leave, a
crash is a failure; and a script started without any launcher says how to start it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli._util import cli_env, run_cli, script
from tests.harness import TOKEN, coordinator

WITHOUT_DESTROY = """
    import collsvc
    comm = collsvc.init()
    comm.barrier()
    print("done", comm.rank, flush=True)
    """


def test_a_job_whose_script_never_calls_destroy_ends_without_warnings(tmp_path: Path) -> None:
    res = run_cli("run", "-n", "2", script(tmp_path, "no_destroy.py", WITHOUT_DESTROY), timeout=90)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(res.lines("stdout")) == ["[rank 0] done 0", "[rank 1] done 1"]
    assert "WARNING" not in res.stderr and "failed" not in res.stderr, res.stderr


LOOP = """
    import collsvc
    comm = collsvc.init()
    print("ready", flush=True)
    while True:
        comm.barrier()
    """


def test_ctrl_c_stops_the_job_without_a_failure_per_rank(tmp_path: Path) -> None:
    path = script(tmp_path, "loop.py", LOOP)
    proc = subprocess.Popen(
        [sys.executable, "-m", "collsvc", "run", "-n", "2", path],
        env=cli_env(COLLSVC_DUMP_DIR=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        ready = sorted(proc.stdout.readline().decode().strip() for _ in range(2))  # both ranks joined
        assert ready == ["[rank 0] ready", "[rank 1] ready"], ready
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends the launcher
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.decode()
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert "collsvc run: interrupted by SIGINT" in stderr, stderr
    assert "WARNING" not in stderr and "heartbeat stream closed" not in stderr, stderr


WATCHER = """
    import collsvc
    comm = collsvc.init(timeout=60)
    try:
        comm.barrier()  # rank 1 never enters: it ends after joining
    except collsvc.RankFailedError as exc:
        print("SEEN", exc, flush=True)
    collsvc.destroy()
    """

# How rank 1 ends, right after joining, without calling destroy().
ENDINGS = {
    "returns": "",
    "sys_exit_0": "import sys; sys.exit(0)",
    "keyboard_interrupt": "raise KeyboardInterrupt",
    "uncaught_error": "raise RuntimeError('boom')",
}


@pytest.mark.parametrize(
    ("ending", "expected"),
    [
        # The watcher's barrier runs in shared memory (both ranks on one host): the departure fails it.
        ("returns", "rank 1 (testhost) left the job"),
        ("sys_exit_0", "rank 1 (testhost) left the job"),
        ("keyboard_interrupt", "rank 1 (testhost) left the job"),  # Ctrl-C: the user stopped it on purpose
        ("uncaught_error", "its heartbeat stream closed without leaving the job"),
    ],
)
def test_the_end_of_a_script_without_destroy_is_seen_by_the_others(ending: str, expected: str, tmp_path: Path) -> None:
    ender = script(tmp_path, "ender.py", f"import collsvc\ncomm = collsvc.init(timeout=60)\n{ENDINGS[ending]}\n")
    watcher = script(tmp_path, "watcher.py", WATCHER)
    with coordinator() as (_, address):
        common = {
            "COLLSVC_COORDINATOR": address,
            "COLLSVC_WORLD_SIZE": "2",
            "COLLSVC_TOKEN": TOKEN,
            "COLLSVC_DUMP_DIR": str(tmp_path),
        }
        procs = [
            subprocess.Popen(
                [sys.executable, path],
                env=cli_env(**common, COLLSVC_RANK=str(rank)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
            )
            for rank, path in enumerate((watcher, ender))
        ]
        try:
            outputs = [proc.communicate(timeout=90) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    watcher_out = outputs[0][0].decode()
    assert procs[0].returncode == 0, outputs[0]
    assert "SEEN" in watcher_out and expected in watcher_out, outputs


def test_plain_python_without_a_launcher_suggests_collsvc_run(tmp_path: Path) -> None:
    script(tmp_path, "train.py", "import collsvc\ncollsvc.init()\n")
    env = {
        k: v
        for k, v in cli_env().items()
        if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") and not k.startswith("COLLSVC_")
    }
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: no coordinator given"), done.stderr
    assert "COLLSVC_COORDINATOR" in last and "`collsvc run -n N train.py`" in last, last
