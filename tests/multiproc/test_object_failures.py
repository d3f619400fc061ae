"""An object collective whose object cannot be pickled tells every rank so: the others' error names the
rank and the pickling failure (before: they went on to the next call and raised a mismatch describing
it, when the failing rank caught its own error), and the group stays usable after."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import collsvc
from tests.harness import coordinator, run_ranks
from tests.multiproc.test_faults import host_env


def _unpicklable() -> Any:
    return threading.Lock()  # "cannot pickle '_thread.lock' object"


def root_fails_to_pickle(comm: collsvc.Communicator, src: int) -> dict[str, Any]:
    import numpy as np

    out: dict[str, Any] = {}
    try:
        comm.broadcast_object({"lock": _unpicklable()} if comm.rank == src else None, src=src)
    except Exception as exc:  # noqa: BLE001 - the root catches its own error and goes on, as the user did
        out["broadcast"] = (type(exc).__name__, str(exc))
    try:
        comm.all_gather_object(_unpicklable() if comm.rank == 1 else comm.rank)
    except Exception as exc:  # noqa: BLE001
        out["all_gather"] = (type(exc).__name__, str(exc))
    # The group stays usable: the next calls agree.
    out["next"] = comm.broadcast_object(("from", src), src=src)
    out["gathered"] = comm.all_gather_object(comm.rank)
    out["sum"] = int(comm.all_reduce(np.array([1], np.int64))[0])
    return out


@pytest.mark.parametrize("transport", ["shm", "grpc"])
@pytest.mark.parametrize("src", [0, 2])
def test_a_failed_pickle_is_told_to_every_rank(transport: str, src: int) -> None:
    n = 3
    with coordinator() as (_, address):
        result = run_ranks(root_fails_to_pickle, n, address=address, args=(src,), rank_env=host_env(transport))
    for rank, value in enumerate(result.values):
        kind, message = value["broadcast"]
        if rank == src:
            assert kind == "TypeError" and "pickle" in message, value
        else:
            assert kind == "CollsvcError", value
            assert f"rank {src}" in message and "could not pickle" in message and "_thread.lock" in message, value
        kind, message = value["all_gather"]
        if rank == 1:
            assert kind == "TypeError", value
        else:
            assert kind == "CollsvcError" and "rank 1" in message and "_thread.lock" in message, value
        assert value["next"] == ("from", src) and value["gathered"] == list(range(n)) and value["sum"] == n
