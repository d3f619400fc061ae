"""How often the members of a job heartbeat, and how long the coordinator waits for them.

Each heartbeat costs the coordinator 130-340 us of CPU (mostly gRPC's own streaming machinery;
benchmarks/rendezvous_scale.py --heartbeat-seconds), so one heartbeat per rank per second fills its
core at about 7,000 ranks, and past that it would fall behind and declare live members failed. The
heartbeats of one job are held to :data:`MAX_HEARTBEATS_PER_SECOND`: a job of more members than that
heartbeats less often, and its timeout grows in proportion. Jobs up to that size
keep the configured pace. A member that dies still fails at once (its stream breaks); only a member
frozen with its connection open is noticed later in a very large job.
"""

from __future__ import annotations

from dataclasses import dataclass

from collsvc.options import CoordinatorOptions

# Heartbeats one job may send the coordinator per second (about a quarter of its core).
MAX_HEARTBEATS_PER_SECOND = 2000.0


@dataclass(frozen=True)
class HeartbeatPace:
    """The heartbeat interval a job's members keep and the silence after which one is failed."""

    interval: float
    timeout: float


def pace_for(options: CoordinatorOptions, world_size: int) -> HeartbeatPace:
    """The pace of a job of ``world_size`` members under ``options`` (its interval and timeout for
    jobs up to :data:`MAX_HEARTBEATS_PER_SECOND` members, proportionally slower above)."""
    interval = max(options.heartbeat_interval, world_size / MAX_HEARTBEATS_PER_SECOND)
    scale = interval / options.heartbeat_interval if options.heartbeat_interval > 0 else 1.0
    return HeartbeatPace(interval, options.heartbeat_timeout * scale)


def least_interval(options: CoordinatorOptions, world_size: int) -> float:
    """What a member of a job of ``world_size`` is told in its JoinResponse: the least time between its
    heartbeats, or 0 for a job small enough to keep whatever pace its members were configured with."""
    interval = pace_for(options, world_size).interval
    return interval if interval > options.heartbeat_interval else 0.0
