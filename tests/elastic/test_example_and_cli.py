"""The elastic example end to end, and the launcher's elastic flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli._util import REPO, run_cli, script


def test_the_example_survives_its_own_rank_dying_and_converges() -> None:
    done = run_cli(
        "run", "-n", "4", "--min-ranks", "2", "--max-restarts", "1", "examples/elastic_train.py", cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 0] loss fell from" in done.stdout, done.stdout
    assert "after the failure" in done.stdout and "4 at first, 3 after" in done.stdout, done.stdout
    assert "weights identical on all" in done.stdout and "ranks: True" in done.stdout, done.stdout
    assert "weights match training in one process without failures: True" in done.stdout, done.stdout
    assert "rank 3 on host testhost failed: killed by signal SIGKILL (9)" in done.stderr, done.stderr


def test_elastic_ddp_example_carries_on_after_a_rank_dies() -> None:
    pytest.importorskip("torch")
    done = run_cli("run", "-n", "3", "--min-ranks", "2", "examples/elastic_ddp.py", cwd=REPO, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 0] trained 60 steps, 2 ranks at the end" in done.stdout, done.stdout
    assert "weights identical on all 2 ranks: True" in done.stdout, done.stdout
    assert "weights match training in one process without failures: True" in done.stdout, done.stdout


def test_min_ranks_must_fit_the_ranks_started(tmp_path: Path) -> None:
    target = script(tmp_path, "noop.py", "pass\n")
    done = run_cli("run", "-n", "2", "--min-ranks", "3", target)
    assert done.returncode == 2, done.stderr
    assert "--min-ranks must be between 1 and -n (2), got 3" in done.stderr
    done = run_cli("run", "-n", "2", "--max-restarts", "-1", target)
    assert done.returncode == 2 and "--max-restarts must be >= 0" in done.stderr, done.stderr


LATE_REPLACEMENT = """
import os, pathlib, signal, sys, time
import collsvc

finished = pathlib.Path(sys.argv[1])
collsvc.init()
if os.environ.get("COLLSVC_ELASTIC_JOIN"):  # the replacement: starts only once the job has finished
    give_up = time.monotonic() + 60
    while not finished.exists() and time.monotonic() < give_up:
        time.sleep(0.05)
state = collsvc.elastic.State(step=0)

@collsvc.elastic.run
def train(comm, state):
    if state.step == 0:
        state.step = 1
        state.commit()
        if comm.size == 3 and comm.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.barrier()
    return comm

comm = train(state)
print(f"past train: rank {comm.rank} of {comm.size}", flush=True)
if comm.rank == 0:
    finished.write_text("done")
"""


def test_a_replacement_admitted_after_the_job_finished_exits_cleanly(tmp_path: Path) -> None:
    """It got None from the decorated function, so the script's next line raised AttributeError."""
    target = script(tmp_path, "late.py", LATE_REPLACEMENT)
    done = run_cli(
        "run", "-n", "3", "--min-ranks", "2", "--max-restarts", "1", target, str(tmp_path / "finished"), timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(line for line in done.stdout.splitlines() if "past train" in line) == [
        "[rank 0] past train: rank 0 of 2",
        "[rank 1] past train: rank 1 of 2",
    ], done.stdout
    assert "had finished before this process was admitted; exiting" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    summary = [line for line in done.stderr.splitlines() if line.startswith("collsvc run: elastic job finished")]
    assert len(summary) == 1 and "1 failed process(es) (rank 2 (killed by signal SIGKILL (9)))" in summary[0], (
        done.stderr
    )
