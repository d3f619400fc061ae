"""The README's main job and the seed examples, end to end through `collsvc run`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "collsvc", "run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_data_parallel_training_converges_to_the_single_process_result() -> None:
    done = run("-n", "4", "examples/train_data_parallel.py", "--epochs", "25")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "[rank 0] loss fell from" in out
    assert "weights identical on all 4 ranks: True" in out
    assert "(matches: True)" in out
    assert "WARNING" not in done.stderr, done.stderr  # a successful job reports nothing to worry about


def test_collectives_tour_matches_the_seed_examples() -> None:
    done = run("-n", "4", "examples/collectives_tour.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 0] all_reduce of [[rank]]             -> [[6.0]]" in done.stdout
    assert "-> [[0], [1], [2], [3]]" in done.stdout
    assert "WARNING" not in done.stderr, done.stderr


def test_hello_prints_every_rank() -> None:
    done = run("-n", "3", "examples/hello.py")
    assert done.returncode == 0, done.stderr
    for rank in range(3):
        assert f"[rank {rank}] rank={rank} size=3 local_rank={rank} node_rank=0" in done.stdout
    assert "WARNING" not in done.stderr, done.stderr
