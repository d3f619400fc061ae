"""``collsvc run --start-method fork-server`` (the default for Python scripts): ranks forked from one
process that loaded numpy, gRPC and collsvc behave as fresh interpreters would.

Each check runs the same script both ways and compares what the ranks report.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from collsvc.launch import fork_server, parent_watch
from collsvc.launch.fork_server import python_target, script_preloads
from collsvc.launch.forked_ranks import ForkServer
from tests.cli._util import HOST, NOWHERE, cli_env, gone, run_cli, script, start_cli, summary_lines

pytestmark = pytest.mark.skipif(not parent_watch.supported(), reason="the fork server is Linux only")

METHODS = ("fork-server", "spawn")

# What a rank can tell about how it was started; every value but the random draw is the same both ways.
REPORT = """
import atexit, json, os, pickle, sys, threading
import numpy as np

class Local:  # pickled by reference to __main__, as a fresh interpreter's script is
    pass

def facts():
    return {
        "rank": os.environ["COLLSVC_RANK"],
        "argv": sys.argv,
        "file": globals().get("__file__"),
        "name": __name__,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "stdin": sys.stdin.read(),
        "own_session": os.getsid(0) == os.getpid(),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2)[:-1],  # less listdir's
        "pickled": type(pickle.loads(pickle.dumps(Local()))).__module__,
        "main_is_this": sys.modules["__main__"].facts is facts,
        "random": float(np.random.rand()),
    }

# atexit handlers and non-daemon threads run at the end, as the interpreter runs them.
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: print("thread ran", flush=True)).start()
if __name__ == "__main__":
    print("FACTS " + json.dumps(facts()), flush=True)
"""


def reports(stdout: str) -> dict[str, dict[str, object]]:
    found = [json.loads(line.split("FACTS ", 1)[1]) for line in stdout.splitlines() if "FACTS " in line]
    return {str(entry["rank"]): entry for entry in found}


def test_python_target_takes_scripts_and_modules_only() -> None:
    assert python_target([sys.executable, "train.py", "--lr", "1"]) == ["train.py", "--lr", "1"]
    assert python_target([sys.executable, "-m", "pkg.main", "x"]) == ["-m", "pkg.main", "x"]
    assert python_target([sys.executable, "-u", "train.py"]) is None  # interpreter options: spawn
    assert python_target(["/other/python", "train.py"]) is None
    assert python_target([sys.executable, "-m"]) is None
    assert python_target([sys.executable]) is None


def test_the_server_loads_the_torch_modules_a_script_imports_at_its_top(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "uses_torch.py",
        """
        import os
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel
        try:
            import collsvc.torch
        except ImportError:
            pass
        import numpy, torchvision_lookalike
        def later():
            import torch.fx  # not at the top: loaded when called
        """,
    )
    wrappers_import_dynamo = ["torch.distributed", "torch.nn.parallel", "collsvc.torch", "torch._dynamo"]
    assert script_preloads([sys.executable, path]) == wrappers_import_dynamo
    assert script_preloads([sys.executable, "-m", "pkg"]) == []
    with pytest.MonkeyPatch.context() as patch:  # on a GPU host each rank loads torch itself
        patch.setattr(fork_server, "nvidia_gpu_present", lambda: True)
        assert script_preloads([sys.executable, path]) == []
    assert script_preloads([sys.executable, str(tmp_path / "missing.py")]) == []
    assert script_preloads(["bash", path]) == []


@pytest.mark.skipif(fork_server.nvidia_gpu_present(), reason="on a GPU host each rank loads torch itself")
def test_a_torch_script_finds_torch_loaded(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = script(
        tmp_path,
        "torch_first.py",
        """
        import sys
        print("TORCH_LOADED", "torch" in sys.modules, flush=True)
        import torch
        print("SUM", int(torch.ones(3).sum()), flush=True)
        """,
    )
    for method, loaded in (("fork-server", "True"), ("spawn", "False")):
        res = run_cli("run", "-n", "2", "--coordinator", NOWHERE, "--start-method", method, path, timeout=120)
        assert res.returncode == 0, res.stderr
        assert sorted(res.lines("stdout")) == sorted(
            [f"[rank {r}] TORCH_LOADED {loaded}" for r in (0, 1)] + [f"[rank {r}] SUM 3" for r in (0, 1)]
        )


def test_a_forked_rank_sees_what_a_fresh_interpreter_sees(tmp_path: Path) -> None:
    path = script(tmp_path, "report.py", REPORT)
    seen = {}
    for method in METHODS:
        res = run_cli("run", "-n", "2", "--coordinator", NOWHERE, "--start-method", method, path, "a", "--b")
        assert res.returncode == 0, res.stderr
        assert res.stdout.count("atexit ran") == 2 and res.stdout.count("thread ran") == 2, res.stdout
        seen[method] = reports(res.stdout)
    forked, spawned = seen["fork-server"], seen["spawn"]
    assert sorted(forked) == sorted(spawned) == ["0", "1"]
    for rank in forked:
        assert forked[rank]["argv"] == [path, "a", "--b"]
        assert forked[rank]["name"] == "__main__" and forked[rank]["pickled"] == "__main__"
        assert forked[rank]["main_is_this"] and forked[rank]["own_session"] and forked[rank]["stdin"] == ""
        assert {k: v for k, v in forked[rank].items() if k != "random"} == {
            k: v for k, v in spawned[rank].items() if k != "random"
        }
    # numpy's global generator is seeded per process, as in fresh interpreters, not copied from the server.
    assert forked["0"]["random"] != forked["1"]["random"]


def test_a_module_runs_as_with_python_dash_m(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(REPORT)
    seen = {}
    for method in METHODS:
        res = run_cli(
            "run", "-n", "2", "--coordinator", NOWHERE, "--start-method", method, "-m", "pkg.main", "x", cwd=tmp_path
        )
        assert res.returncode == 0, res.stderr
        seen[method] = reports(res.stdout)
    for rank in ("0", "1"):
        forked, spawned = seen["fork-server"][rank], seen["spawn"][rank]
        assert forked["argv"] == [str(package / "main.py"), "x"]
        assert {k: v for k, v in forked.items() if k != "random"} == {k: v for k, v in spawned.items() if k != "random"}


def test_an_uncaught_error_shows_the_script_s_traceback_and_fails_the_rank(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "fails.py",
        """
        import os
        def inner():
            raise ValueError("bad value on rank " + os.environ["COLLSVC_RANK"])
        if os.environ["COLLSVC_RANK"] == "1":
            inner()
        """,
    )
    tracebacks = {}
    for method in METHODS:
        res = run_cli("run", "-n", "2", "--coordinator", NOWHERE, "--start-method", method, path)
        assert res.returncode == 1
        assert summary_lines(res.stderr) == [f"collsvc run: rank 1 on host {HOST} failed: exit code 1"]
        tracebacks[method] = [line for line in res.lines("stderr") if line.startswith("[rank 1]")]
    traceback = tracebacks["fork-server"]
    assert traceback == tracebacks["spawn"]  # the script's frames only, as a fresh interpreter prints them
    assert traceback[0] == "[rank 1] Traceback (most recent call last):"
    assert traceback[1] == f'[rank 1]   File "{path}", line 6, in <module>'
    assert traceback[-1] == "[rank 1] ValueError: bad value on rank 1"


def test_exit_codes_and_signals_reach_the_launcher(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "ends.py",
        """
        import os, signal, sys, threading
        if os.environ["COLLSVC_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Event().wait()
        """,
    )
    res = run_cli("run", "-n", "2", "--coordinator", NOWHERE, path)
    assert res.returncode == 128 + signal.SIGKILL
    assert summary_lines(res.stderr)[0].startswith(
        f"collsvc run: rank 1 on host {HOST} failed: killed by signal SIGKILL"
    )
    quits = script(tmp_path, "quits.py", "import os, sys\nsys.exit(3 if os.environ['COLLSVC_RANK'] == '0' else 0)\n")
    assert run_cli("run", "-n", "2", "--coordinator", NOWHERE, quits).returncode == 3


def test_a_dead_fork_server_ends_the_job_with_its_ranks(tmp_path: Path) -> None:
    """The server is the ranks' parent: when it dies they die with it, and the launcher reports them killed."""
    path = script(
        tmp_path,
        "waits.py",
        """
        import os, threading
        print("rank", os.environ["COLLSVC_RANK"], "pid", os.getpid(), "server", os.getppid(), flush=True)
        threading.Event().wait()
        """,
    )
    proc = start_cli("run", "-n", "2", "--coordinator", NOWHERE, path)
    watchdog = threading.Timer(60.0, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().decode().split() for _ in range(2)]
        ranks, servers = [int(line[-3]) for line in lines], {int(line[-1]) for line in lines}
        assert len(servers) == 1  # both forked from the one server
        os.kill(servers.pop(), signal.SIGKILL)
        stdout, stderr = proc.communicate()
    finally:
        watchdog.cancel()
    assert proc.returncode == 128 + signal.SIGKILL, stderr
    assert "killed by signal SIGKILL" in summary_lines(stderr.decode())[0]
    assert all(gone(pid, within=3.0) for pid in ranks)


def test_a_rank_the_server_cannot_fork_fails_alone(tmp_path: Path) -> None:
    """fork() failing (no memory or process slots) fails that rank with 127; the server serves on."""
    (tmp_path / "fork_fails_once.py").write_text(
        "import errno, os\n"
        "real_fork = os.fork\n"
        "def fork_fails_once():\n"
        "    os.fork = real_fork\n"
        "    raise OSError(errno.EAGAIN, 'Resource temporarily unavailable')\n"
        "os.fork = fork_fails_once\n"
    )
    env = cli_env(PYTHONPATH=os.pathsep.join([str(tmp_path), cli_env()["PYTHONPATH"]]))
    server = ForkServer(env, preload=["fork_fails_once"])
    started = []
    try:
        command = [sys.executable, "-c", "pass"]
        assert python_target(command) is None  # the server runs scripts and modules only
        with pytest.raises(ValueError):
            server.start(0, command, env)
        ok = script(tmp_path, "ok.py", "print('ran', flush=True)\n")
        started = [server.start(ident, [sys.executable, ok], env) for ident in (1, 2)]
        assert started[0].wait(timeout=60) == 127 and started[0].pid is None
        assert started[1].wait(timeout=60) == 0 and started[1].pid is not None
        assert started[1].stdout.read() == b"ran\n"
    finally:
        server.close()
        for process in started:
            process.stdout.close()
            process.stderr.close()
