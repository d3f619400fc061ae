"""The ring algorithms over the in-memory transport: threads as ranks, world sizes 1 to 5.

Each test runs many cases per thread pool dispatch (one call sequence number per case), checks the
result against numpy, and checks that every rank holds the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from collsvc.client.backends.reduction import finish_average
from collsvc.client.backends.ring import algorithms
from collsvc.types import ReduceOp

from .threads import (
    ALL_DTYPES,
    BF16,
    CheckedChannel,
    assert_equal_values,
    assert_identical,
    exact_inputs,
    ops_for,
    reference,
    run_ranks,
)

SIZES = (1, 2, 3, 4, 5)
RING = {"chunk_bytes": 64, "small_bytes": -1}  # tiny frames, ring / chain path
SMALL = {"chunk_bytes": 64, "small_bytes": 1 << 30}  # tiny frames, doubling / tree path
DEFAULT: dict[str, int] = {}  # the production defaults
MODES = (RING, SMALL, DEFAULT)


@dataclass
class Case:
    name: str
    rows: np.ndarray  # one input row per rank
    op: ReduceOp
    kwargs: dict[str, int]


def _max_payload(kwargs: dict[str, int]) -> int | None:
    return kwargs.get("chunk_bytes")


def _run_cases(
    size: int, cases: list[Case], step: Callable[[CheckedChannel, Case, int], np.ndarray | None]
) -> list[list[Any]]:
    """Runs ``step(channel, case, rank)`` for every case on every rank; returns results[case][rank]."""

    def body(rank: int, channel_for: Callable[..., CheckedChannel]) -> list[Any]:
        results = []
        for seq, case in enumerate(cases):
            ch = channel_for(seq, case.rows.dtype.itemsize, _max_payload(case.kwargs))
            results.append(step(ch, case, rank))
            ch.flush()
        return results

    per_rank = run_ranks(size, body)
    return [[per_rank[rank][i] for rank in range(size)] for i in range(len(cases))]


@pytest.mark.parametrize("size", SIZES)
def test_all_reduce_every_dtype_and_op(size: int) -> None:
    rng = np.random.default_rng(size)
    cases = []
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for length in (0, 1, 7, 23):
                for kwargs in MODES:
                    rows = exact_inputs(rng, dtype, op, size, length)
                    cases.append(Case(f"{dtype}/{op.name}/{length}/{kwargs}", rows, op, kwargs))

    def step(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        buf = case.rows[rank].copy()
        algorithms.all_reduce(ch, buf, case.op, **case.kwargs)
        return buf

    for case, results in zip(cases, _run_cases(size, cases, step), strict=True):
        assert_identical(results, case.name)
        assert_equal_values(results[0], reference(case.op, case.rows), case.name)


@pytest.mark.parametrize("size", (2, 3, 4, 5))
def test_all_reduce_random_floats_are_bit_identical_and_close(size: int) -> None:
    rng = np.random.default_rng(100 + size)
    tolerance = {
        np.dtype(np.float16): 1e-2,
        BF16: 5e-2,
        np.dtype(np.float32): 1e-5,
        np.dtype(np.float64): 1e-12,
    }
    cases = []
    for dtype in (np.float16, BF16, np.float32, np.float64, np.complex64):
        for length in (5, 300):
            for kwargs in (RING, SMALL, {"chunk_bytes": 256, "small_bytes": -1}):
                rows = rng.standard_normal((size, length)).astype(dtype)
                cases.append(Case(f"{np.dtype(dtype)}/{length}/{kwargs}", rows, ReduceOp.SUM, kwargs))

    def step(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        buf = case.rows[rank].copy()
        algorithms.all_reduce(ch, buf, ReduceOp.SUM, **case.kwargs)
        return buf

    for case, results in zip(cases, _run_cases(size, cases, step), strict=True):
        assert_identical(results, case.name)
        expected = case.rows.astype(np.complex128).sum(axis=0)
        rtol = tolerance.get(case.rows.dtype, 1e-5)
        got = results[0].astype(np.complex128)
        assert np.allclose(got, expected, rtol=rtol, atol=rtol * size * 4), case.name


@pytest.mark.parametrize("size", SIZES)
def test_all_reduce_avg_then_finish_average(size: int) -> None:
    rng = np.random.default_rng(7)
    cases = [
        Case(f"{np.dtype(d)}/{kw}", exact_inputs(rng, np.dtype(d), ReduceOp.AVG, size, 9), ReduceOp.AVG, kw)
        for d in (np.float16, BF16, np.float32, np.float64, np.complex128)
        for kw in (RING, SMALL)
    ]

    def step(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        buf = case.rows[rank].copy()
        algorithms.all_reduce(ch, buf, ReduceOp.AVG, **case.kwargs)
        finish_average(buf, ch.size)
        return buf

    for case, results in zip(cases, _run_cases(size, cases, step), strict=True):
        assert_identical(results, case.name)
        wide = np.complex128 if case.rows.dtype.kind == "c" else np.float64
        expected = (case.rows.astype(wide).sum(axis=0) / size).astype(case.rows.dtype)
        assert np.allclose(results[0].astype(wide), expected.astype(wide), rtol=1e-2), case.name


@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter(size: int) -> None:
    rng = np.random.default_rng(200 + size)
    cases = []
    for dtype in (
        np.dtype(np.int32),
        np.dtype(np.uint8),
        np.dtype(bool),
        np.dtype(np.float16),
        BF16,
        np.dtype("c8"),
    ):
        for op in ops_for(dtype):
            for width in (0, 1, 7, 19):
                for kwargs in (RING, DEFAULT):
                    rows = exact_inputs(rng, dtype, op, size, size * width)
                    cases.append(Case(f"{dtype}/{op.name}/{width}/{kwargs}", rows, op, kwargs))

    def step(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        src = case.rows[rank].copy()
        before = src.copy()
        out = np.empty(src.shape[0] // ch.size, dtype=src.dtype)
        kwargs = {"chunk_bytes": case.kwargs["chunk_bytes"]} if case.kwargs else {}
        algorithms.reduce_scatter(ch, src, out, case.op, **kwargs)
        assert src.tobytes() == before.tobytes(), "reduce_scatter wrote to src"
        return out

    for case, results in zip(cases, _run_cases(size, cases, step), strict=True):
        assert_equal_values(np.concatenate(results), reference(case.op, case.rows), case.name)


@pytest.mark.parametrize("size", SIZES)
def test_all_gather(size: int) -> None:
    rng = np.random.default_rng(300 + size)
    cases = [
        Case(f"{dtype}/{width}/{kw}", exact_inputs(rng, dtype, ReduceOp.SUM, size, width), ReduceOp.SUM, kw)
        for dtype in ALL_DTYPES
        for width in (0, 1, 7, 13)
        for kw in (RING, DEFAULT)
    ]

    def step(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        out = np.zeros(case.rows.size, dtype=case.rows.dtype)
        kwargs = {"chunk_bytes": case.kwargs["chunk_bytes"]} if case.kwargs else {}
        algorithms.all_gather(ch, case.rows[rank].copy(), out, **kwargs)
        return out

    for case, results in zip(cases, _run_cases(size, cases, step), strict=True):
        assert_identical(results, case.name)
        assert results[0].tobytes() == case.rows.reshape(-1).tobytes(), case.name


@pytest.mark.parametrize("size", SIZES)
def test_broadcast_and_reduce_from_every_root(size: int) -> None:
    rng = np.random.default_rng(400 + size)
    cases = []
    for root in range(size):
        for dtype, op in (
            (np.dtype(np.float32), ReduceOp.SUM),
            (BF16, ReduceOp.MAX),
            (np.dtype(np.int64), ReduceOp.BXOR),
        ):
            for length in (0, 1, 7, 41):
                for kwargs in MODES:
                    rows = exact_inputs(rng, dtype, op, size, length)
                    cases.append(Case(f"root{root}/{dtype}/{op.name}/{length}/{kwargs}", rows, op, kwargs))

    def root_of(case: Case) -> int:
        return int(case.name.split("/")[0][4:])

    def bcast(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        buf = case.rows[rank].copy()
        algorithms.broadcast(ch, buf, root_of(case), **case.kwargs)
        return buf

    for case, results in zip(cases, _run_cases(size, cases, bcast), strict=True):
        for result in results:
            assert result.tobytes() == case.rows[root_of(case)].tobytes(), case.name

    def red(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        buf = case.rows[rank].copy()
        algorithms.reduce(ch, buf, case.op, root_of(case), **case.kwargs)
        return buf

    for case, results in zip(cases, _run_cases(size, cases, red), strict=True):
        assert_equal_values(results[root_of(case)], reference(case.op, case.rows), case.name)


@pytest.mark.parametrize("size", SIZES)
def test_gather_scatter_all_to_all(size: int) -> None:
    rng = np.random.default_rng(500 + size)
    cases = [
        Case(
            f"{dtype}/{width}/{kw}",
            exact_inputs(rng, dtype, ReduceOp.SUM, size, size * width),
            ReduceOp.SUM,
            kw,
        )
        for dtype in (np.dtype(np.float64), np.dtype(bool), BF16, np.dtype(np.uint16))
        for width in (0, 1, 7, 17)
        for kw in (RING, DEFAULT)
    ]
    root = size // 2

    def chunked(case: Case) -> dict[str, int]:
        return {"chunk_bytes": case.kwargs["chunk_bytes"]} if case.kwargs else {}

    def gather(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray | None:
        width = case.rows.shape[1] // size
        out = np.zeros(size * width, case.rows.dtype) if rank == root else None
        algorithms.gather(ch, case.rows[rank, :width].copy(), out, root, **chunked(case))
        return out

    for case, results in zip(cases, _run_cases(size, cases, gather), strict=True):
        width = case.rows.shape[1] // size
        assert results[root].tobytes() == case.rows[:, :width].tobytes(), case.name
        assert all(r is None for i, r in enumerate(results) if i != root)

    def scatter(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        out = np.zeros(case.rows.shape[1] // size, case.rows.dtype)
        src = case.rows[rank].copy() if rank == root else None
        algorithms.scatter(ch, src, out, root, **chunked(case))
        return out

    for case, results in zip(cases, _run_cases(size, cases, scatter), strict=True):
        assert np.concatenate(results).tobytes() == case.rows[root].tobytes(), case.name

    def all_to_all(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        out = np.zeros(case.rows.shape[1], case.rows.dtype)
        algorithms.all_to_all(ch, case.rows[rank].copy(), out, **chunked(case))
        return out

    for case, results in zip(cases, _run_cases(size, cases, all_to_all), strict=True):
        blocks = case.rows.reshape(size, size, -1)  # [src rank, dst block]
        for j, result in enumerate(results):
            assert result.tobytes() == blocks[:, j].tobytes(), case.name


@pytest.mark.parametrize("size", (1, 2, 3))
def test_send_recv(size: int) -> None:
    rng = np.random.default_rng(600)
    cases = [
        Case(f"{length}/{kw}", rng.standard_normal((size, length)), ReduceOp.SUM, kw)
        for length in (0, 1, 7, 100)
        for kw in (RING, DEFAULT)
    ]

    def step(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        kwargs = {"chunk_bytes": case.kwargs["chunk_bytes"]} if case.kwargs else {}
        out = np.zeros(case.rows.shape[1])
        dst, src = (rank + 1) % size, (rank - 1) % size
        algorithms.send(ch, case.rows[rank], dst, **kwargs)
        algorithms.recv(ch, out, src, **kwargs)
        return out

    for case, results in zip(cases, _run_cases(size, cases, step), strict=True):
        for rank, result in enumerate(results):
            assert result.tobytes() == case.rows[(rank - 1) % size].tobytes(), case.name


def test_in_place_aliases() -> None:
    """all_gather from out's own block, reduce_scatter into src's own block, all_to_all in place."""
    size = 3
    rows = np.arange(size * size * 4, dtype=np.int64).reshape(size, -1)

    def body(rank: int, channel_for: Callable[..., CheckedChannel]) -> tuple[np.ndarray, ...]:
        width = 4
        gathered = np.zeros(size * width, np.int64)
        gathered[rank * width : (rank + 1) * width] = rank + 1
        algorithms.all_gather(channel_for(0), gathered[rank * width : (rank + 1) * width], gathered, chunk_bytes=16)
        src = rows[rank, : size * width].copy()
        algorithms.reduce_scatter(
            channel_for(1), src, src[rank * width : (rank + 1) * width], ReduceOp.SUM, chunk_bytes=16
        )
        exchanged = rows[rank].copy()
        algorithms.all_to_all(channel_for(2), exchanged, exchanged, chunk_bytes=16)
        return gathered, src[rank * width : (rank + 1) * width].copy(), exchanged

    results = run_ranks(size, body)
    for rank, (gathered, scattered, exchanged) in enumerate(results):
        assert gathered.tolist() == [b + 1 for b in range(size) for _ in range(4)]
        assert scattered.tolist() == rows[:, rank * 4 : (rank + 1) * 4].sum(axis=0).tolist()
        assert exchanged.tolist() == rows.reshape(size, size, -1)[:, rank].reshape(-1).tolist()


def test_frames_per_call_match_the_algorithm() -> None:
    """Ring all-reduce sends 2(n-1) frames per chunk column; doubling log2(n) rounds (+fold)."""
    size, length = 4, 64  # float64: 16 elements per block, 8 per 64-byte frame -> 2 chunks per block

    def body(rank: int, channel_for: Callable[..., CheckedChannel]) -> tuple[int, int]:
        ring, small = channel_for(0, 8, 64), channel_for(1, 8, 64)
        algorithms.all_reduce(ring, np.ones(length), ReduceOp.SUM, chunk_bytes=64, small_bytes=-1)
        algorithms.all_reduce(small, np.ones(length), ReduceOp.SUM, chunk_bytes=64, small_bytes=1 << 20)
        return ring.frames, small.frames

    for ring_frames, small_frames in run_ranks(size, body):
        assert ring_frames == 2 * (size - 1) * 2
        assert small_frames == 2 * (length // 8)


@pytest.mark.parametrize("size", (2, 3, 5))
def test_nan_payloads_are_identical_on_every_rank(size: int) -> None:
    """Which NaN survives depends on operand order; every rank must still end with the same bits."""
    rows = np.zeros((size, 12), np.uint32)
    for rank in range(size):
        rows[rank] = 0x7FC00000 | (rank + 1) << 8 | np.arange(12, dtype=np.uint32)
    floats = rows.view(np.float32)
    cases = [
        Case(f"{op.name}/{kw}", floats, op, kw)
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX)
        for kw in (RING, SMALL)
    ]

    def step(ch: CheckedChannel, case: Case, rank: int) -> np.ndarray:
        buf = case.rows[rank].copy()
        algorithms.all_reduce(ch, buf, case.op, **case.kwargs)
        return buf

    for case, results in zip(cases, _run_cases(size, cases, step), strict=True):
        assert_identical(results, case.name)
        assert np.isnan(results[0]).all(), case.name
