"""The fast path for repeated calls larger than one shared-memory step (backends/shm/repeated.py,
``RepeatedChunked*``, ``RepeatedAllToAll``): all_reduce, all_gather and reduce_scatter above 64 KiB,
broadcasts above 256 KiB and all_to_all of every size, on real rank processes.

Each call runs three times (the first learns, the others take the fast path) and must give the bits of
the general path, on every rank; one rank taking the general path (a non-contiguous input) while the
others take the fast path must agree too; a mismatch and a dead peer are named as on the general path.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import collsvc
from collsvc.types import ReduceOp
from tests.harness import coordinator, run_ranks
from tests.multiproc.checks import allowed, assert_close, assert_identical_everywhere, make, np_dtype, reference
from tests.multiproc.test_fast_path import HOST, assert_mismatch_on_every_rank
from tests.multiproc.test_faults import attempt

# Above 64 KiB for every dtype (one uint8 element per byte); odd, so slices split unevenly.
OVER_ONE_STEP = 70_001
# Above one 4 MiB slot of float32: two chunks of the pipeline.
OVER_ONE_SLOT = (4 << 20) // 4 + 12_345
REDUCED_DTYPES = ["bool", "uint8", "int32", "int64", "float16", "float32", "float64", "complex64"]


def _three_times(call: Any) -> list[bytes]:
    """The results of three calls: the first takes the general path, the later ones the fast path."""
    return [np.ascontiguousarray(call()).tobytes() for _ in range(3)]


def chunked_reductions(comm: collsvc.Communicator) -> int:
    n, checked = comm.size, 0
    cases = [(dtype, op, (OVER_ONE_STEP,)) for dtype in REDUCED_DTYPES for op in ReduceOp if allowed(op, dtype)]
    cases += [("float32", ReduceOp.SUM, (OVER_ONE_SLOT,)), ("float64", ReduceOp.AVG, (701, 113))]
    for dtype, op, shape in cases:
        what = f"all_reduce {dtype} {op.name} {shape}"
        expected = reference(op, [make(r, dtype, shape) for r in range(n)])
        x = np.array(make(comm.rank, dtype, shape))
        results = _three_times(lambda x=x, op=op: comm.all_reduce(x, op))
        assert np.array_equal(x, make(comm.rank, dtype, shape)), f"{what}: input written"
        y = np.array(make(comm.rank, dtype, shape))
        assert comm.all_reduce(y, op, out=y) is y
        results.append(y.tobytes())
        assert comm._repeated.has_fast_path("all_reduce", x, op), f"{what}: no fast path was made"
        assert len(set(results)) == 1, f"{what}: the fast path's bits differ from the general path's"
        got = np.frombuffer(results[0], np_dtype(dtype)).reshape(shape)
        assert_close(got, expected, dtype, what, n)
        assert_identical_everywhere(comm, got, what)
        checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_large_all_reduce_matches_numpy_and_the_general_path(world_size: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(chunked_reductions, world_size, address=address, env=HOST, timeout=300)
    assert len(set(result.values)) == 1 and result.values[0] > 30


def chunked_data_movement(comm: collsvc.Communicator) -> bool:
    n = comm.size
    # Above 256 KiB a broadcast goes in pieces (the root copies one in while the others copy the last out).
    for dtype, shape in (("float32", (300_001,)), ("float64", (OVER_ONE_SLOT // 2 + 3,)), ("uint8", (5 << 20,))):
        for root in range(n):
            what = f"broadcast {dtype} {shape} root {root}"
            expected = np.array(make(root, dtype, shape)).tobytes()
            x = np.array(make(comm.rank, dtype, shape))
            if comm.rank == root:
                x.flags.writeable = False  # the root's array is only read
            assert _three_times(lambda x=x, root=root: comm.broadcast(x, root)) == [expected] * 3, what
            y = np.array(make(comm.rank, dtype, shape))
            assert comm.broadcast(y, root, out=y) is y and y.tobytes() == expected, what
            assert comm._repeated.has_fast_path("broadcast", x, root), f"{what}: no fast path was made"
    for dtype, shape in (("float32", (OVER_ONE_STEP,)), ("int16", (7001, 5)), ("float64", (OVER_ONE_SLOT // 2,))):
        what = f"all_gather {dtype} {shape}"
        gathered = np.concatenate([np.array(make(r, dtype, shape)) for r in range(n)])
        x = np.array(make(comm.rank, dtype, shape))
        assert _three_times(lambda x=x: comm.all_gather(x)) == [gathered.tobytes()] * 3, what
        out = np.zeros_like(gathered)
        assert comm.all_gather(x, out=out) is out and np.array_equal(out, gathered), what
        assert comm._repeated.has_fast_path("all_gather", x), f"{what}: no fast path was made"
    # all_to_all takes the fast path at every size: the group's own method.
    for dtype, rows in (("float32", 3), ("int16", 7001), ("complex128", OVER_ONE_STEP)):
        shape = (n * rows, 2)
        what = f"all_to_all {dtype} {shape}"
        sent = [np.array(make(r, dtype, shape)) for r in range(n)]
        expected = np.concatenate([part[comm.rank * rows : (comm.rank + 1) * rows] for part in sent])
        x = sent[comm.rank]
        assert _three_times(lambda x=x: comm.all_to_all(x)) == [expected.tobytes()] * 3, what
        out = np.zeros_like(expected)
        assert comm.all_to_all(x, out=out) is out and np.array_equal(out, expected), what
        assert comm._repeated.has_fast_path("all_to_all", x), f"{what}: no fast path was made"
    for dtype, op in (("float32", ReduceOp.SUM), ("int64", ReduceOp.MAX), ("float64", ReduceOp.AVG)):
        shape = (n * OVER_ONE_STEP,)
        what = f"reduce_scatter {dtype} {op.name}"
        block = slice(comm.rank * OVER_ONE_STEP, (comm.rank + 1) * OVER_ONE_STEP)
        expected = reference(op, [make(r, dtype, shape) for r in range(n)])[block]
        x = np.array(make(comm.rank, dtype, shape))
        results = _three_times(lambda x=x, op=op: comm.reduce_scatter(x, op))
        assert len(set(results)) == 1, f"{what}: the fast path's bits differ from the general path's"
        assert_close(np.frombuffer(results[0], np_dtype(dtype)), expected, dtype, what, n)
        assert comm._repeated.has_fast_path("reduce_scatter", x, op), f"{what}: no fast path was made"
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_large_broadcast_all_gather_and_reduce_scatter_match(world_size: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(chunked_data_movement, world_size, address=address, env=HOST, timeout=300)
    assert all(result.values)


def one_rank_on_the_general_path(comm: collsvc.Communicator) -> str:
    # Rank 1's input is not contiguous, so it takes the general path for the very calls the others run
    # on the fast path: the steps and descriptors must be the same.
    base = np.arange(2 * OVER_ONE_STEP, dtype=np.float64) * (comm.rank + 1)
    results = []
    for _ in range(4):
        x = base[::2] if comm.rank == 1 else base[::2].copy()
        results.append(comm.all_reduce(x).tobytes())
        results.append(comm.all_gather(x).tobytes())
        results.append(comm.all_to_all(x[: 3 * (x.size // 3)]).tobytes())
    reduced = np.frombuffer(results[0], np.float64)
    assert np.array_equal(reduced, np.arange(0, 2 * OVER_ONE_STEP, 2) * comm.size * (comm.size + 1) / 2)
    assert all(len(set(results[kind::3])) == 1 for kind in range(3))
    assert_identical_everywhere(comm, reduced, "all_reduce, one rank on the general path")
    contiguous = base[::2].copy()
    return f"{comm._repeated.has_fast_path('all_reduce', contiguous, ReduceOp.SUM)}"


def test_ranks_may_take_either_path_for_the_same_large_call() -> None:
    with coordinator() as (_, address):
        result = run_ranks(one_rank_on_the_general_path, 3, address=address, env=HOST, timeout=120)
    # Every rank learned the call; rank 1's non-contiguous input never takes what it learned.
    assert result.values == ["True", "True", "True"]


def large_shapes_disagree(comm: collsvc.Communicator) -> dict[str, Any]:
    for length in (OVER_ONE_STEP, OVER_ONE_STEP + 1):  # both shapes learned on every rank
        comm.all_reduce(np.ones(length, np.float32))
    return attempt(comm.all_reduce, np.ones(OVER_ONE_STEP + comm.rank, np.float32))


def test_large_shapes_that_disagree_on_the_fast_path_are_a_mismatch_on_every_rank() -> None:
    first, second = OVER_ONE_STEP, OVER_ONE_STEP + 1
    named = (f"rank 0 called all_reduce(float32[{first}]", f"rank 1 called all_reduce(float32[{second}]")
    assert_mismatch_on_every_rank(large_shapes_disagree, *named)


def dead_peer_in_a_large_call(comm: collsvc.Communicator) -> dict[str, Any]:
    x = np.ones(OVER_ONE_SLOT, np.float32)
    for _ in range(3):
        comm.all_reduce(x, out=x)
    assert comm._repeated.has_fast_path("all_reduce", x, ReduceOp.SUM)
    if comm.rank == 1:
        comm.job.store.get("survivor-entered", 30.0)
        os._exit(3)  # a crash: no clean leave
    comm.job.store.set("survivor-entered", b"1")
    return attempt(comm.all_reduce, x, out=x)


def test_a_dead_peer_in_a_large_call_on_the_fast_path_is_named_in_time() -> None:
    env = {**HOST, "COLLSVC_HEARTBEAT_INTERVAL": "0.3"}
    with coordinator() as (_, address):
        result = run_ranks(dead_peer_in_a_large_call, 2, address=address, env=env, timeout=60, allow_failures=True)
    seen = result.values[0]
    assert seen["type"] == "RankFailedError", seen
    assert seen["ranks"] == [1]
    assert seen["elapsed"] < 10.0
