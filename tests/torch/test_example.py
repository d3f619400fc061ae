"""examples/torch_ddp.py through ``collsvc run``, as the README shows it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_torch_ddp_example_prints_a_falling_loss() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "collsvc", "run", "-n", "2", "examples/torch_ddp.py", "--steps", "30"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    final = [line for line in done.stdout.splitlines() if "loss fell from" in line]
    assert len(final) == 1 and final[0].startswith("[rank 0]"), done.stdout
    words = final[0].split()
    first, last = float(words[words.index("from") + 1]), float(words[words.index("to") + 1])
    assert last < 0.5 * first, final[0]
    assert "(collsvc backend)" in final[0]
