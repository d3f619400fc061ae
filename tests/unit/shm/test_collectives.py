"""LocalGroup collectives on 1-4 thread ranks against numpy, bit for bit, across dtypes and sizes."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

from collsvc.client.backends.shm import LocalGroup
from collsvc.errors import CollectiveMismatchError, CollectiveTimeoutError, CollsvcError
from collsvc.types import ReduceOp, check_op_dtype
from tests.unit.shm.threads import run_group

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(bool), np.dtype(np.int32), np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.complex64)]
# 4096-byte slots: 0 and 1 are edge cases, 7 is uneven, 2500 x 4 bytes spans several rounds.
LENGTHS = [0, 1, 7, 2500]
UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


def allowed_ops(dtype: np.dtype) -> list[ReduceOp]:
    ops = []
    for op in ReduceOp:
        try:
            check_op_dtype(op, dtype)
        except TypeError:
            continue
        ops.append(op)
    return ops


def make(rank: int, dtype: np.dtype, length: int, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng([rank, length, salt])
    if dtype.kind == "b":
        return rng.integers(0, 2, length).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(-3, 4, length).astype(dtype)
    values = rng.uniform(0.5, 1.5, length)
    if dtype.kind == "c":
        values = values + 1j * rng.uniform(-1, 1, length)
    return values.astype(dtype)


def reference(op: ReduceOp, inputs: list[np.ndarray]) -> np.ndarray:
    """Combined in rank order in the dtype itself: the exact bits LocalGroup must produce."""
    ufunc = UFUNCS[op]
    if inputs[0].dtype.kind == "b" and op in (ReduceOp.SUM, ReduceOp.PRODUCT):
        ufunc = np.logical_or if op is ReduceOp.SUM else np.logical_and
    acc = inputs[0].copy()
    for x in inputs[1:]:
        ufunc(acc, x, out=acc)
    if op is ReduceOp.AVG and len(inputs) > 1:
        np.divide(acc, len(inputs), out=acc)
    return acc


def same_bits(got: np.ndarray, expected: np.ndarray, op: ReduceOp | None = None) -> bool:
    """Exact match; complex PRODUCT only to rounding (numpy's SIMD and scalar loops may use FMA differently)."""
    if op is ReduceOp.PRODUCT and got.dtype.kind == "c":
        return got.dtype == expected.dtype and np.allclose(got, expected, rtol=1e-6)
    return got.dtype == expected.dtype and got.tobytes() == expected.tobytes()


def every_collective(group: LocalGroup) -> list[bytes]:
    n, me, checks = group.size, group.rank, 0
    results: list[bytes] = []
    for dtype in DTYPES:
        for length in LENGTHS:
            for op in allowed_ops(dtype):
                inputs = [make(r, dtype, length) for r in range(n)]
                expected = reference(op, inputs)
                buf = inputs[me].copy()
                group.all_reduce(buf, op, time.monotonic() + 5)
                assert same_bits(buf, expected, op), f"all_reduce {dtype} {op} {length}"
                results.append(buf.tobytes())
                root = checks % n
                buf = inputs[me].copy()
                group.reduce(buf, op, root, time.monotonic() + 5)
                assert same_bits(buf, expected if me == root else inputs[me], op), f"reduce {dtype} {op} {length}"
                rows = [make(r, dtype, n * length, salt=1) for r in range(n)]
                out = np.empty(length, dtype)
                group.reduce_scatter(rows[me], out, op, time.monotonic() + 5)
                full = reference(op, rows)
                assert same_bits(out, full[me * length : (me + 1) * length], op), f"reduce_scatter {dtype} {op}"
                checks += 1
            mine = make(me, dtype, length, salt=2)
            gathered = np.empty(n * length, dtype)
            group.all_gather(mine, gathered, time.monotonic() + 5)
            parts = [make(r, dtype, length, salt=2) for r in range(n)]
            assert same_bits(gathered, np.concatenate(parts)), f"all_gather {dtype} {length}"
            sent = make(me, dtype, n * length, salt=4)
            received = np.empty(n * length, dtype)
            group.all_to_all(sent, received, time.monotonic() + 5)
            blocks = [make(r, dtype, n * length, salt=4)[me * length : (me + 1) * length] for r in range(n)]
            assert same_bits(received, np.concatenate(blocks)), f"all_to_all {dtype} {length}"
            for root in range(n):
                collected = np.empty(n * length, dtype) if me == root else None
                group.gather(mine, collected, root, time.monotonic() + 5)
                assert collected is None or same_bits(collected, np.concatenate(parts)), f"gather {dtype} {root}"
                share = np.empty(length, dtype)
                whole = make(root, dtype, n * length, salt=6)
                group.scatter(whole if me == root else None, share, root, time.monotonic() + 5)
                assert same_bits(share, whole[me * length : (me + 1) * length]), f"scatter {dtype} root {root}"
            for root in range(n):
                buf = make(me, dtype, length, salt=3)
                group.broadcast(buf, root, time.monotonic() + 5)
                assert same_bits(buf, make(root, dtype, length, salt=3)), f"broadcast {dtype} root {root}"
            group.barrier(time.monotonic() + 5)
    assert checks > 0
    return results


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_every_collective_matches_numpy_bit_for_bit(size: int) -> None:
    results = run_group(size, every_collective)
    assert all(r == results[0] for r in results), "all_reduce results differ between ranks"


def test_gather_and_scatter_of_large_blocks_take_many_rounds() -> None:
    # 4 KiB slots, 3 ranks: 1024 float32 per gather step, 341 per scatter piece.
    def work(group: LocalGroup) -> None:
        n, me, m = group.size, group.rank, 20_001
        blocks = [make(r, np.dtype(np.float32), m, salt=7) for r in range(n)]
        collected = np.zeros(n * m, np.float32) if me == 1 else None
        group.gather(blocks[me], collected, 1, time.monotonic() + 10)
        assert collected is None or same_bits(collected, np.concatenate(blocks))
        in_place = np.zeros(n * m, np.float32)  # the root's src is its own block of out
        in_place[me * m : (me + 1) * m] = blocks[me]
        src = in_place[me * m : (me + 1) * m] if me == 2 else blocks[me]
        group.gather(src, in_place if me == 2 else None, 2, time.monotonic() + 10)
        assert me != 2 or same_bits(in_place, np.concatenate(blocks))
        share = np.empty(m, np.float32)
        whole = np.concatenate(blocks)
        group.scatter(whole if me == 0 else None, share, 0, time.monotonic() + 10)
        assert same_bits(share, blocks[me])

    run_group(3, work)


def test_all_to_all_of_large_blocks_takes_many_rounds() -> None:
    # 4 KiB slots, 3 ranks: 341 float32 per piece, so 20_001-element blocks take 59 rounds.
    def work(group: LocalGroup) -> None:
        n, me, m = group.size, group.rank, 20_001
        sent = make(me, np.dtype(np.float32), n * m, salt=5)
        received = np.empty_like(sent)
        group.all_to_all(sent, received, time.monotonic() + 10)
        blocks = [make(r, np.dtype(np.float32), n * m, salt=5)[me * m : (me + 1) * m] for r in range(n)]
        assert same_bits(received, np.concatenate(blocks))

    run_group(3, work)


def test_all_to_all_over_more_ranks_than_half_a_slot_of_elements_sends_one_element_per_peer_and_step(
    barrier_kind: str,
) -> None:
    # 1 KiB slots hold 64 complex128; 33 ranks: one element of every peer's block per step. With socket
    # barriers local rank 0's release carries 33 descriptors, more than the 1 KiB inboxes once read.

    def work(group: LocalGroup) -> None:
        n, me, m, dtype = group.size, group.rank, 3, np.dtype(np.complex128)
        sent = make(me, dtype, n * m, salt=7)
        received = np.empty_like(sent)
        group.all_to_all(sent, received, time.monotonic() + 15)
        blocks = [make(r, dtype, n * m, salt=7)[me * m : (me + 1) * m] for r in range(n)]
        assert same_bits(received, np.concatenate(blocks))

    run_group(33, work, slot_bytes=1024, timeout=15)


@pytest.mark.parametrize("size", [2, 3])
def test_large_arrays_take_many_rounds_and_stay_identical_everywhere(size: int) -> None:
    length = 300_001  # float64 over 4 KiB slots: 586 rounds, uneven per rank

    def work(group: LocalGroup) -> bytes:
        buf = make(group.rank, np.dtype(np.float64), length)
        group.all_reduce(buf, ReduceOp.AVG, time.monotonic() + 10)
        expected = reference(ReduceOp.AVG, [make(r, np.dtype(np.float64), length) for r in range(size)])
        assert same_bits(buf, expected)
        return buf.tobytes()

    values = run_group(size, work)
    assert all(v == values[0] for v in values)


def test_direct_and_pipelined_paths_agree() -> None:
    # 32 KiB slots: 1000 float32 take the one-barrier path, 100_000 the pipelined one.
    def work(group: LocalGroup) -> None:
        for length in (1000, 100_000):
            inputs = [make(r, np.dtype(np.float32), length) for r in range(group.size)]
            buf = inputs[group.rank].copy()
            group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 5)
            assert same_bits(buf, reference(ReduceOp.SUM, inputs))

    run_group(4, work, slot_bytes=32 << 10)


def test_in_place_all_gather_and_overlapping_reduce_scatter() -> None:
    def work(group: LocalGroup) -> None:
        n, me, m = group.size, group.rank, 1500
        out = np.zeros(n * m, np.int64)
        out[me * m : (me + 1) * m] = me + 1
        group.all_gather(out[me * m : (me + 1) * m], out, time.monotonic() + 5)
        assert np.array_equal(out, np.repeat(np.arange(1, n + 1), m))
        src = np.arange(n * m, dtype=np.int64) + me
        group.reduce_scatter(src, src[:m], ReduceOp.SUM, time.monotonic() + 5)
        expected = n * np.arange(me * m, (me + 1) * m) + sum(range(n))
        assert np.array_equal(src[:m], expected)
        swapped = np.repeat(np.arange(n) + 10 * me, m)  # block r holds 10 * me + r
        group.all_to_all(swapped, swapped, time.monotonic() + 5)  # in place: out is src
        assert np.array_equal(swapped, np.repeat(10 * np.arange(n) + me, m))

    run_group(3, work)


def test_multidimensional_contiguous_arrays_are_used_flat() -> None:
    def work(group: LocalGroup) -> None:
        buf = np.full((3, 5), group.rank + 1.0)
        group.all_reduce(buf, ReduceOp.MAX, time.monotonic() + 5)
        assert buf.shape == (3, 5) and (buf == group.size).all()

    run_group(2, work)


def test_bad_arguments_fail_locally_before_anything_is_shared() -> None:
    with LocalGroup("unused", 0, 1, timeout=1) as group:
        with pytest.raises(ValueError):
            group.all_reduce(np.arange(10.0)[::2], ReduceOp.SUM, time.monotonic() + 1)
        with pytest.raises(TypeError):
            group.all_reduce(np.arange(4.0), ReduceOp.BAND, time.monotonic() + 1)
        with pytest.raises(ValueError):
            group.broadcast(np.arange(4.0), 1, time.monotonic() + 1)
        with pytest.raises(ValueError):
            group.all_gather(np.arange(4.0), np.empty(5), time.monotonic() + 1)
        with pytest.raises(TypeError):
            group.reduce_scatter(np.arange(4.0), np.empty(4, np.float32), ReduceOp.SUM, time.monotonic() + 1)
        with pytest.raises(ValueError):
            group.all_to_all(np.arange(4.0), np.empty(5), time.monotonic() + 1)
        with pytest.raises(ValueError):
            group.gather(np.arange(4.0), None, 0, time.monotonic() + 1)  # the root needs out
        with pytest.raises(ValueError):
            group.scatter(None, np.empty(4), 0, time.monotonic() + 1)  # the root needs src
        with pytest.raises(ValueError):
            group.gather(np.arange(4.0), np.empty(4), 1, time.monotonic() + 1)  # no rank 1
        readonly = np.arange(3.0)
        readonly.flags.writeable = False
        with pytest.raises(ValueError):
            group.all_reduce(readonly, ReduceOp.SUM, time.monotonic() + 1)
        with pytest.raises(ValueError):
            group.reduce(readonly, ReduceOp.SUM, 0, time.monotonic() + 1)  # written in place on the root
    with pytest.raises(ValueError):
        LocalGroup("x", 2, 2, timeout=1)
    with pytest.raises(ValueError):
        LocalGroup("x", 0, 2, slot_bytes=100, timeout=1)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("length", [7, 2500])  # 2500 float64 over 4 KiB slots: 5 chunks
def test_an_exchange_rewrites_each_ranks_reduced_slice_before_the_others_copy_it(size: int, length: int) -> None:
    """all_reduce's ``exchange`` sees every chunk's slices once, in order, tiling the array; what it
    writes there is what every rank ends with. It runs at any size (7 elements: one short chunk)."""
    inputs = [make(r, np.dtype(np.float64), length) for r in range(size)]
    summed = reference(ReduceOp.SUM, inputs)

    def work(group: LocalGroup) -> list[tuple[int, int, int]]:
        buf = inputs[group.rank].copy()
        seen: list[tuple[int, int, int]] = []

        def exchange(chunk: int, lo: int, hi: int) -> Callable[[], None]:
            assert same_bits(buf[lo:hi], summed[lo:hi])
            seen.append((chunk, lo, hi))
            return functools.partial(np.multiply, buf[lo:hi], 2, out=buf[lo:hi])  # finished later

        group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 10, exchange=exchange)
        assert same_bits(buf, summed * 2)
        return seen

    slices = sorted(s for seen in run_group(size, work) for s in seen)
    covered = [(lo, hi) for _, lo, hi in slices]
    assert covered[0][0] == 0 and covered[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))


@pytest.mark.parametrize("raises_in", ["start", "finish"])
def test_an_exchange_that_raises_leaves_its_rank_out_of_step(raises_in: str) -> None:
    """The rank whose exchange raised gets that error, and its later calls raise (its peers are a step
    ahead), even for a mismatch found across hosts (which, found by the group itself, leaves every rank
    in step); the peers' wait for it ends at their deadline, naming it."""

    def work(group: LocalGroup) -> str:
        buf = np.ones(2500, np.float64)

        def exchange(chunk: int, lo: int, hi: int) -> Callable[[], None]:
            def finish() -> None:
                if group.rank == 1 and chunk == 1:
                    raise CollectiveMismatchError("a rank on another host called something else")

            if raises_in == "start":
                finish()
            return finish

        try:
            group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 1, exchange=exchange)
        except CollectiveMismatchError as exc:
            with pytest.raises(CollsvcError) as later:
                group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 1)
            assert later.value is exc  # at once, without a step
            return "raised"
        except CollectiveTimeoutError as exc:
            return f"timeout naming {[w['rank'] for w in exc.waiting_on]}"
        return "finished"

    assert run_group(2, work) == ["timeout naming [1]", "raised"]
