"""Every collective of API.md, on real rank processes over real sockets, against numpy references."""

from __future__ import annotations

import numpy as np
import pytest

import collsvc
from collsvc.types import ReduceOp
from tests.harness import coordinator, run_ranks
from tests.multiproc.checks import (
    DTYPES,
    allowed,
    assert_close,
    assert_identical_everywhere,
    make,
    np_dtype,
    reference,
)
from tests.multiproc.test_faults import host_env

SHAPES = [(), (1,), (0,), (7, 3), (1000,)]


def reductions_everywhere(comm: collsvc.Communicator) -> int:
    """all_reduce, reduce and reduce_scatter for every dtype x op, plus the local rejections."""
    n, checked = comm.size, 0
    for dtype in DTYPES:
        for op in ReduceOp:
            x = make(comm.rank, dtype, (5, 3))
            if not allowed(op, dtype):
                with pytest.raises(TypeError):
                    comm.all_reduce(x, op)
                continue
            expected = reference(op, [make(r, dtype, (5, 3)) for r in range(n)])
            got = comm.all_reduce(x, op)
            assert got.dtype == np_dtype(dtype)
            assert_close(got, expected, dtype, f"all_reduce {dtype} {op.name}", n)
            assert_identical_everywhere(comm, got, f"all_reduce {dtype} {op.name}")
            root = checked % n
            reduced = comm.reduce(x, root, op)
            if comm.rank == root:
                assert_close(reduced, expected, dtype, f"reduce {dtype} {op.name}", n)
            else:
                assert reduced is None
            rows = make(comm.rank, dtype, (2 * n, 2))
            block = comm.reduce_scatter(rows, op)
            full = reference(op, [make(r, dtype, (2 * n, 2)) for r in range(n)])
            assert_close(block, full[2 * comm.rank : 2 * comm.rank + 2], dtype, f"reduce_scatter {dtype} {op.name}", n)
            checked += 1
    return checked


def shapes_and_layouts(comm: collsvc.Communicator) -> None:
    n = comm.size
    for shape in SHAPES:
        x = make(comm.rank, "float64", shape)
        expected = reference(ReduceOp.SUM, [make(r, "float64", shape) for r in range(n)])
        assert_close(comm.all_reduce(x), expected, "float64", f"all_reduce shape {shape}", n)
        gathered = comm.all_gather(x)
        parts = [np.atleast_1d(make(r, "float64", shape)) for r in range(n)]
        assert np.array_equal(gathered, np.concatenate(parts)), f"all_gather shape {shape}"
    # Non-contiguous input, out=, and in place.
    base = make(comm.rank, "float32", (6, 8))
    view = base[:, ::2]
    expected = reference(ReduceOp.SUM, [make(r, "float32", (6, 8))[:, ::2] for r in range(n)])
    assert_close(comm.all_reduce(view), expected, "float32", "non-contiguous", n)
    out = np.empty((6, 4), np.float32)
    assert comm.all_reduce(view, out=out) is out
    assert_close(out, expected, "float32", "out=", n)
    inplace = np.ascontiguousarray(view)
    assert comm.all_reduce(inplace, out=inplace) is inplace
    assert_close(inplace, expected, "float32", "in place", n)
    with pytest.raises(ValueError):
        comm.all_reduce(view, out=np.empty((3,), np.float32))
    with pytest.raises(TypeError):
        comm.all_reduce([1, 2, 3])  # a list of ints is not an array


def rooted_and_personalized(comm: collsvc.Communicator) -> None:
    n, me = comm.size, comm.rank
    for root in range(n):
        x = make(me, "int32", (4, 2), seed=root)
        got = comm.broadcast(x, root)
        assert np.array_equal(got, make(root, "int32", (4, 2), seed=root))
        gathered = comm.gather(x, root)
        if me == root:
            assert np.array_equal(gathered, np.concatenate([make(r, "int32", (4, 2), seed=root) for r in range(n)]))
        else:
            assert gathered is None
        full = make(root, "float32", (3 * n, 2), seed=root)
        block = comm.scatter(full if me == root else None, root, out=np.empty((3, 2), np.float32))
        assert np.array_equal(block, full[3 * me : 3 * me + 3])
    x = np.arange(2 * n, dtype=np.int64) + 100 * me
    got = comm.all_to_all(x)
    assert np.array_equal(got, np.array([100 * j + k for j in range(n) for k in (2 * me, 2 * me + 1)]))


def point_to_point(comm: collsvc.Communicator) -> None:
    n, me = comm.size, comm.rank
    if n == 1:
        with pytest.raises(ValueError):
            comm.send(np.zeros(1), 0)
        return
    right, left = (me + 1) % n, (me - 1) % n
    for tag in (0, 7):
        comm.send(np.full(3, me * 10 + tag, np.int64), right, tag=tag)
    got7 = comm.recv(left, tag=7, shape=(3,), dtype=np.int64)
    got0 = comm.recv(left, tag=0, out=np.empty(3, np.int64))
    assert list(got0) == [left * 10] * 3 and list(got7) == [left * 10 + 7] * 3
    # recv_any: rank 0 takes messages in arrival order; each sender's stay in order, and a later
    # recv from a given sender gets the message after the ones recv_any took.
    if me == 0:
        seen: dict[int, list[int]] = {}
        for _ in range(2 * (n - 1)):
            source, got = comm.recv_any(tag=5, shape=(2,), dtype=np.int64)
            assert got[0] == source, (source, got)
            seen.setdefault(source, []).append(int(got[1]))
        assert seen == {r: [1, 2] for r in range(1, n)}, seen
        with pytest.raises(collsvc.CollectiveTimeoutError, match="no message from any other rank") as caught:
            comm.recv_any(tag=6, shape=(1,), dtype=np.int64, timeout=0.2)
        assert caught.value.ranks == list(range(1, n))
    else:
        for count in (1, 2):
            comm.send(np.array([me, count], np.int64), 0, tag=5)
    comm.barrier()  # the third message below must not race the others' second ones into recv_any
    if me == n - 1:
        comm.send(np.array([me, 3], np.int64), 0, tag=5)
    elif me == 0:
        assert list(comm.recv(n - 1, tag=5, shape=(2,), dtype=np.int64)) == [n - 1, 3]


def async_fused_objects_groups(comm: collsvc.Communicator) -> None:
    n, me = comm.size, comm.rank
    works = [comm.all_reduce(np.full(4, me + i, np.float64), async_op=True) for i in range(3)]
    for i, work in enumerate(works):
        assert work.wait(timeout=30)
        assert work.is_completed()
        assert np.allclose(work.result(), sum(r + i for r in range(n)))
    arrays = [np.full(3, me, np.float32), np.full((2, 2), 2 * me, np.float32)]
    fused = comm.all_reduce(arrays)
    assert np.allclose(fused[0], sum(range(n))) and np.allclose(fused[1], 2 * sum(range(n)))
    listed = comm.all_gather([np.array([me], np.int32), np.array([me, me], np.int32)])
    assert list(listed[0]) == list(range(n)) and listed[1].shape == (2 * n,)
    assert comm.broadcast_object({"from": me, "data": [1, 2]}, src=n - 1) == {"from": n - 1, "data": [1, 2]}
    assert comm.all_gather_object(("rank", me)) == [("rank", r) for r in range(n)]
    evens = comm.new_group([r for r in range(n) if r % 2 == 0], name="evens")
    if me % 2 == 0:
        assert evens is not None and evens.size == (n + 1) // 2
        total = evens.all_reduce(np.array([me], np.int64))
        assert total[0] == sum(r for r in range(n) if r % 2 == 0)
        evens.barrier()
    else:
        assert evens is None
    assert comm.find_group("evens") == [r for r in range(n) if r % 2 == 0]
    assert comm.find_group("no-such-group") == []
    grads = [np.full(10, float(me + i), np.float32) for i in range(5)]
    callback = comm.all_reduce_callback(grads, pack_size=80, op=collsvc.AVG)
    for g in reversed(grads) if me % 2 else grads:  # readiness order differs between ranks
        callback(g)
    callback.wait()
    for i, g in enumerate(grads):
        assert np.allclose(g, np.mean([r + i for r in range(n)]))
    comm.barrier()


def everything(comm: collsvc.Communicator) -> dict[str, int]:
    checked = reductions_everywhere(comm)
    shapes_and_layouts(comm)
    rooted_and_personalized(comm)
    point_to_point(comm)
    async_fused_objects_groups(comm)
    return {"rank": comm.rank, "size": comm.size, "reductions": checked}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_collective_matches_numpy(world_size: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(everything, world_size, address=address, timeout=240)
    assert [v["rank"] for v in result.values] == list(range(world_size))
    assert all(v["reductions"] > 50 for v in result.values)


def two_threads_on_two_groups(comm: collsvc.Communicator) -> list[float]:
    """Two threads each issue 100 async all_reduces on a group of their own (both groups hold every
    rank) and wait for each; the ranks' threads interleave differently. With one executor for the
    job, each rank ran the other group's call first and both waited until the timeout."""
    import threading

    groups = [comm.new_group(list(range(comm.size)), name=f"thread-{i}") for i in range(2)]
    results = [0.0, 0.0]

    def issue(index: int) -> None:
        x = np.ones(256)
        for _ in range(100):
            x = groups[index].all_reduce(x, async_op=True).result() / comm.size
        results[index] = float(x[0])

    threads = [threading.Thread(target=issue, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_threads_issuing_async_calls_on_different_groups_do_not_wait_for_each_other(transport: str) -> None:
    with coordinator() as (_, address):
        result = run_ranks(
            two_threads_on_two_groups,
            3,
            address=address,
            rank_env=host_env(transport),
            timeout=60,  # before: every rank waited out the job's timeout (300 s)
        )
    assert result.values == [[1.0, 1.0]] * 3


def scatter_as_documented(comm: collsvc.Communicator) -> int:
    """docs/api.md's simplest form: every rank passes an x of the full shape and no out. Non-source
    ranks' landing buffer had the full size, so every rank raised a false CollectiveMismatchError."""
    n, calls = comm.size, 0
    for src in range(n):
        for repeat in range(3):  # the repeated-call caches too
            full = np.arange(n * 3, dtype=np.float32) + 100 * repeat
            x = full if comm.rank == src else np.zeros(n * 3, np.float32)
            block = comm.scatter(x, src=src)
            assert block.shape == (3,)
            np.testing.assert_array_equal(block, full[3 * comm.rank : 3 * comm.rank + 3])
            calls += 1
    return calls


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_scatter_without_out_on_every_root(world_size: int, transport: str) -> None:
    with coordinator() as (_, address):
        result = run_ranks(
            scatter_as_documented, world_size, address=address, rank_env=host_env(transport), timeout=120
        )
    assert result.values == [3 * world_size] * world_size
