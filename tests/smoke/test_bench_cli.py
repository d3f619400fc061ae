"""The benchmark runners for real.

``collsvc bench`` (embedded coordinator, one process per rank, shared memory): every collective's
result passes ``--check``, and the rows carry the shared protocol's p50 and p99. Three ranks, so
blocked collectives get sizes that are not powers of two. About 2-4 s per run on a 2-core machine.

The wait for rank processes (collsvc/launch/rank_processes.py, which compare_gloo.py uses for gloo's ranks)
reports the first failed rank at once, while its peers still wait (gloo's own peers would wait for
gloo's timeout).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from collsvc.bench.protocol import COLLECTIVES, layout
from collsvc.launch import rank_processes
from tests.cli._util import run_cli

RUN_TIMEOUT = 120.0


@pytest.mark.parametrize("op", COLLECTIVES)
def test_bench_checks_every_collective_and_reports_percentiles(op: str) -> None:
    done = run_cli(
        *("bench", "-n", "3", "--op", op, "--sizes", "4K:16K", "--iters", "4", "--warmup", "1", "--check", "--json"),
        timeout=RUN_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [row["bytes"] for row in rows] == [layout(op, size, 3, 4).count * 4 for size in (4096, 16384)]
    for row in rows:
        assert (row["op"], row["ranks"], row["iters"], row["buffers"]) == (op, 3, 4, 8)
        assert 0 < row["p50"] <= row["p99"]
        assert row["in_place"] == layout(op, 4096, 3, 4).in_place
        assert row["busbw"] > 0 and row["backend"] == "ring"


def test_bench_table_shows_p50_and_p99() -> None:
    done = run_cli("bench", "-n", "2", "--sizes", "4K", "--iters", "3", "--warmup", "1", timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr
    header, row = done.stdout.splitlines()[1:]
    assert "p50(us)" in header and "p99(us)" in header
    assert row.split()[:5] == ["4096", "1024", "float32", "8", "3"]


def test_bench_on_cuda_without_a_gpu_says_so_before_starting_ranks() -> None:
    from collsvc.bench.harness import cuda_unavailable

    if cuda_unavailable() is None:
        pytest.skip("this machine has a GPU CuPy can use")
    done = run_cli("bench", "-n", "2", "--device", "cuda", "--backend", "ring", "--sizes", "4K", timeout=RUN_TIMEOUT)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("collsvc bench: --device cuda needs CuPy and a CUDA GPU:"), done.stderr
    assert "Traceback" not in done.stderr and "rank" not in done.stderr, done.stderr


def test_waiting_for_ranks_reports_the_failed_one_while_its_peer_still_waits() -> None:
    # Rank 0 blocks until its stdin closes (a peer waiting for the failed rank); rank 1 fails.
    waiting = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('gloo error: boom'); sys.exit(3)"]
    procs = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for argv in (waiting, failing)
    ]
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="gloo rank 1 exited 3: gloo error: boom"):
            rank_processes.wait_ranks(procs, 60.0, label="gloo rank")
        assert time.monotonic() - started < 30.0  # not the 60 s timeout
        assert procs[0].poll() is None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def test_waiting_for_ranks_times_out_naming_who_is_left() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        with pytest.raises(TimeoutError, match=r"gloo ranks \[0\] still running"):
            rank_processes.wait_ranks([proc], 0.5, label="gloo rank")
    finally:
        proc.kill()
        proc.communicate()
