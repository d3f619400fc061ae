"""A failed job reads as a short story: the rank at fault named, the user's frames, few lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from collsvc.observability.failure_report import Report, at_fault
from tests.cli._util import run_cli, script

STAYS_AWAY = """
    import time
    import numpy as np
    import collsvc

    comm = collsvc.init(timeout=2)
    comm.all_reduce(np.ones(4, np.float32))
    if comm.rank == 1:
        time.sleep(60)  # never enters the second collective; the launcher stops it
    comm.all_reduce(np.ones(4, np.float32))
"""


def test_a_timeout_names_the_absent_rank_in_few_lines(tmp_path: Path) -> None:
    result = run_cli("run", "-n", "3", "--grace", "2", script(tmp_path, "away.py", STAYS_AWAY), timeout=90)
    output = result.stdout + result.stderr
    lines = output.splitlines()
    assert result.returncode == 1, output
    summary = lines[-1]
    assert summary.startswith("collsvc run: rank 1 on host testhost is at fault"), output
    assert "ranks 0, 2 failed because of it" in summary, summary
    assert "all_reduce #2 in group 'world' timed out" in summary, summary
    assert len(lines) <= 40, f"{len(lines)} lines:\n{output}"
    # The user's frame is there, collsvc's internals and chained errors are not.
    assert 'away.py", line 10' in output, output
    assert "collsvc/client" not in output, output
    assert "The above exception was the direct cause" not in output, output
    print(f"MEASURED 3-rank timeout: {len(lines)} lines in all")


def test_debug_shows_the_internal_frames(tmp_path: Path) -> None:
    result = run_cli(
        "run", "-n", "2", "--grace", "2", script(tmp_path, "away.py", STAYS_AWAY), timeout=90, COLLSVC_DEBUG="1"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "collsvc/client/communicator.py" in output, output


MISMATCHED_SHAPES = """
    import numpy as np
    import collsvc

    comm = collsvc.init(timeout=20)
    shape = (2, 3) if comm.rank == 0 else (3, 2)
    comm.all_reduce(np.ones(shape, np.float32))
"""


@pytest.mark.parametrize(("ranks", "shm"), [(2, "1"), (3, "1"), (3, "0")])
def test_a_shape_mismatch_names_both_shapes(tmp_path: Path, ranks: int, shm: str) -> None:
    path = script(tmp_path, "shapes.py", MISMATCHED_SHAPES)
    result = run_cli("run", "-n", str(ranks), "--grace", "2", path, timeout=90, COLLSVC_SHM=shm)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    summary = output.splitlines()[-1]
    assert "collective mismatch at all_reduce #1 in group 'world'" in summary, output
    assert "rank 0 called all_reduce(float32[2, 3], SUM)" in summary, summary
    # Over shared memory every rank's call is named; over gRPC a rank names the first peer it heard from.
    assert "called all_reduce(float32[3, 2], SUM)" in summary, summary
    if shm == "1":
        assert "rank 1 called all_reduce(float32[3, 2], SUM)" in summary, summary


def test_blame_goes_to_the_rank_the_victims_name() -> None:
    timeout = (
        "all_reduce #2 in group 'world' timed out after 2s on rank 0 (the timeout of this call); waiting on rank 1"
    )
    reports = {
        0: Report(0, "CollectiveTimeoutError", timeout, [{"rank": 1, "host": "a"}]),
        2: Report(2, "CollectiveTimeoutError", timeout, [{"rank": 1, "host": "a"}]),
    }
    blame = at_fault(reports, [2, 0, 1])
    assert blame is not None
    assert blame.culprits == {1: "a"} and blame.victims == [0, 2]
    assert blame.who() == "rank 1 on host a" and blame.because() == " (ranks 0, 2 failed because of it)"
    assert blame.story == f"CollectiveTimeoutError: {timeout}"
    # A crash (no report of its own) named by a survivor: the crashed rank is the culprit.
    left = {1: Report(1, "RankFailedError", "rank 3 (b) failed", [{"rank": 3, "host": "b"}])}
    blame = at_fault(left, [3, 1])
    assert blame is not None and blame.culprits == {3: "b"} and blame.victims == [1]
    # Nobody names a cause (a mismatch): no blame; the launcher names the first failed rank.
    assert at_fault({0: Report(0, "CollectiveMismatchError", "mismatch", [])}, [0]) is None
