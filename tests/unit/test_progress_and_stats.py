"""What the fast path records without locks (StreamProgress, RepeatedCallCounter) reaches the same
snapshots that heartbeats carry and the flight recorder dumps, alongside the general path's records."""

from __future__ import annotations

from collsvc.client.progress import ProgressTracker
from collsvc.observability.stats import MAX_ENTRIES, SECONDS_BUCKETS, CollectiveStats


def test_a_stream_recorder_and_the_tracker_keep_one_progress_per_group() -> None:
    tracker = ProgressTracker(capacity=4)
    general = tracker.start("world", 1, "all_reduce float32[8]")
    tracker.finish(general)
    stream = tracker.stream("world")
    record = stream.start(2, "all_reduce float32[8]", 100.0)
    (progress,) = tracker.snapshot()
    assert (progress.group, progress.started_seq, progress.finished_seq) == ("world", 2, 1)
    stream.finish(record, 100.25)
    (progress,) = tracker.snapshot()
    assert (progress.started_seq, progress.finished_seq, progress.last_op) == (2, 2, "all_reduce float32[8]")
    later = tracker.start("world", 3, "barrier")  # the general path goes on from there
    tracker.finish(later, "CollectiveTimeoutError")
    (progress,) = tracker.snapshot()
    assert (progress.started_seq, progress.finished_seq) == (3, 2)
    recent = tracker.recent()
    assert [(r["seq"], r["outcome"]) for r in recent] == [(1, "ok"), (2, "ok"), (3, "CollectiveTimeoutError")]
    assert recent[1]["seconds"] == 0.25
    for seq in range(4, 10):  # the flight recorder keeps the newest `capacity`
        stream.finish(stream.start(seq, "barrier", 0.0), 0.0)
    assert [r["seq"] for r in tracker.recent()] == [6, 7, 8, 9]


def test_a_repeated_call_counter_adds_to_the_totals_the_heartbeat_sends() -> None:
    stats = CollectiveStats()
    stats.record("all_reduce", "world", 4096, 0.002, 4096.0, True)
    counter = stats.counter("all_reduce", "world", 4096, 4096.0)
    assert counter is not None
    for seconds in (0.00005, 0.0003, 100.0):
        counter.add(seconds)
    (totals,) = stats.snapshot()
    assert (totals.count, totals.bytes, totals.failed, totals.bus_bytes) == (4, 4 * 4096, 0, 4 * 4096.0)
    assert abs(totals.seconds - 100.00235) < 1e-9
    buckets = list(totals.bucket_counts)
    assert len(buckets) == len(SECONDS_BUCKETS) + 1
    assert buckets[0] == 1 and buckets[2] == 1 and buckets[4] == 1 and buckets[-2] == 1  # 300 s bucket: 100 s


def test_no_counter_once_the_statistics_keep_no_more_pairs() -> None:
    stats = CollectiveStats()
    for group in range(MAX_ENTRIES):
        assert stats.counter("barrier", f"g{group}", 0, 0.0) is not None
    assert stats.counter("barrier", "one-too-many", 0, 0.0) is None
    assert stats.counter("barrier", "g0", 0, 0.0) is not None  # a kept pair still counts


def test_counters_of_one_pair_add_up_by_size_in_the_snapshot() -> None:
    stats = CollectiveStats()
    small = stats.counter("all_reduce", "world", 16, 24.0)
    large = stats.counter("all_reduce", "world", 4096, 6144.0)
    assert small is not None and large is not None and small is not large
    assert stats.counter("all_reduce", "world", 16, 24.0) is small  # one writer per group: shared
    small.add(0.001)
    small.add(0.001)
    large.add(0.5)
    stats.record("all_reduce", "world", 16, 0.003, 24.0, False)
    (totals,) = stats.snapshot()
    assert (totals.count, totals.failed, totals.bytes) == (4, 1, 3 * 16 + 4096)
    assert totals.bus_bytes == 3 * 24.0 + 6144.0
    assert abs(totals.seconds - 0.505) < 1e-12
    assert sum(totals.bucket_counts) == 4
    large.add(0.5)  # later calls show in the next snapshot, the earlier one unchanged
    assert stats.snapshot()[0].count == 5 and totals.count == 4
