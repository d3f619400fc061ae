"""Chaos: ten SIGKILLs of random ranks at random steps in one run; it must end, and end consistent."""

from __future__ import annotations

import random
from pathlib import Path

from tests.elastic._util import run_elastic

KILLS = 10
STEPS = 300


def test_ten_random_kills_never_hang_and_end_with_identical_weights(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    chooser = random.Random(seed)
    steps = sorted(chooser.sample(range(3, STEPS - 3), KILLS))
    kills = ",".join(f"{step}:{chooser.randrange(4)}" for step in steps)
    job = run_elastic(
        tmp_path,
        "-n",
        "4",
        "--min-ranks",
        "1",
        "--max-restarts",
        str(KILLS),
        "--timeout",
        "150",  # the launcher stops a hung job itself (exit 124), so a hang fails the test, not the run
        timeout=180,
        ELASTIC_KILLS=kills,
        ELASTIC_STEPS=str(STEPS),
        ELASTIC_COMMIT_EVERY="3",
        ELASTIC_GROW_TO="4",
    )
    context = f"seed {seed}, kills {kills}\n{job.explain()}"
    assert job.result.returncode == 0, context
    died = [line for line in job.summary if "failed: killed by signal SIGKILL" in line]
    assert len(died) == KILLS, context
    job.assert_consistent(size=4)
    assert job.admitted[0]["step"] >= STEPS, context
