"""The coordinator's Prometheus endpoint: ``/metrics`` built from the live job state at each scrape.

Nothing is counted twice: job state (members, failures, barrier waits, heartbeat ages) and each
member's collective totals (carried on its heartbeats) are read when Prometheus asks. The HTTP server
runs in threads of its own; a scrape takes a snapshot on the coordinator's event loop, which owns the
state, so it never reads a dictionary while a request changes it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import start_wsgi_server
from prometheus_client.registry import Collector, CollectorRegistry

from collsvc.observability.stats import cumulative_buckets
from collsvc.server.services.hub import Hub
from collsvc.server.state.common import MemberState

log = logging.getLogger(__name__)

_SNAPSHOT_TIMEOUT_S = 5.0
_STATES = {s: s.name.lower() for s in MemberState}


@dataclass
class Snapshot:
    """Everything one scrape exports, copied on the event loop."""

    jobs: int = 0
    members: list[tuple[str, str, int]] = field(default_factory=list)  # job, state, count
    failures: list[tuple[str, str, int]] = field(default_factory=list)  # job, kind, count
    barrier_waits: list[tuple[str, str, list[int], float]] = field(default_factory=list)  # job, group, buckets, sum
    heartbeat_ages: list[tuple[str, str, str, float]] = field(default_factory=list)  # job, rank, host, seconds
    calls: list[tuple[tuple[str, str, str, str, str], Any]] = field(default_factory=list)  # labels, stats


def take_snapshot(hub: Hub) -> Snapshot:
    """Copies what the metrics need from ``hub`` (call it on the hub's event loop)."""
    snap = Snapshot()
    for job in hub.registry.jobs():
        snap.jobs += 1
        members = job.members if job.complete else job.pending_members()
        counts = dict.fromkeys(_STATES.values(), 0)
        for member in members:
            counts[_STATES[member.state]] += 1
        snap.members.extend((job.job_id, state, count) for state, count in counts.items())
        snap.failures.extend((job.job_id, kind, count) for kind, count in job.failure_counts.items())
        for group, histogram in job.barrier_waits.items():
            snap.barrier_waits.append((job.job_id, group, list(histogram.buckets), histogram.total))
        if not job.complete:
            continue
        for member in members:
            rank = str(member.rank)
            if member.state == MemberState.ALIVE:
                snap.heartbeat_ages.append((job.job_id, rank, member.host, job.seconds_since_heartbeat(member)))
            for (op, group), stats in member.stats.items():
                snap.calls.append(((job.job_id, rank, member.host, op, group), stats))
    return snap


def families(snap: Snapshot) -> Iterator[Metric]:
    """The Prometheus metric families of one snapshot."""
    jobs = GaugeMetricFamily("collsvc_jobs", "Jobs this coordinator holds.")
    jobs.add_metric([], snap.jobs)
    yield jobs
    members = GaugeMetricFamily("collsvc_job_members", "Members of a job by state.", labels=["job", "state"])
    for job, state, count in snap.members:
        members.add_metric([job, state], count)
    yield members
    failures = CounterMetricFamily(
        "collsvc_job_failures",
        "Failures in a job by kind: rank_failed, aborted, mismatch, barrier_timeout.",
        labels=["job", "kind"],
    )
    for job, kind, count in snap.failures:
        failures.add_metric([job, kind], count)
    yield failures
    waits = HistogramMetricFamily(
        "collsvc_barrier_wait_seconds", "Seconds members waited in coordinator barriers.", labels=["job", "group"]
    )
    for job, group, buckets, total in snap.barrier_waits:
        waits.add_metric([job, group], cumulative_buckets(buckets), total)
    yield waits
    ages = GaugeMetricFamily(
        "collsvc_heartbeat_age_seconds", "Seconds since a live member's last heartbeat.", labels=["job", "rank", "host"]
    )
    for job, rank, host, age in snap.heartbeat_ages:
        ages.add_metric([job, rank, host], age)
    yield ages
    yield from _call_families(snap.calls)


def _call_families(calls: Sequence[tuple[tuple[str, str, str, str, str], Any]]) -> Iterator[Metric]:
    labels = ["job", "rank", "host", "op", "group"]
    count = CounterMetricFamily("collsvc_collectives", "Collectives a rank finished.", labels=labels)
    failed = CounterMetricFamily("collsvc_collectives_failed", "Collectives that raised on a rank.", labels=labels)
    nbytes = CounterMetricFamily("collsvc_collective_bytes", "Input bytes of a rank's collectives.", labels=labels)
    seconds = HistogramMetricFamily("collsvc_collective_seconds", "Time of a rank's collectives.", labels=labels)
    bus = CounterMetricFamily(
        "collsvc_collective_bus_bytes",
        "Bus bytes (nccl-tests convention) of a rank's collectives; rate(bus bytes) / rate(seconds) = recent busbw.",
        labels=labels,
    )
    busbw = GaugeMetricFamily(
        "collsvc_bus_bandwidth_bytes_per_second",
        "Average bus bandwidth of a rank's collectives (nccl-tests convention): bus bytes / seconds.",
        labels=labels,
    )
    for values, stats in calls:
        key = list(values)
        count.add_metric(key, stats.count)
        failed.add_metric(key, stats.failed)
        nbytes.add_metric(key, stats.bytes)
        bus.add_metric(key, stats.bus_bytes)
        seconds.add_metric(key, cumulative_buckets(list(stats.bucket_counts)), stats.seconds)
        busbw.add_metric(key, stats.bus_bytes / stats.seconds if stats.seconds > 0 else 0.0)
    yield from (count, failed, nbytes, bus, seconds, busbw)


class CoordinatorCollector(Collector):
    """A collector that snapshots ``hub`` on ``loop`` at every scrape."""

    def __init__(self, hub: Hub, loop: asyncio.AbstractEventLoop) -> None:
        self._hub = hub
        self._loop = loop

    def collect(self) -> Iterable[Metric]:
        async def snapshot() -> Snapshot:
            return take_snapshot(self._hub)

        try:
            snap = asyncio.run_coroutine_threadsafe(snapshot(), self._loop).result(_SNAPSHOT_TIMEOUT_S)
        except Exception as exc:  # the loop stopped or is stuck: export nothing rather than fail the scrape
            log.warning("metrics: could not read the coordinator state: %r", exc)
            return []
        return list(families(snap))


class MetricsEndpoint:
    """``/metrics`` over HTTP for one coordinator.

    Args:
        hub: the coordinator's state. host, port: where to listen (port 0 picks a free one).
    """

    def __init__(self, hub: Hub, host: str, port: int) -> None:
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(CoordinatorCollector(hub, asyncio.get_running_loop()))
        self._host = host.strip("[]")
        self._requested_port = port
        self._server: Any = None
        self.port = 0

    def start(self) -> int:
        """Starts serving; returns the bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        self._server, _ = start_wsgi_server(self._requested_port, addr=self._host, registry=self._registry)
        self.port = int(self._server.server_port)
        return self.port

    def stop(self) -> None:
        """Stops serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
