"""Where the general path puts the results of all_gather, reduce_scatter, gather and all_to_all
(``Operand.result_buffer``): straight into a usable ``out``, and into a temporary when ``out`` overlaps
the input (the input must be read whole before it is overwritten), on shared memory and over gRPC.

Every call here takes the general path: ``async_op=True`` goes through the worker thread, and the
synchronous calls are each the first of their shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collsvc
from collsvc.types import ReduceOp
from tests.harness import coordinator, run_ranks

BLOCK = 70_001  # elements per rank's block: above one shared-memory step, odd


def _both_ways(call: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """The call's result synchronously (the first call of its shape) and with ``async_op=True``."""
    first = call(*args, **kwargs)
    first = first.copy() if isinstance(first, np.ndarray) else first
    work = call(*args, async_op=True, **kwargs)
    assert work.wait()
    return [first, work.result()]


def results_in_out_and_around_overlaps(comm: collsvc.Communicator) -> bool:
    n, me = comm.size, comm.rank
    mine = np.arange(BLOCK, dtype=np.float64) + 1000 * me
    everyone = np.concatenate([np.arange(BLOCK, dtype=np.float64) + 1000 * r for r in range(n)])

    # all_gather into a separate out, and in place (x is this rank's block of out).
    out = np.empty(n * BLOCK)
    for got in _both_ways(comm.all_gather, mine, out=out):
        assert np.array_equal(got, everyone)
    in_place = np.zeros(n * BLOCK)
    in_place[me * BLOCK : (me + 1) * BLOCK] = mine
    own_block = in_place[me * BLOCK : (me + 1) * BLOCK]
    assert comm.all_gather(own_block, out=in_place) is in_place and np.array_equal(in_place, everyone)

    # reduce_scatter into a separate out, and into a view of its own input's first block.
    summed = sum(np.arange(n * BLOCK, dtype=np.float64) * (r + 1) for r in range(n))
    for got in _both_ways(comm.reduce_scatter, np.arange(n * BLOCK, dtype=np.float64) * (me + 1), ReduceOp.SUM):
        assert np.array_equal(got, summed[me * BLOCK : (me + 1) * BLOCK])
    source = np.arange(n * BLOCK, dtype=np.float64) * (me + 1)
    overlapping = source[:BLOCK]
    assert comm.reduce_scatter(source, ReduceOp.SUM, out=overlapping) is overlapping
    assert np.array_equal(overlapping, summed[me * BLOCK : (me + 1) * BLOCK])

    # all_to_all: block r of rank s goes to rank r as block s; out overlapping x is refused or kept apart.
    sent = np.concatenate([np.full(BLOCK, 100.0 * me + r) for r in range(n)])
    expected = np.concatenate([np.full(BLOCK, 100.0 * s + me) for s in range(n)])
    spread = np.empty(n * BLOCK)
    for got in _both_ways(comm.all_to_all, sent, out=spread):
        assert np.array_equal(got, expected)

    # gather onto rank 0, into out there.
    gathered = np.empty(n * BLOCK) if me == 0 else None
    got = comm.gather(mine, 0, out=gathered)
    if me == 0:
        assert got is gathered and np.array_equal(gathered, everyone)
    else:
        assert got is None
    return True


@pytest.mark.parametrize(("world_size", "transport"), [(2, "shm"), (3, "shm"), (3, "grpc")])
def test_general_path_results_land_in_out_and_survive_overlaps(world_size: int, transport: str) -> None:
    rank_env = None if transport == "shm" else (lambda rank: {"COLLSVC_HOST": f"host{rank}"})
    env = {"COLLSVC_HOST": "one-host"} if transport == "shm" else None
    with coordinator() as (_, address):
        result = run_ranks(
            results_in_out_and_around_overlaps, world_size, address=address, env=env, rank_env=rank_env, timeout=120
        )
    assert all(result.values)
