"""Per-rank running totals of collectives, by (op, group), sent to the coordinator with each heartbeat.

Totals are cumulative, so a lost or late heartbeat loses nothing: the coordinator keeps the latest
totals of each member and Prometheus computes rates from them. Recording a call is a dictionary
lookup and a few additions under a lock (well under a microsecond), cheap enough to be always on.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable
from typing import Any

from collsvc.proto.v1 import common_pb2

# Upper bounds (seconds) of the collective time histogram; a last bucket (+Inf) catches the rest.
# From a 4 KiB shared-memory call (~0.2 ms) to a stuck one (minutes).
SECONDS_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

# A member reports at most this many (op, group) pairs; more would only come from thousands of groups.
MAX_ENTRIES = 256

_ITEMSIZE = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def call_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of one rank's input, from a call's signature (0 for calls without data, like barrier)."""
    if not dtype:
        return 0
    return math.prod(shape) * _ITEMSIZE.get(dtype, 0)


def bus_bytes(op: str, nbytes: int, size: int) -> float:
    """Bytes each rank moves on its busiest link (the nccl-tests convention), for bus bandwidth.

    ``nbytes`` is this rank's input; for all_gather the nccl-tests size is the output (``size`` x input).
    """
    if size <= 1:
        return 0.0
    if op == "all_reduce":
        return nbytes * 2 * (size - 1) / size
    if op == "all_gather":
        return float(nbytes * (size - 1))
    if op in ("reduce_scatter", "all_to_all"):
        return nbytes * (size - 1) / size
    return float(nbytes)


# Running totals of one (op, group), as a list for speed: count, failed, bytes, seconds, bus bytes, buckets.
_COUNT, _FAILED, _BYTES, _SECONDS, _BUS, _BUCKETS = range(6)


class RepeatedCallCounter:
    """Counts finished calls of one (op, group) and size, for one thread that records many (the
    Communicator's fast path): no lookup and no lock per call, and only what varies per call (the count,
    the seconds, the bucket) is added; :meth:`CollectiveStats.snapshot` adds these into the totals.

    A call of one group runs on one thread at a time, so no other writer adds to a counter meanwhile; a
    reader may see one call half counted (its count but not yet its seconds), which the next heartbeat
    corrects.
    """

    __slots__ = ("calls", "seconds", "buckets", "nbytes", "bus")

    def __init__(self, nbytes: int, bus: float) -> None:
        self.calls = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(SECONDS_BUCKETS) + 1)
        self.nbytes, self.bus = nbytes, bus

    def add(self, seconds: float) -> None:
        """One call that ended well after ``seconds``."""
        self.calls += 1
        self.seconds += seconds
        self.buckets[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1


class CollectiveStats:
    """Thread-safe running totals of this rank's collectives."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, str], list[Any]] = {}
        # Per (op, group): the counters of its repeated calls, one per size (a group's calls run on one
        # thread, so the fast paths of one size may share one).
        self._counters: dict[tuple[str, str], dict[int, RepeatedCallCounter]] = {}

    def counter(self, op: str, group: str, nbytes: int, bus: float) -> RepeatedCallCounter | None:
        """A counter of ``op`` calls in ``group`` of ``nbytes`` (``bus`` from :func:`bus_bytes`), or None
        when no more (op, group) pairs are kept (:data:`MAX_ENTRIES`; :meth:`record` drops them too)."""
        with self._lock:
            if self._kept_totals(op, group) is None:
                return None
            by_size = self._counters.setdefault((op, group), {})
            counter = by_size.get(nbytes)
            if counter is None:
                counter = by_size[nbytes] = RepeatedCallCounter(nbytes, bus)
            return counter

    def record(self, op: str, group: str, nbytes: int, seconds: float, bus: float, ok: bool) -> None:
        """Adds one finished call (``bus`` from :func:`bus_bytes`; ``ok`` False for a call that raised)."""
        bucket = bisect.bisect_left(SECONDS_BUCKETS, seconds)
        with self._lock:
            totals = self._kept_totals(op, group)
            if totals is None:
                return
            totals[_COUNT] += 1
            if not ok:
                totals[_FAILED] += 1
            totals[_BYTES] += nbytes
            totals[_SECONDS] += seconds
            totals[_BUS] += bus
            totals[_BUCKETS][bucket] += 1

    def _kept_totals(self, op: str, group: str) -> list[Any] | None:
        """The running totals of (``op``, ``group``), made if new, or None when :data:`MAX_ENTRIES` pairs
        are kept already (the caller holds the lock)."""
        totals = self._totals.get((op, group))
        if totals is None:
            if len(self._totals) >= MAX_ENTRIES:
                return None
            totals = self._totals[(op, group)] = [0, 0, 0, 0.0, 0.0, [0] * (len(SECONDS_BUCKETS) + 1)]
        return totals

    def _with_counters(self, key: tuple[str, str], totals: list[Any]) -> list[Any]:
        """``totals`` of ``key`` plus what its counters counted (a new list; the caller holds the lock)."""
        count, failed, nbytes, seconds, bus, buckets = totals
        buckets = list(buckets)
        for counter in self._counters.get(key, {}).values():
            calls = counter.calls
            count += calls
            nbytes += calls * counter.nbytes
            seconds += counter.seconds
            bus += calls * counter.bus
            for index, bucket_count in enumerate(counter.buckets):
                buckets[index] += bucket_count
        return [count, failed, nbytes, seconds, bus, buckets]

    def snapshot(self) -> list[common_pb2.CollectiveStats]:
        """The totals as heartbeat messages (one per (op, group))."""
        with self._lock:
            every = [(key, self._with_counters(key, t)) for key, t in self._totals.items()]
        return [
            common_pb2.CollectiveStats(
                op=op,
                group=group,
                count=t[_COUNT],
                bytes=t[_BYTES],
                seconds=t[_SECONDS],
                bucket_counts=t[_BUCKETS],
                bus_bytes=t[_BUS],
                failed=t[_FAILED],
            )
            for (op, group), t in every
        ]


class Histogram:
    """A plain histogram over :data:`SECONDS_BUCKETS` (not thread-safe: the coordinator's event loop owns it)."""

    def __init__(self) -> None:
        self.buckets = [0] * (len(SECONDS_BUCKETS) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1
        self.total += seconds
        self.count += 1


def cumulative_buckets(counts: list[int]) -> list[tuple[str, int]]:
    """Per-bucket counts as Prometheus' cumulative ``(le, count)`` pairs, ending with ``+Inf``."""
    bounds = [repr(b) for b in SECONDS_BUCKETS] + ["+Inf"]
    out, running = [], 0
    for bound, count in zip(bounds, counts, strict=True):
        running += count
        out.append((bound, running))
    return out


def keep_latest(table: dict[tuple[str, str], Any], entries: Iterable[Any]) -> None:
    """Keeps each (op, group)'s latest running totals from a heartbeat (malformed entries are skipped).

    The coordinator calls this with a member's table; at most :data:`MAX_ENTRIES` pairs are kept.
    """
    for entry in entries:
        key = (entry.op, entry.group)
        if len(entry.bucket_counts) != len(SECONDS_BUCKETS) + 1 or len(entry.op) > 64 or len(entry.group) > 256:
            continue
        if key not in table and len(table) >= MAX_ENTRIES:
            continue
        table[key] = entry
