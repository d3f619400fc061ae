"""``collsvc status --watch``: the live per-job table, against a real job and from plain data."""

from __future__ import annotations

from typing import Any

import numpy as np

import collsvc
from collsvc.observability.live import watch_table
from tests.cli._util import run_cli
from tests.harness import TOKEN, coordinator, run_ranks

KV_WAIT = 60.0


def watched_job(comm: collsvc.Communicator, address: str) -> str:
    """Both ranks run 3 all_reduces; rank 0 runs ``status --watch`` while rank 1 waits in the job."""
    for _ in range(3):
        comm.all_reduce(np.ones(16))
    comm.barrier()
    comm._job.watcher.beat_now()  # progress reaches the coordinator now, not at the next heartbeat
    store = comm.job.store
    if comm.rank == 1:
        store.get("watched", KV_WAIT)
        return ""
    try:
        result = run_cli(
            "status", "--watch", "--count", "3", "--interval", "0.2", "--coordinator", address, COLLSVC_TOKEN=TOKEN
        )
    finally:
        store.set("watched", b"1")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_status_watch_on_a_live_job() -> None:
    with coordinator() as (_, address):
        env = {"COLLSVC_HOST": "watch-host", "COLLSVC_HEARTBEAT_INTERVAL": "0.2"}
        outcome = run_ranks(watched_job, 2, address=address, args=(address,), env=env)
    text = outcome.values[0]
    refreshes = [block for block in text.split("collsvc status --watch ") if block.strip()]
    assert len(refreshes) == 3, text
    assert "steps/s: (next refresh)" in refreshes[0]  # no rate before a second snapshot
    last = refreshes[-1]
    assert "0.0 steps/s" in last and "slowest: none behind" in last  # idle, in lockstep
    # The last call each rank finished: the barrier after 3 all_reduces (world call #4).
    rows = [line.split() for line in last.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [row[0] for row in rows] == ["0", "1"], last
    assert all(row[1] == "watch-host" and row[3] == "4" and row[-1] == "barrier" for row in rows), rows


def member(rank: int, done: int, last: str, started: int | None = None, inside: float = 0.0) -> dict[str, Any]:
    return {
        "rank": rank,
        "host": "h",
        "state": "alive",
        "seconds_since_heartbeat": 0.1,
        "progress": {"group": "world", "started_seq": started or done, "finished_seq": done, "last_op": last},
        "collectives": {"count": done, "seconds": inside},
    }


def job(members: list[dict[str, Any]]) -> dict[str, Any]:
    return {"jobs": [{"job_id": "j", "state": "running", "world_size": 3, "failure": "", "members": members}]}


def test_watch_table_names_a_rank_that_lags() -> None:
    before = job([member(0, 10, "x"), member(1, 10, "x"), member(2, 10, "x")])
    now = job([member(0, 30, "a"), member(1, 30, "a"), member(2, 20, "b", started=21)])
    lines = watch_table(now, before, 2.0).splitlines()
    assert lines[0] == "job j: running, 3/3 ranks, 10.0 steps/s"  # the median rank's rate
    assert lines[1] == "  slowest: rank 2, 10 steps behind (~1.0 s)"
    assert lines[-1].split() == ["2", "h", "alive", "20", "5.0", "0.0", "ms", "0.1s", "b", "(in", "#21)"]
    assert watch_table({"jobs": []}, None, 1.0) == "no jobs"


def test_watch_table_names_the_straggler_in_lockstep() -> None:
    # 20 steps in 2 s; ranks 0 and 1 spent 0.3 s inside collectives (15 ms a step), rank 2 only 0.06 s.
    before = job([member(0, 10, "x", inside=1.0), member(1, 10, "x", inside=1.0), member(2, 10, "x", inside=0.2)])
    now = job([member(0, 30, "a", inside=1.3), member(1, 31, "a", inside=1.31), member(2, 30, "a", inside=0.26)])
    lines = watch_table(now, before, 2.0).splitlines()
    assert lines[1] == "  slowest: rank 2, the others wait ~11.9 ms per step for it"
    assert "in coll./step" in lines[2]
    assert lines[-1].split()[5:7] == ["3.0", "ms"]
