"""The Communicator's fast path for repeated all_reduce, broadcast, all_gather and reduce_scatter calls
and barriers (client/fast_path.py), on real rank processes.

Each call shape runs several times, so every call after the first takes the fast path; the results are
checked against numpy, against the general path's bits, and across ranks. Calls the fast path must not
take (non-contiguous, read-only in place, async, other out) still work; failures name the same ranks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collsvc
from collsvc.types import ReduceOp
from tests.harness import coordinator, run_ranks
from tests.multiproc.checks import DTYPES, allowed, assert_close, assert_identical_everywhere, make, np_dtype, reference
from tests.multiproc.test_faults import attempt

HOST = {"COLLSVC_HOST": "fast-path-host"}  # one host: the shared-memory path
SHAPES = [(), (1,), (7, 3), (1023,)]


def assert_mismatch_on_every_rank(fn: Any, *named: str) -> None:
    """Runs ``fn`` on 2 ranks; each must raise a CollectiveMismatchError within 5 s naming all of ``named``."""
    with coordinator() as (_, address):
        result = run_ranks(fn, 2, address=address, env=HOST, timeout=60, allow_failures=True)
    for rank, seen in enumerate(result.values):
        assert seen["type"] == "CollectiveMismatchError", (rank, seen)
        for text in named:
            assert text in seen["message"], (text, seen["message"])
        assert seen["elapsed"] < 5.0, seen


def repeated_reductions(comm: collsvc.Communicator) -> int:
    n, checked = comm.size, 0
    for dtype in DTYPES:
        for op in ReduceOp:
            if not allowed(op, dtype):
                continue
            for shape in SHAPES:
                what = f"{dtype} {op.name} {shape}"
                expected = reference(op, [make(r, dtype, shape) for r in range(n)])
                results = []
                for _ in range(3):  # the first call learns, the others take the fast path
                    x = np.array(make(comm.rank, dtype, shape))
                    got = comm.all_reduce(x, op)
                    assert got is not x and got.dtype == np_dtype(dtype) and got.flags.c_contiguous
                    assert np.array_equal(x, make(comm.rank, dtype, shape)), f"{what}: input written"
                    assert_close(got, expected, dtype, what, n)
                    y = np.array(make(comm.rank, dtype, shape))  # 0-d complex inputs are numpy scalars
                    assert comm.all_reduce(y, op, out=y) is y
                    assert_close(y, expected, dtype, f"{what} in place", n)
                    results += [got.tobytes(), y.tobytes()]
                assert comm._repeated.has_fast_path("all_reduce", x, op), f"{what}: no fast path was made"
                assert len(set(results)) == 1, f"{what}: the fast path's bits differ from the general path's"
                assert_identical_everywhere(comm, got, what)
                checked += 1
    return checked


def repeated_broadcasts(comm: collsvc.Communicator) -> int:
    checked = 0
    for dtype in DTYPES:
        for shape in SHAPES:
            for root in range(comm.size):
                what = f"broadcast {dtype} {shape} root {root}"
                expected = np.array(make(root, dtype, shape))
                for _ in range(3):  # the first call learns, the others take the fast path
                    x = np.array(make(comm.rank, dtype, shape))
                    if comm.rank == root:
                        x.flags.writeable = False  # the root's array is only read
                    got = comm.broadcast(x, root)
                    assert got is not x and got.tobytes() == expected.tobytes(), what
                    y = np.array(make(comm.rank, dtype, shape))
                    assert comm.broadcast(y, root, out=y) is y and y.tobytes() == expected.tobytes(), what
                assert comm._repeated.has_fast_path("broadcast", x, root), f"{what}: no fast path was made"
                checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_broadcast_matches_the_root(world_size: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(repeated_broadcasts, world_size, address=address, env=HOST, timeout=240)
    assert len(set(result.values)) == 1 and result.values[0] >= 60


def repeated_all_gathers(comm: collsvc.Communicator) -> int:
    n, checked = comm.size, 0
    for dtype in DTYPES:
        for shape in SHAPES:
            what = f"all_gather {dtype} {shape}"
            expected = np.concatenate([np.array(make(r, dtype, shape)).reshape(shape or (1,)) for r in range(n)])
            for _ in range(3):  # the first call learns, the others take the fast path
                x = np.array(make(comm.rank, dtype, shape))
                x.flags.writeable = False  # only read
                got = comm.all_gather(x)
                assert got.shape == expected.shape and got.tobytes() == expected.tobytes(), what
                out = np.full_like(expected, 0)
                assert comm.all_gather(x, out=out) is out and out.tobytes() == expected.tobytes(), what
                # An out the fast path leaves to the general path (not contiguous), on one rank only.
                spaced = np.zeros(2 * expected.size, expected.dtype)[:: 2 if comm.rank else 1][: expected.size]
                strided = spaced.reshape(expected.shape)
                assert np.shares_memory(strided, spaced) and strided.flags.c_contiguous == (comm.rank == 0), what
                assert comm.all_gather(x, out=strided) is strided and strided.tobytes() == expected.tobytes(), what
            assert comm._repeated.has_fast_path("all_gather", x), f"{what}: no fast path was made"
            checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_all_gather_matches_every_rank(world_size: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(repeated_all_gathers, world_size, address=address, env=HOST, timeout=240)
    assert len(set(result.values)) == 1 and result.values[0] == len(DTYPES) * len(SHAPES)


def repeated_reduce_scatters(comm: collsvc.Communicator) -> int:
    n, checked = comm.size, 0
    for dtype in DTYPES:
        for op in ReduceOp:
            if not allowed(op, dtype):
                continue
            for shape in ((n,), (n * 7, 3), (n * 100,)):
                what = f"reduce_scatter {dtype} {op.name} {shape}"
                rows = shape[0] // n
                expected = reference(op, [make(r, dtype, shape) for r in range(n)])[
                    comm.rank * rows : (comm.rank + 1) * rows
                ]
                results = []
                for _ in range(3):  # the first call learns, the others take the fast path
                    x = np.array(make(comm.rank, dtype, shape))
                    x.flags.writeable = False  # only read
                    got = comm.reduce_scatter(x, op)
                    assert got.shape == expected.shape and got.dtype == np_dtype(dtype), what
                    assert_close(got, expected, dtype, what, n)
                    # Into an out: contiguous on rank 0 (the fast path), strided on the others (the general one).
                    spaced = np.zeros(2 * got.size, got.dtype)[:: 2 if comm.rank else 1][: got.size]
                    out = spaced.reshape(got.shape)
                    assert comm.reduce_scatter(x, op, out=out) is out, what
                    results += [got.tobytes(), out.tobytes()]
                assert comm._repeated.has_fast_path("reduce_scatter", x, op), f"{what}: no fast path was made"
                assert len(set(results)) == 1, f"{what}: the fast path's bits differ from the general path's"
                checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_reduce_scatter_matches_numpy_and_the_general_path(world_size: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(repeated_reduce_scatters, world_size, address=address, env=HOST, timeout=240)
    assert len(set(result.values)) == 1 and result.values[0] > 100


def all_gather_shapes_disagree(comm: collsvc.Communicator) -> dict[str, Any]:
    for length in (8, 9):  # both shapes learned on every rank
        comm.all_gather(np.ones(length))
    return attempt(comm.all_gather, np.ones(8 + comm.rank))


def test_all_gather_shapes_that_disagree_on_the_fast_path_are_a_mismatch_on_every_rank() -> None:
    named = ("rank 0 called all_gather(float64[8])", "rank 1 called all_gather(float64[9])")
    assert_mismatch_on_every_rank(all_gather_shapes_disagree, *named)


def broadcast_roots_disagree(comm: collsvc.Communicator) -> dict[str, Any]:
    x = np.ones(8)
    for root in (0, 1):  # both roots learned on every rank
        comm.broadcast(x, root)
    return attempt(comm.broadcast, x, comm.rank)  # each rank thinks it is the root


def test_broadcast_roots_that_disagree_on_the_fast_path_are_a_mismatch_on_every_rank() -> None:
    named = ("rank 0 called broadcast(float64[8], root=0)", "rank 1 called broadcast(float64[8], root=1)")
    assert_mismatch_on_every_rank(broadcast_roots_disagree, *named)


def calls_the_fast_path_must_leave(comm: collsvc.Communicator) -> bool:
    n = comm.size
    total = n * (n + 1) / 2
    base = np.arange(48, dtype=np.float64).reshape(8, 6)
    for _ in range(3):
        strided = base[:, ::2] * (comm.rank + 1)  # a copy: contiguous
        view = (base * (comm.rank + 1))[:, ::2]  # not contiguous
        assert np.array_equal(comm.all_reduce(strided), base[:, ::2] * total)
        assert np.array_equal(comm.all_reduce(view), base[:, ::2] * total)
        frozen = np.full(5, comm.rank + 1.0)
        frozen.flags.writeable = False
        assert np.array_equal(comm.all_reduce(frozen), np.full(5, total))
        with pytest.raises(ValueError, match="read-only"):
            comm.all_reduce(frozen, out=frozen)
        with pytest.raises(TypeError, match="ReduceOp"):
            comm.all_reduce(frozen, op=["SUM"])  # type: ignore[arg-type]  # refused before anything is sent
        out = np.empty(5)
        assert comm.all_reduce(np.full(5, comm.rank + 1.0), out=out) is out and np.array_equal(out, np.full(5, total))
        # Rank 0 queues this call on its worker thread (async), the others run it on the fast path.
        x = np.full(5, comm.rank + 1.0)
        if comm.rank == 0:
            work = comm.all_reduce(x, async_op=True)
            got = comm.all_reduce(np.full(5, 1.0))  # behind the async call, in order
            assert work.wait() and np.array_equal(work.result(), np.full(5, total))
        else:
            assert np.array_equal(comm.all_reduce(x), np.full(5, total))
            got = comm.all_reduce(np.full(5, 1.0))
        assert np.array_equal(got, np.full(5, float(n)))
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_all_reduce_matches_numpy_and_the_general_path(world_size: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(repeated_reductions, world_size, address=address, env=HOST, timeout=240)
    assert len(set(result.values)) == 1 and result.values[0] > 100


def test_calls_the_fast_path_cannot_take_still_work() -> None:
    with coordinator() as (_, address):
        result = run_ranks(calls_the_fast_path_must_leave, 3, address=address, env=HOST, timeout=120)
    assert all(result.values)


def counted_calls(comm: collsvc.Communicator) -> dict[str, list[int]]:
    x = np.ones(1000, np.float32)
    for _ in range(20):
        comm.all_reduce(x, out=x)
    assert comm._repeated.has_fast_path("all_reduce", x, ReduceOp.SUM)
    for _ in range(7):
        comm.broadcast(x, 0, out=x)
    for _ in range(5):
        comm.all_gather(x)
    assert comm._repeated.has_fast_path("all_gather", x)
    for _ in range(4):
        comm.reduce_scatter(x, ReduceOp.MAX)
    assert comm._repeated.has_fast_path("reduce_scatter", x, ReduceOp.MAX)
    for _ in range(6):
        comm.barrier()
    assert comm._repeated.has_fast_path("barrier")
    return {s.op: [s.count, s.bytes, s.failed] for s in comm._job.recorder.stats.snapshot()}


def test_calls_on_the_fast_path_are_counted_in_the_statistics() -> None:
    # What the heartbeat carries to `collsvc status` and the Prometheus metrics.
    with coordinator() as (_, address):
        result = run_ranks(counted_calls, 2, address=address, env=HOST, timeout=120)
    for counted in result.values:
        assert counted["all_reduce"] == [20, 20 * 4000, 0] and counted["broadcast"] == [7, 7 * 4000, 0], counted
        assert counted["all_gather"] == [5, 5 * 4000, 0] and counted["reduce_scatter"] == [4, 4 * 4000, 0], counted
        assert counted["barrier"] == [6, 0, 0], counted


def mismatch_on_the_fast_path(comm: collsvc.Communicator) -> dict[str, Any]:
    for shape in ((8,), (9,)):  # both shapes learned on every rank
        comm.all_reduce(np.ones(shape))
    return attempt(comm.all_reduce, np.ones((8,) if comm.rank == 0 else (9,)))


def test_a_mismatch_on_the_fast_path_names_both_calls_on_every_rank() -> None:
    assert_mismatch_on_every_rank(mismatch_on_the_fast_path, "[8]", "[9]")


def dead_peer_on_the_fast_path(comm: collsvc.Communicator) -> dict[str, Any]:
    x = np.ones(16)
    for _ in range(3):
        comm.all_reduce(x)
    if comm.rank == 1:
        comm.job.store.get("survivor-entered", 30.0)
        os._exit(3)  # a crash: no clean leave
    comm.job.store.set("survivor-entered", b"1")
    return attempt(comm.all_reduce, x)


def test_a_dead_peer_on_the_fast_path_is_named_in_time() -> None:
    env = {**HOST, "COLLSVC_HEARTBEAT_INTERVAL": "0.3"}
    with coordinator() as (_, address):
        result = run_ranks(dead_peer_on_the_fast_path, 2, address=address, env=env, timeout=60, allow_failures=True)
    seen = result.values[0]
    assert seen["type"] == "RankFailedError", seen
    assert seen["ranks"] == [1]
    assert seen["elapsed"] < 10.0


def fast_path_after_three_calls(comm: collsvc.Communicator) -> bool:
    x = np.ones(16)
    for _ in range(3):
        assert np.array_equal(comm.all_reduce(x), np.full(16, float(comm.size)))
    return comm._repeated.has_fast_path("all_reduce", x, ReduceOp.SUM)


@pytest.mark.parametrize(("setting", "expected"), [("1", True), ("0", False)])
def test_collsvc_fast_path_0_sends_every_call_the_general_way(setting: str, expected: bool) -> None:
    with coordinator() as (_, address):
        env = {**HOST, "COLLSVC_FAST_PATH": setting}
        result = run_ranks(fast_path_after_three_calls, 2, address=address, env=env, timeout=60)
    assert result.values == [expected, expected]


def three_all_reduces(comm: collsvc.Communicator) -> bool:
    x = np.ones(16)
    for _ in range(3):
        comm.all_reduce(x)
    return comm._repeated.has_fast_path("all_reduce", x, ReduceOp.SUM)


def test_a_job_recording_its_timeline_keeps_every_call_on_the_general_path(tmp_path: Path) -> None:
    target = tmp_path / "trace.json"
    with coordinator() as (_, address):
        env = {**HOST, "COLLSVC_TIMELINE": str(target)}
        result = run_ranks(three_all_reduces, 2, address=address, env=env, timeout=60)
    assert result.values == [False, False]
    for rank in range(2):
        part = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
        assert [call[3] for call in part["calls"]] == ["all_reduce"] * 3, part["calls"]


def barriers_that_wait(comm: collsvc.Communicator, folder: str) -> bool:
    """Each rank leaves a file before each barrier and, after it, finds every rank's file of that turn."""
    x = np.ones(8, np.float32)
    for turn in range(30):
        Path(folder, f"{turn}-{comm.rank}").touch()
        comm.barrier()
        missing = [r for r in range(comm.size) if not Path(folder, f"{turn}-{r}").exists()]
        assert not missing, f"barrier {turn} let rank {comm.rank} through before ranks {missing} arrived"
        if turn % 4 == 0:
            comm.all_reduce(x, out=x)  # other calls in between: the barrier's step stays in line with them
    assert x[0] == comm.size**8
    return comm._repeated.has_fast_path("barrier")


@pytest.mark.parametrize("world_size", [2, 3])
def test_repeated_barriers_take_the_fast_path_and_still_wait_for_every_rank(world_size: int, tmp_path: Path) -> None:
    with coordinator() as (_, address):
        result = run_ranks(barriers_that_wait, world_size, address=address, args=(str(tmp_path),), env=HOST, timeout=60)
    assert result.values == [True] * world_size


def barrier_against_an_all_reduce(comm: collsvc.Communicator) -> dict[str, Any]:
    x = np.ones(8)
    for _ in range(3):  # both learned on every rank
        comm.barrier()
        comm.all_reduce(x)
    assert comm._repeated.has_fast_path("barrier")
    return attempt(comm.barrier) if comm.rank == 0 else attempt(comm.all_reduce, x)


def test_a_barrier_against_an_all_reduce_on_the_fast_path_is_a_mismatch_on_every_rank() -> None:
    assert_mismatch_on_every_rank(barrier_against_an_all_reduce, "barrier", "all_reduce")


def barrier_with_a_late_rank(comm: collsvc.Communicator) -> dict[str, Any]:
    for _ in range(3):
        comm.barrier()
    if comm.rank == 1:
        comm.job.store.get("timed-out", 30.0)  # late until rank 0's barrier gave up
        return {"type": None}
    seen = attempt(comm.barrier, timeout=1.0)
    comm.job.store.set("timed-out", b"1")
    return seen


def test_a_barrier_on_the_fast_path_honours_its_timeout_and_names_the_late_rank() -> None:
    with coordinator() as (_, address):
        result = run_ranks(barrier_with_a_late_rank, 2, address=address, env=HOST, timeout=60, allow_failures=True)
    seen = result.values[0]
    assert seen["type"] == "CollectiveTimeoutError", seen
    assert seen["ranks"] == [1], seen
    assert 1.0 <= seen["elapsed"] < 6.0, seen


def fast_path_after_close_abort_and_departure(comm: collsvc.Communicator) -> dict[str, Any]:
    """The checks a repeated call makes before it is numbered (flags read inline on the fast path) raise
    what the general path raises: a closed communicator, a member that left, an aborted job."""
    x = np.ones(8)
    closing = comm.new_group([0, 1, 2], name="closing")
    leaving = comm.new_group([0, 1, 2], name="leaving")
    pair = comm.new_group([0, 1], name="pair")
    assert closing is not None and leaving is not None
    for group in (closing, leaving, pair):
        for _ in range(3):
            if group is not None:
                group.all_reduce(x)
                group.barrier()
    assert closing._repeated.has_fast_path("all_reduce", x, ReduceOp.SUM) and closing._repeated.has_fast_path("barrier")
    closing.close()
    seen: dict[str, Any] = {"closed": [attempt(closing.all_reduce, x), attempt(closing.barrier)]}
    comm.barrier()
    if comm.rank == 2:
        comm.close()  # leaves the job cleanly
        return seen
    if comm.rank == 0:
        seen["departed"] = attempt(leaving.all_reduce, x)
        comm.job.store.set("departure-seen", b"1")
    else:
        comm.job.store.get("departure-seen", 30.0)
    assert pair is not None
    pair.barrier()
    if comm.rank == 0:
        comm.abort("stopped on purpose")
    seen["aborted"] = attempt(pair.all_reduce, x)
    return seen


def test_a_closed_communicator_an_abort_and_a_departure_stop_the_fast_path_as_the_general_one() -> None:
    with coordinator() as (_, address):
        result = run_ranks(
            fast_path_after_close_abort_and_departure, 3, address=address, env=HOST, timeout=60, allow_failures=True
        )
    for rank, seen in enumerate(result.values):
        for closed in seen["closed"]:
            assert closed["type"] == "CollsvcError" and "is closed" in closed["message"], (rank, closed)
    departed = result.values[0]["departed"]
    assert departed["type"] == "RankFailedError" and departed["ranks"] == [2], departed
    assert departed["elapsed"] < 5.0, departed
    for rank in (0, 1):
        aborted = result.values[rank]["aborted"]
        assert aborted["type"] == "AbortedError" and "stopped on purpose" in aborted["message"], (rank, aborted)
