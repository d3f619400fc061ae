"""LocalGroup's prepared small calls (run_all_reduce, run_broadcast, run_all_gather, run_reduce_scatter,
run_barrier) against its general methods, bit for bit.

Peers may take either method for the same call (the Communicator's fast path on one rank, the general
path on another), so both must publish the same descriptor and combine in the same order.
"""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest

from collsvc.client.backends.shm import LocalGroup
from collsvc.errors import CollectiveMismatchError, CollectiveTimeoutError, CollsvcError
from collsvc.types import ReduceOp
from tests.unit.shm.test_collectives import DTYPES, allowed_ops, make, reference, same_bits
from tests.unit.shm.threads import run_group

LENGTHS = [1, 7, 1000]  # float32 x 1000 = 4000 bytes: fits the 4096-byte slots of the test groups


def fitting_cases() -> list[tuple[np.dtype, int]]:
    """Every (dtype, length) of the tests whose array fits one 4096-byte slot (one step)."""
    return [(dtype, length) for dtype in DTYPES for length in LENGTHS if length * dtype.itemsize <= 4096]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_prepared_all_reduce_matches_the_general_path_bit_for_bit(size: int) -> None:
    def body(group: LocalGroup) -> int:
        n, me, checked = group.size, group.rank, 0
        for dtype, length in fitting_cases():
            for op in allowed_ops(dtype):
                plan = group.prepare_all_reduce(dtype, length, op, digest=7)
                assert plan is not None
                expected = reference(op, [make(r, dtype, length) for r in range(n)])
                src = make(me, dtype, length)
                dst = np.empty_like(src)
                group.run_all_reduce(plan, src, dst, deadline=_far())
                assert same_bits(dst, expected, op), f"{dtype} x{length} {op.name}"
                assert np.array_equal(src, make(me, dtype, length)), "src was written"
                group.run_all_reduce(plan, src, src, deadline=_far())  # in place
                assert same_bits(src, expected, op), f"in place {dtype} x{length} {op.name}"
                # Odd ranks take the general path for the same call: the peers must not notice.
                mixed = make(me, dtype, length)
                if me % 2:
                    group.all_reduce(mixed, op, _far(), digest=7)
                else:
                    group.run_all_reduce(plan, mixed, mixed, deadline=_far())
                assert same_bits(mixed, expected, op), f"mixed {dtype} x{length} {op.name}"
                checked += 1
        return checked

    counts = run_group(size, body)
    assert counts[0] > 40 and len(set(counts)) == 1


@pytest.mark.parametrize("size", [2, 3])
def test_prepared_broadcast_matches_the_general_path(size: int) -> None:
    def body(group: LocalGroup) -> int:
        n, me, checked = group.size, group.rank, 0
        for dtype, length in fitting_cases():
            for root in range(n):
                plan = group.prepare_broadcast(dtype, length, root, digest=9, shape=(length, 1))
                assert plan is not None and plan.is_root == (me == root)
                expected = make(root, dtype, length).reshape(length, 1)
                buf = make(me, dtype, length).reshape(length, 1)
                group.run_broadcast(plan, buf, _far())
                assert same_bits(buf, expected), f"{dtype} x{length} root {root}"
                # Mixed: odd ranks take the general path for the same call.
                mixed = make(me, dtype, length)
                if me % 2:
                    group.broadcast(mixed, root, _far(), digest=9)
                else:
                    group.run_broadcast(plan, mixed.reshape(length, 1), _far())
                assert same_bits(mixed, expected.reshape(-1)), f"mixed {dtype} x{length} root {root}"
                checked += 1
        return checked

    counts = run_group(size, body)
    assert counts[0] > 20 and len(set(counts)) == 1


@pytest.mark.parametrize("size", [2, 3, 4])
def test_prepared_all_gather_matches_the_general_path(size: int) -> None:
    def body(group: LocalGroup) -> int:
        n, me, checked = group.size, group.rank, 0
        for dtype, length in fitting_cases():
            plan = group.prepare_all_gather(dtype, length, digest=11)
            assert plan is not None
            expected = np.concatenate([make(r, dtype, length) for r in range(n)])
            src = make(me, dtype, length)
            dst = np.empty(n * length, dtype)
            group.run_all_gather(plan, src, dst, _far())
            assert same_bits(dst, expected), f"{dtype} x{length}"
            assert np.array_equal(src, make(me, dtype, length)), "src was written"
            # Mixed: odd ranks take the general path for the same call.
            mixed = np.empty(n * length, dtype)
            if me % 2:
                group.all_gather(src, mixed, _far(), digest=11)
            else:
                group.run_all_gather(plan, src, mixed, _far())
            assert same_bits(mixed, expected), f"mixed {dtype} x{length}"
            checked += 1
        return checked

    counts = run_group(size, body)
    assert counts[0] == len(fitting_cases()) and len(set(counts)) == 1


@pytest.mark.parametrize("size", [2, 3, 4])
def test_prepared_reduce_scatter_matches_the_general_path_bit_for_bit(size: int) -> None:
    def body(group: LocalGroup) -> int:
        n, me, checked = group.size, group.rank, 0
        for dtype in DTYPES:
            for length in (1, 7, 4096 // dtype.itemsize // n):  # the last: the largest one step takes
                for op in allowed_ops(dtype):
                    if op is ReduceOp.AVG:
                        continue  # the caller reduces AVG as SUM and divides (as the ring backend does)
                    plan = group.prepare_reduce_scatter(dtype, length, op, digest=13)
                    assert plan is not None, f"{dtype} x{length}"
                    inputs = [make(r, dtype, n * length) for r in range(n)]
                    expected = reference(op, inputs)[me * length : (me + 1) * length]
                    dst = np.empty(length, dtype)
                    group.run_reduce_scatter(plan, inputs[me], dst, _far())
                    assert same_bits(dst, expected, op), f"{dtype} x{length} {op.name}"
                    assert np.array_equal(inputs[me], make(me, dtype, n * length)), "src was written"
                    mixed = np.empty(length, dtype)  # odd ranks take the general path for the same call
                    if me % 2:
                        group.reduce_scatter(inputs[me], mixed, op, _far(), digest=13)
                    else:
                        group.run_reduce_scatter(plan, inputs[me], mixed, _far())
                    assert same_bits(mixed, expected, op), f"mixed {dtype} x{length} {op.name}"
                    checked += 1
        return checked

    counts = run_group(size, body)
    assert counts[0] > 80 and len(set(counts)) == 1


def test_prepare_declines_what_takes_several_steps_or_has_no_peers() -> None:
    def body(group: LocalGroup) -> tuple[bool, bool]:
        too_large = group.prepare_all_reduce(np.dtype(np.float32), 2000, ReduceOp.SUM, digest=1)  # 8000 B > slot
        fits = group.prepare_all_reduce(np.dtype(np.float32), 1024, ReduceOp.SUM, digest=1)
        too_large_broadcast = group.prepare_broadcast(np.dtype(np.float32), 2000, 0, digest=1)
        fits_broadcast = group.prepare_broadcast(np.dtype(np.float32), 1024, 1, digest=1)
        too_large_gather = group.prepare_all_gather(np.dtype(np.float32), 2000, digest=1)
        fits_gather = group.prepare_all_gather(np.dtype(np.float32), 1024, digest=1)
        too_large_scatter = group.prepare_reduce_scatter(np.dtype(np.float32), 513, ReduceOp.SUM, digest=1)
        fits_scatter = group.prepare_reduce_scatter(np.dtype(np.float32), 512, ReduceOp.SUM, digest=1)
        declined = (too_large, too_large_broadcast, too_large_gather, too_large_scatter)
        prepared = (fits, fits_broadcast, fits_gather, fits_scatter)
        return all(p is None for p in declined), all(p is not None for p in prepared)

    assert run_group(2, body) == [(True, True), (True, True)]
    assert run_group(1, lambda g: g.prepare_all_reduce(np.dtype(np.float32), 4, ReduceOp.SUM, digest=1)) == [None]


def test_a_prepared_call_and_a_different_call_raise_a_mismatch_on_every_rank_and_stay_in_step() -> None:
    def body(group: LocalGroup) -> tuple[str, float]:
        plan = group.prepare_all_reduce(np.dtype(np.float32), 7, ReduceOp.SUM, digest=3)
        assert plan is not None
        error = ""
        try:
            if group.rank == 0:
                group.run_all_reduce(plan, np.ones(7, np.float32), np.empty(7, np.float32), _far())
            else:
                group.all_reduce(np.ones(8, np.float32), ReduceOp.SUM, _far(), digest=3)
        except CollectiveMismatchError as exc:
            error = str(exc)
        after = np.ones(7, np.float32)
        group.run_all_reduce(plan, after, after, _far())  # the next call agrees again
        return error, float(after[0])

    results = run_group(2, body)
    for error, after in results:
        assert "'count': 7" in error and "'count': 8" in error, error
        assert after == 2.0


@pytest.mark.parametrize("size", [2, 3, 4])
def test_prepared_barriers_and_general_barriers_pass_together_and_keep_every_rank_in_step(size: int) -> None:
    def body(group: LocalGroup) -> float:
        plan = group.prepare_barrier(digest=5)
        assert plan is not None
        for turn in range(20):
            if (turn + group.rank) % 3:  # each barrier: some ranks prepared, some general
                group.run_barrier(plan, _far())
            else:
                group.barrier(_far(), digest=5)
        x = np.full(3, float(group.rank + 1), np.float32)
        group.all_reduce(x, ReduceOp.SUM, _far(), digest=5)  # still in step: the next call agrees
        return float(x[0])

    n = size
    assert run_group(size, body) == [n * (n + 1) / 2] * size


def test_a_prepared_barrier_against_an_all_reduce_is_a_mismatch_on_every_rank() -> None:
    def body(group: LocalGroup) -> str:
        plan = group.prepare_barrier(digest=5)
        assert plan is not None
        try:
            if group.rank == 0:
                group.run_barrier(plan, _far())
            else:
                group.all_reduce(np.ones(4, np.float32), ReduceOp.SUM, _far(), digest=5)
        except CollectiveMismatchError as exc:
            return str(exc)
        return ""

    for error in run_group(2, body):
        assert "barrier" in error and "all_reduce" in error, error


def test_a_group_of_one_prepares_no_barrier() -> None:
    assert run_group(1, lambda g: g.prepare_barrier(digest=1)) == [None]


def test_prepared_calls_on_a_closed_group_raise_that_it_is_closed() -> None:
    def body(group: LocalGroup) -> None:
        barrier = group.prepare_barrier(digest=5)
        reduce = group.prepare_all_reduce(np.dtype(np.float32), 4, ReduceOp.SUM, digest=5)
        assert barrier is not None and reduce is not None
        group.barrier(_far())  # both ranks prepared before either closes
        group.close()
        with pytest.raises(CollsvcError, match="closed"):
            group.run_barrier(barrier, _far())
        x = np.ones(4, np.float32)
        with pytest.raises(CollsvcError, match="closed"):
            group.run_all_reduce(reduce, x, x, _far())

    run_group(2, body)


def test_a_prepared_call_after_fail_raises_the_failure_without_arriving_at_the_barrier() -> None:
    """A failed rank's prepared call must not count as its arrival: a peer waiting at that barrier
    times out naming it, rather than passing a barrier the failed rank never took."""
    failed_call_raised = threading.Event()
    boom = RuntimeError("coordinator says the job failed")

    def body(group: LocalGroup) -> list[int]:
        plan = group.prepare_barrier(digest=5)
        assert plan is not None
        group.barrier(_far())  # both ranks prepared
        if group.rank == 0:
            group.fail(boom)
            with pytest.raises(RuntimeError) as info:
                group.run_barrier(plan, time.monotonic() + 5)
            assert info.value is boom
            failed_call_raised.set()
            return []
        assert failed_call_raised.wait(10)
        with pytest.raises(CollectiveTimeoutError) as timeout:
            group.run_barrier(plan, time.monotonic() + 0.5)
        return list(timeout.value.ranks)

    assert run_group(2, body) == [[], [0]]


def _far() -> float:
    return time.monotonic() + 30.0


def test_a_prepared_float_all_reduce_that_overflows_gives_inf_without_a_warning() -> None:
    """Overflow to inf (and inf - inf = nan) is a result, not a warning, on the prepared road as on the
    general one: numpy's RuntimeWarning would reach the user's log on every call of a training loop."""

    def body(group: LocalGroup) -> bool:
        dtype = np.dtype(np.float16)
        plan = group.prepare_all_reduce(dtype, 4, ReduceOp.SUM, digest=3)
        assert plan is not None
        src = np.full(4, np.finfo(np.float16).max, dtype)
        dst = np.empty_like(src)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            group.run_all_reduce(plan, src, dst, deadline=_far())
        return bool(np.all(np.isinf(dst)))

    assert run_group(2, body) == [True, True]
