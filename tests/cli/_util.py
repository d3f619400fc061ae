"""Helpers for the command-line tests: run ``python -m collsvc`` as a real process, with timeouts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# No coordinator listens here; process-management tests use scripts that never call collsvc.init.
NOWHERE = "127.0.0.1:1"
HOST = "testhost"


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLSVC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["COLLSVC_HOST"] = HOST
    env.update(extra)
    return env


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def lines(self, stream: str) -> list[str]:
        return getattr(self, stream).splitlines()


def run_cli(*args: str, timeout: float = 60.0, cwd: Path | None = None, **env: str) -> Result:
    """Runs ``python -m collsvc ARGS`` to completion (killed after ``timeout``)."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "collsvc", *args],
        capture_output=True,
        timeout=timeout,
        cwd=cwd,
        env=cli_env(**env),
        stdin=subprocess.DEVNULL,
    )
    return Result(
        proc.returncode,
        proc.stdout.decode("utf-8", "replace"),
        proc.stderr.decode("utf-8", "replace"),
        time.monotonic() - start,
    )


def start_cli(*args: str) -> subprocess.Popen[bytes]:
    """Starts ``python -m collsvc ARGS`` with piped stdout and stderr (the caller bounds its life)."""
    return subprocess.Popen(
        [sys.executable, "-m", "collsvc", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=cli_env(),
    )


def script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return str(path)


def summary_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("collsvc run:")]


def gone(pid: int, within: float) -> bool:
    """True when ``pid`` is dead or a zombie, checked until ``within`` seconds pass."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
