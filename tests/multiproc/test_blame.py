"""Timeouts and cut links name only the ranks at fault, on both transports.

A rank is SIGSTOPped inside a loop of all_reduce calls. Over the gRPC ring the survivors may be one
call apart when it stops (a ring lets a rank finish call k while a neighbour still waits in it); the
one that times out first in call k and leaves must not be named as missing by the others in call
k + 1: it arrived at every call it could, and only the stopped rank never did.

Each case runs ``COLLSVC_BLAME_RUNS`` times (3; docs/operations.md quotes 10, run with
``COLLSVC_BLAME_RUNS=10 pytest --timeout 900``).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import numpy as np
import pytest

import collsvc
from tests.harness import coordinator, run_ranks
from tests.multiproc.test_faults import KV_WAIT, attempt, host_env, kv

STOPPED = 2


def stopped_mid_loop(rank: int, stop_after: float) -> dict[str, Any]:
    """Every rank runs all_reduce in a loop; rank ``STOPPED`` is stopped from a thread after
    ``stop_after`` seconds (so inside some call). The others report what they raised and leave; the
    last of them to finish kills the stopped rank."""
    comm = collsvc.init(timeout=2.0)
    store = kv(comm)
    comm.all_reduce(np.ones(4))
    if comm.rank == STOPPED:
        store.set("pid", str(os.getpid()).encode())
        threading.Timer(stop_after, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    seen: dict[str, Any] = {}
    for _ in range(1_000_000):
        seen = attempt(comm.all_reduce, np.ones(1 << 10))
        if seen["type"] is not None:
            break
    pid = int(store.get("pid", KV_WAIT))
    if store.add("finished", 1) == comm.size - 1:  # every other survivor has its error
        os.kill(pid, signal.SIGKILL)
    collsvc.destroy()  # leaves at once: the others may still wait in the next call
    return seen


def rank_env(transport: str) -> Any:
    """Shared memory on one host, the gRPC ring across one host per rank, or the gRPC ring on one host
    (``COLLSVC_SHM=0``: the cross-host data path where hosts share a machine)."""
    if transport == "grpc-one-host":
        return lambda rank: {**host_env("shm")(rank), "COLLSVC_SHM": "0"}
    return host_env(transport)


@pytest.mark.parametrize("transport", ["shm", "grpc", "grpc-one-host"])
def test_a_timeout_names_only_the_stopped_rank(transport: str) -> None:
    runs = int(os.environ.get("COLLSVC_BLAME_RUNS", "3"))
    for run in range(runs):
        with coordinator(heartbeat_timeout=30.0) as (_, address):
            result = run_ranks(
                stopped_mid_loop,
                4,
                address=address,
                args=(0.3 + 0.1 * run,),
                env={"COLLSVC_JOIN_TIMEOUT": "60"},  # joining on a busy machine is not what is timed
                rank_env=rank_env(transport),
                use_init=False,
                allow_failures=True,
                timeout=180,  # the whole job, startup included, on a busy machine
            )
        for outcome in result.outcomes:
            if outcome.rank == STOPPED:
                continue
            assert outcome.error is None, outcome.error
            seen = outcome.value
            assert seen["type"] == "CollectiveTimeoutError", (run, outcome.rank, seen)
            assert [w["rank"] for w in seen["waiting_on"]] == [STOPPED], (run, outcome.rank, seen)
