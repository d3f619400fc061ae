"""The README's main job under CPU contention: a short run of scripts/stress_main_job.sh.

The full promise (30 of 30 runs with two busy loops) is the script's default; CI runs a few."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_main_job_passes_every_run_while_busy_loops_compete() -> None:
    done = subprocess.run(
        ["bash", "scripts/stress_main_job.sh", "3", "2", "15"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("stress: 3 passed, 0 failed"), done.stdout
