"""The timing protocol of collsvc's benchmarks, one copy for every library that is measured with it.

``collsvc bench`` (collsvc/bench/worker.py) and torch gloo's ranks in benchmarks/compare_gloo.py
(benchmarks/gloo_worker.py) both call :func:`measure` with their own library's collective, barrier and
gather, and build their rows with :func:`result_row`, so the two sides cannot drift apart:

1. Each rank cycles through :func:`rotation_count` distinct buffer sets (input, and output unless the
   call works in place), so a library is not flattered by finding the same bytes in the cache call
   after call, nor by anything it remembers about one buffer.
2. Before every call (warm-up and timed), the library's own barrier; the clock runs around the call
   alone.
3. Every rank's list of times is gathered and an iteration's time is the slowest rank's
   (:func:`slowest_per_iteration`): a collective is done when its last rank is done.
4. p50 and p99 over the iterations (:func:`percentile`); a caller that repeats the run takes the
   median of each over the repeats (:func:`median_of_repeats`).

Only the standard library is used here: no numpy, torch or collsvc client.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "gather",
    "scatter",
    "send_recv",
)
# torch.distributed can only run these in place, so both sides do (collsvc with ``out=x``). send_recv:
# even ranks send their buffer to the next rank, which receives into its own (an odd last rank idles).
IN_PLACE = frozenset({"all_reduce", "broadcast", "reduce", "send_recv"})
# Collectives whose element count must be a multiple of the world size (one block per rank).
_BLOCKED = frozenset({"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"})

# The buffer sets of one size should reach the last-level cache's size (32 MiB on the 2-core machine
# the recorded numbers come from) when MAX_BUFFERS sets suffice for that, ...
CACHE_BYTES = 32 << 20
# ... with at least two sets (no call finds its input where the previous call left it) and at most
# eight (the count of live arrays stays small; 8 x 4 MiB already reaches CACHE_BYTES).
MIN_BUFFERS = 2
MAX_BUFFERS = 8

_T = TypeVar("_T")


@dataclass(frozen=True)
class Layout:
    """The element counts of one call, nccl-tests style.

    Attributes:
        count: the call's size in elements: the larger buffer (all_gather's output, reduce_scatter's
            input), which is what the table's size, algbw and busbw refer to.
        in_count: elements of each rank's input.
        out_count: elements of each rank's separate output; 0 when the call works in place.
    """

    count: int
    in_count: int
    out_count: int

    @property
    def in_place(self) -> bool:
        return self.out_count == 0

    def set_bytes(self, itemsize: int) -> int:
        """Bytes of one buffer set (input plus separate output) on one rank."""
        return (self.in_count + self.out_count) * itemsize


def layout(op: str, nbytes: int, world_size: int, itemsize: int) -> Layout:
    """The buffers one rank needs for ``op`` on about ``nbytes`` bytes.

    The count is rounded down to whole elements, and for blocked collectives to a multiple of the world
    size (at least one element per rank).

    Raises:
        ValueError: unknown ``op``, or a size, world size or item size below 1.
    """
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r} (one of {', '.join(COLLECTIVES)})")
    if nbytes < 1 or world_size < 1 or itemsize < 1:
        raise ValueError(f"need positive sizes, got nbytes={nbytes} world_size={world_size} itemsize={itemsize}")
    count = max(nbytes // itemsize, 1)
    if op in _BLOCKED:
        count = max(count - count % world_size, world_size)
    in_count = count // world_size if op in ("all_gather", "gather") else count
    separate_output = count // world_size if op in ("reduce_scatter", "scatter") else count
    out_count = 0 if op in IN_PLACE else separate_output
    return Layout(count=count, in_count=in_count, out_count=out_count)


def rotation_count(set_bytes: int) -> int:
    """How many distinct buffer sets of ``set_bytes`` each a rank cycles through.

    Enough sets to reach CACHE_BYTES in all, within MIN_BUFFERS..MAX_BUFFERS. Sets of 4 MiB and more
    reach CACHE_BYTES; smaller ones stop at MAX_BUFFERS. Memory stays bounded: from 16 MiB per set on,
    two sets are used, at most 4 x the message size (a set is at most twice the message).

    Raises:
        ValueError: ``set_bytes`` < 1.
    """
    if set_bytes < 1:
        raise ValueError(f"set_bytes must be >= 1, got {set_bytes}")
    return max(MIN_BUFFERS, min(MAX_BUFFERS, math.ceil(CACHE_BYTES / set_bytes)))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, interpolating linearly between the nearest ranks (numpy's default).

    Raises:
        ValueError: ``values`` is empty, or ``q`` is outside 0..100.
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _same_length(per_rank: Sequence[Sequence[float]]) -> int:
    if not per_rank:
        raise ValueError("no ranks")
    lengths = {len(times) for times in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks ran different numbers of iterations: {[len(t) for t in per_rank]}")
    return lengths.pop()


def slowest_per_iteration(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each iteration's time on its slowest rank (``per_rank[r][i]``: rank r's time of iteration i).

    Raises:
        ValueError: no ranks, or ranks with different numbers of iterations.
    """
    _same_length(per_rank)
    return [max(column) for column in zip(*per_rank, strict=True)]


def release_spread(per_rank_starts: Sequence[Sequence[float]]) -> list[float]:
    """How far apart the ranks started each iteration (latest start - earliest start).

    The start times must come from one clock shared by the ranks' processes (``time.perf_counter`` is
    CLOCK_MONOTONIC on Linux, the same in every process of a host). The spread is the barrier's
    release skew, which the slowest rank's time includes.

    Raises:
        ValueError: no ranks, or ranks with different numbers of iterations.
    """
    _same_length(per_rank_starts)
    return [max(column) - min(column) for column in zip(*per_rank_starts, strict=True)]


@dataclass(frozen=True)
class Measurement:
    """One size measured on every rank (the same on every rank: built from gathered values).

    Attributes:
        p50, p99: percentiles over iterations of the slowest rank's time, seconds.
        spread_p50: median over iterations of the ranks' start spread after the barrier, seconds.
        iterations: timed iterations.
        cpu_seconds: CPU seconds (user + system, every thread) per rank inside the timed calls,
            averaged over the ranks.
    """

    p50: float
    p99: float
    spread_p50: float
    iterations: int
    cpu_seconds: float


def measure(
    call: Callable[[_T], object],
    buffers: Sequence[_T],
    *,
    barrier: Callable[[], object],
    gather: Callable[[list[float]], Sequence[Sequence[float]]],
    warmup: int,
    iterations: int,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.process_time,
) -> Measurement:
    """Runs the protocol on this rank; every rank of the job must call it with the same counts.

    Iteration i (warm-up included) calls ``call(buffers[i % len(buffers)])`` after ``barrier()``.
    ``gather(values)`` must return every rank's list of values, in rank order, on every rank.

    Raises:
        ValueError: no buffers, ``warmup`` < 0, ``iterations`` < 1, or gathered lists that disagree.
        Whatever ``call``, ``barrier`` or ``gather`` raise.
    """
    if not buffers:
        raise ValueError("measure needs at least one buffer set")
    if warmup < 0 or iterations < 1:
        raise ValueError(f"need warmup >= 0 and iterations >= 1, got {warmup} and {iterations}")
    for index in range(warmup):
        barrier()
        call(buffers[index % len(buffers)])
    starts: list[float] = []
    durations: list[float] = []
    cpu = 0.0
    for index in range(warmup, warmup + iterations):
        barrier()
        cpu_before = cpu_clock()
        start = clock()
        call(buffers[index % len(buffers)])
        end = clock()
        cpu += cpu_clock() - cpu_before
        starts.append(start)
        durations.append(end - start)
    # One gather for everything: [cpu, starts..., durations...] from every rank.
    gathered = gather([cpu, *starts, *durations])
    _same_length(gathered)
    if len(gathered[0]) != 1 + 2 * iterations:
        raise ValueError(f"gather returned {len(gathered[0])} values per rank, expected {1 + 2 * iterations}")
    slowest = slowest_per_iteration([values[1 + iterations :] for values in gathered])
    spread = release_spread([values[1 : 1 + iterations] for values in gathered])
    return Measurement(
        p50=percentile(slowest, 50),
        p99=percentile(slowest, 99),
        spread_p50=percentile(spread, 50),
        iterations=iterations,
        cpu_seconds=statistics.fmean(values[0] for values in gathered),
    )


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus bandwidth factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all
    (n-1)/n; broadcast, reduce and send_recv 1; gather and scatter (n-1)/n (what passes through the root)."""
    if op == "all_reduce":
        return 2 * (world_size - 1) / world_size if world_size > 1 else 0.0
    if op in _BLOCKED:
        return (world_size - 1) / world_size if world_size > 1 else 0.0
    return 1.0


def result_row(
    op: str, world_size: int, shape: Layout, dtype: str, itemsize: int, buffers: int, result: Measurement
) -> dict[str, Any]:
    """The JSON row of one size, the same keys for every library; bandwidths use the p50 time."""
    size_bytes = shape.count * itemsize
    algbw = size_bytes / result.p50 / 1e9
    gb_moved = size_bytes * result.iterations / 1e9
    return {
        "op": op,
        "ranks": world_size,
        "bytes": size_bytes,
        "count": shape.count,
        "dtype": dtype,
        "in_place": shape.in_place,
        "buffers": buffers,
        "iters": result.iterations,
        "p50": result.p50,
        "p99": result.p99,
        "spread_p50": result.spread_p50,
        "algbw": algbw,
        "busbw": algbw * bus_factor(op, world_size),
        "cpu_s_per_gb": result.cpu_seconds / gb_moved,
    }


def median_of_repeats(runs: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One row per size: the median p50 and the median p99 over repeated runs (bandwidths recomputed).

    Other keys come from the first run; ``repeats`` says how many runs went in.

    Raises:
        ValueError: no runs, or runs whose sizes differ.
    """
    if not runs:
        raise ValueError("no runs to combine")
    sizes = [[row["bytes"] for row in run] for run in runs]
    if any(s != sizes[0] for s in sizes):
        raise ValueError(f"runs measured different sizes: {sizes}")
    combined = []
    for index, first in enumerate(runs[0]):
        row = dict(first)
        for key in ("p50", "p99", "spread_p50", "cpu_s_per_gb"):
            row[key] = statistics.median(run[index][key] for run in runs)
        row["algbw"] = row["bytes"] / row["p50"] / 1e9
        row["busbw"] = row["algbw"] * bus_factor(row["op"], row["ranks"])
        row["repeats"] = len(runs)
        combined.append(row)
    return combined
