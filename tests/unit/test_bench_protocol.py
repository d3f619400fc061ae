"""The benchmarks' shared timing protocol (collsvc/bench/protocol.py): its pure parts, and its loop
driven by a scripted clock on one rank whose peer's times are given."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from collsvc.bench import protocol
from collsvc.bench.protocol import (
    CACHE_BYTES,
    COLLECTIVES,
    MAX_BUFFERS,
    MIN_BUFFERS,
    Measurement,
    bus_factor,
    layout,
    measure,
    median_of_repeats,
    percentile,
    release_spread,
    result_row,
    rotation_count,
    slowest_per_iteration,
)

MiB = 1 << 20


# ---- percentiles ------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
@pytest.mark.parametrize("length", [1, 2, 3, 20, 50, 101])
def test_percentile_matches_numpy_linear(q: float, length: int) -> None:
    values = [random.Random(length * 1000 + int(q)).expovariate(1.0) for _ in range(length)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_of_known_values() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 99) == pytest.approx(4.96)  # between the two largest, near the top


@pytest.mark.parametrize(("values", "q"), [([], 50), ([1.0], -1), ([1.0], 100.5)])
def test_percentile_rejects_empty_and_out_of_range(values: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        percentile(values, q)


# ---- slowest rank per iteration -----------------------------------------------------------------


def test_an_iteration_takes_as_long_as_its_slowest_rank() -> None:
    per_rank = [[1.0, 5.0, 2.0], [3.0, 1.0, 2.0], [2.0, 2.0, 7.0]]
    assert slowest_per_iteration(per_rank) == [3.0, 5.0, 7.0]


def test_the_slowest_rank_can_differ_from_every_ranks_median() -> None:
    # Each rank alone has a median of 1; the iterations (slowest rank each) have a median of 9.
    per_rank = [[9.0, 1.0, 1.0], [1.0, 9.0, 1.0], [1.0, 1.0, 9.0]]
    assert percentile(slowest_per_iteration(per_rank), 50) == 9.0


def test_release_spread_is_latest_minus_earliest_start() -> None:
    assert release_spread([[10.0, 20.0], [10.5, 19.0]]) == pytest.approx([0.5, 1.0])


@pytest.mark.parametrize("reduce", [slowest_per_iteration, release_spread])
def test_per_rank_lists_must_agree(reduce: Callable[[list[list[float]]], list[float]]) -> None:
    with pytest.raises(ValueError, match="different numbers"):
        reduce([[1.0, 2.0], [1.0]])
    with pytest.raises(ValueError, match="no ranks"):
        reduce([])


# ---- buffer layout and rotation -------------------------------------------------------------------


def test_layout_follows_nccl_tests_sizes() -> None:
    assert layout("all_reduce", 4096, 4, 4) == protocol.Layout(count=1024, in_count=1024, out_count=0)
    assert layout("all_gather", 4096, 4, 4) == protocol.Layout(count=1024, in_count=256, out_count=1024)
    assert layout("reduce_scatter", 4096, 4, 4) == protocol.Layout(count=1024, in_count=1024, out_count=256)
    assert layout("all_to_all", 4096, 4, 4) == protocol.Layout(count=1024, in_count=1024, out_count=1024)
    assert layout("gather", 4096, 4, 4) == protocol.Layout(count=1024, in_count=256, out_count=1024)
    assert layout("scatter", 4096, 4, 4) == protocol.Layout(count=1024, in_count=1024, out_count=256)
    assert layout("broadcast", 4096, 4, 4).in_place and layout("reduce", 4096, 4, 4).in_place


@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"])
@pytest.mark.parametrize(("nbytes", "world_size"), [(4096, 3), (4, 4), (12, 5), (1, 2)])
def test_blocked_layouts_give_every_rank_a_whole_block(op: str, nbytes: int, world_size: int) -> None:
    shape = layout(op, nbytes, world_size, 4)
    assert shape.count % world_size == 0 and shape.count >= world_size
    big, small = max(shape.in_count, shape.out_count), min(shape.in_count, shape.out_count)
    assert big == shape.count and small in (shape.count, shape.count // world_size)


@pytest.mark.parametrize(("op", "nbytes", "world_size"), [("gather_all", 4096, 2), ("all_reduce", 0, 2)])
def test_layout_rejects_unknown_ops_and_empty_sizes(op: str, nbytes: int, world_size: int) -> None:
    with pytest.raises(ValueError):
        layout(op, nbytes, world_size, 4)


@pytest.mark.parametrize(
    ("set_bytes", "expected"),
    [(1, MAX_BUFFERS), (4096, MAX_BUFFERS), (1 * MiB, MAX_BUFFERS), (4 * MiB, 8), (8 * MiB, 4), (16 * MiB, 2)],
)
def test_rotation_count_examples(set_bytes: int, expected: int) -> None:
    assert rotation_count(set_bytes) == expected


def test_rotation_count_bounds_for_every_op_size_and_world_size() -> None:
    for op in COLLECTIVES:
        for world_size in (2, 3, 4, 5):
            for nbytes in [4 << shift for shift in range(0, 25)] + [3 * MiB, 24 * MiB, 48 * MiB]:
                shape = layout(op, nbytes, world_size, 4)
                set_bytes = shape.set_bytes(4)
                count = rotation_count(set_bytes)
                total = count * set_bytes
                assert MIN_BUFFERS <= count <= MAX_BUFFERS
                # Below the cap, the sets together reach the last-level cache's size.
                assert count == MAX_BUFFERS or total >= CACHE_BYTES
                assert count == MIN_BUFFERS or total - set_bytes < CACHE_BYTES  # no set more than needed
                message = shape.count * 4
                if message >= 16 * MiB:
                    assert total <= 4 * message, (op, world_size, nbytes, count)


def test_rotation_count_rejects_empty_sets() -> None:
    with pytest.raises(ValueError):
        rotation_count(0)


def test_bus_factors() -> None:
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == bus_factor("all_to_all", 4) == 0.75
    assert bus_factor("gather", 4) == bus_factor("scatter", 4) == 0.75
    assert bus_factor("broadcast", 4) == bus_factor("reduce", 4) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0


# ---- the loop ---------------------------------------------------------------------------------------


class ScriptedRank:
    """Rank 0 of two: a clock that advances by the duration scripted for each call, and a gather that
    returns this rank's values next to the peer's given ones. Records the order of events."""

    def __init__(self, durations: Sequence[float], peer: list[float]) -> None:
        self.now = 100.0
        self.durations = list(durations)
        self.peer = peer
        self.events: list[str] = []

    def clock(self) -> float:
        return self.now

    def cpu_clock(self) -> float:
        return self.now / 10  # a tenth of the wall time is this process's CPU

    def barrier(self) -> None:
        self.events.append("barrier")
        self.now += 1.0  # barrier time is not measured

    def call(self, buffer: str) -> None:
        self.events.append(buffer)
        self.now += self.durations.pop(0)

    def gather(self, values: list[float]) -> list[list[float]]:
        self.events.append("gather")
        return [values, self.peer]


def test_measure_times_each_call_after_a_barrier_and_takes_the_slowest_rank() -> None:
    # Two warm-up calls (3 s each, not timed), then 4 timed calls on this rank.
    rank = ScriptedRank([3.0, 3.0, 0.1, 0.2, 0.3, 0.4], peer=[])
    iterations = 4
    peer_starts = [0.0] * iterations  # only their spread matters
    peer_durations = [0.5, 0.1, 0.1, 0.1]
    rank.peer = [0.8, *peer_starts, *peer_durations]
    result = measure(
        rank.call,
        ["a", "b", "c"],
        barrier=rank.barrier,
        gather=rank.gather,
        warmup=2,
        iterations=iterations,
        clock=rank.clock,
        cpu_clock=rank.cpu_clock,
    )
    # Buffers rotate across warm-up and timed calls alike; a barrier precedes every call.
    warm_up = ["barrier", "a", "barrier", "b"]
    timed = ["barrier", "c", "barrier", "a", "barrier", "b", "barrier", "c"]
    assert rank.events == [*warm_up, *timed, "gather"]
    slowest = [0.5, 0.2, 0.3, 0.4]
    assert result.p50 == pytest.approx(percentile(slowest, 50))
    assert result.p99 == pytest.approx(percentile(slowest, 99))
    assert result.iterations == iterations
    assert result.cpu_seconds == pytest.approx((0.1 + 0.8) / 2)  # this rank: 1.0 s wall / 10; peer: 0.8
    assert result.spread_p50 > 100  # this rank's clock started at 100, the peer's starts are 0


def test_measure_rejects_nonsense_counts() -> None:
    rank = ScriptedRank([], peer=[])
    for warmup, iterations, buffers in [(-1, 1, ["a"]), (0, 0, ["a"]), (0, 1, [])]:
        with pytest.raises(ValueError):
            measure(rank.call, buffers, barrier=rank.barrier, gather=rank.gather, warmup=warmup, iterations=iterations)


def test_measure_rejects_a_gather_that_lost_values() -> None:
    rank = ScriptedRank([0.1], peer=[0.0, 1.0])  # the peer sent 2 values, this rank 3
    with pytest.raises(ValueError):
        measure(rank.call, ["a"], barrier=rank.barrier, gather=rank.gather, warmup=0, iterations=1)


# ---- rows and repeats ---------------------------------------------------------------------------------


def row(p50: float, p99: float, nbytes: int = 4096) -> dict[str, object]:
    shape = layout("all_reduce", nbytes, 2, 4)
    return result_row("all_reduce", 2, shape, "float32", 4, 8, Measurement(p50, p99, 0.0, 10, 0.01))


def test_result_row_bandwidths_come_from_p50() -> None:
    r = row(0.001, 0.010, nbytes=1 * MiB)
    assert r["algbw"] == pytest.approx(MiB / 0.001 / 1e9)
    assert r["busbw"] == pytest.approx(r["algbw"])  # all_reduce over 2 ranks: factor 1
    assert r["in_place"] is True and r["buffers"] == 8 and r["iters"] == 10


def test_median_of_repeats_takes_each_percentile_median_separately() -> None:
    runs = [[row(1.0, 9.0)], [row(3.0, 4.0)], [row(2.0, 5.0)]]
    (combined,) = median_of_repeats(runs)
    assert (combined["p50"], combined["p99"], combined["repeats"]) == (2.0, 5.0, 3)
    assert combined["algbw"] == pytest.approx(4096 / 2.0 / 1e9)


def test_median_of_repeats_rejects_no_runs_and_different_sizes() -> None:
    with pytest.raises(ValueError):
        median_of_repeats([])
    with pytest.raises(ValueError, match="different sizes"):
        median_of_repeats([[row(1.0, 2.0, 4096)], [row(1.0, 2.0, 8192)]])
