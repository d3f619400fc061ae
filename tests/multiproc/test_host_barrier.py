"""Barriers of groups over several hosts: the members of a host meet in shared memory and one of them
passes a barrier among the hosts' leaders over the data plane for all of them (no coordinator call).
Real ranks, a real coordinator; hosts are told apart by COLLSVC_HOST, as on separate machines."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import collsvc
from tests.harness import coordinator, run_ranks
from tests.observability.test_metrics import scrape, value

KV_WAIT = 30.0  # bound on every key/value wait between ranks


def hosts_env(hosts: str) -> Any:
    """Per-rank environment: rank i runs on host ``hosts[i]`` (``"AABB"``: two hosts of two)."""

    def env(rank: int) -> dict[str, str]:
        return {"COLLSVC_HOST": f"host-{hosts[rank]}", "COLLSVC_HEARTBEAT_INTERVAL": "0.2"}

    return env


def barriers_then_count(comm: collsvc.Communicator, port: int, rounds: int) -> float | None:
    """``rounds`` barriers, each followed by an all_reduce that checks nobody left early; rank 0 then
    reads how many coordinator barrier calls completed in this job."""
    for step in range(rounds):
        comm.barrier()
        total = comm.all_reduce(np.array([step + comm.rank], np.int64))
        assert int(total[0]) == comm.size * step + comm.size * (comm.size - 1) // 2
    store = comm.job.store
    if comm.rank != 0:
        store.get("counted", KV_WAIT)  # stays a member until rank 0 read the metrics
        return None
    samples = scrape(port)
    store.set("counted", b"1")
    return value(samples, "collsvc_barrier_wait_seconds_count", job=comm.job.options.job_id, group="world")


@pytest.mark.parametrize("hosts", ["AABB", "AAAB", "ABC"])
def test_a_barrier_over_hosts_calls_no_coordinator(hosts: str) -> None:
    rounds = 5
    with coordinator(metrics_port=0) as (thread, address):
        outcome = run_ranks(
            barriers_then_count,
            len(hosts),
            address=address,
            args=(thread.metrics_port, rounds),
            rank_env=hosts_env(hosts),
            timeout=90,
        )
    assert not outcome.values[0]  # no coordinator barrier completed (the metric is 0 or absent)


def one_rank_stays_away(comm: collsvc.Communicator, absent: int) -> dict[str, Any]:
    """Every rank but ``absent`` enters a barrier with a 1 s timeout; nobody leaves before all of them
    failed (a member that left would be named too: it left while the others still needed it)."""
    store = comm.job.store
    seen: dict[str, Any] = {}
    if comm.rank != absent:
        try:
            comm.barrier(timeout=1.0)
        except collsvc.CollectiveTimeoutError as exc:
            seen = {"type": "timeout", "ranks": exc.ranks, "message": str(exc)}
        except collsvc.CollsvcError as exc:
            seen = {"type": type(exc).__name__, "message": str(exc)}
        else:
            seen = {"type": None}
        store.set(f"failed/{comm.rank}", b"1")
    for rank in range(comm.size):
        if rank != absent:
            store.get(f"failed/{rank}", KV_WAIT)
    return seen


@pytest.mark.parametrize("absent", [3, 2, 0])  # a member that does not lead its host, one that does, rank 0
def test_a_timeout_names_only_the_member_that_never_came(absent: int) -> None:
    with coordinator() as (_, address):
        outcome = run_ranks(one_rank_stays_away, 4, address=address, args=(absent,), rank_env=hosts_env("AABB"))
    for rank, seen in enumerate(outcome.values):
        if rank == absent:
            continue
        assert seen["type"] == "timeout", (rank, seen)
        assert seen["ranks"] == [absent], (rank, seen)
        assert f"rank {rank}" in seen["message"], (rank, seen)
