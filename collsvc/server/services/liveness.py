"""Telling the coordinator's own stalls from its members' silence.

A coordinator that was not scheduled for a while (SIGSTOP/SIGCONT as ``docker pause``, a throttled
container or a VM migration look; a launcher too busy to run its embedded coordinator) read nobody's
heartbeats meanwhile. Its heartbeat monitor must not take that for the members' silence:

- a monitor round that comes late (:func:`stall_threshold`) restarts every live member's clock and
  judges nobody (:class:`StallWatch`); the clocks start the stall's length later (at most one heartbeat
  timeout): a stall of seconds outlasts the members' keepalive on their heartbeat streams, and a
  member whose stream broke meanwhile needs that long again to reconnect on a loaded machine;
- many members of one job silent in the same round (:func:`mass_silence`) are taken for a stall once:
  their clocks restart, and only those still silent a whole timeout later fail (:func:`judge`).

docs/operations.md, section 11, has the measurements.
"""

from __future__ import annotations

import logging

from collsvc.options import CoordinatorOptions
from collsvc.server.state.common import Member, MemberState
from collsvc.server.state.jobs import Job

log = logging.getLogger(__name__)

# Members that fall silent in the same monitor round, at least this many and at least half of their
# job's live members, are taken for a stall of the coordinator once (see judge).
MASS_SILENCE_MIN = 3


def monitor_period(options: CoordinatorOptions) -> float:
    """Seconds between heartbeat monitor rounds: half the heartbeat interval."""
    return max(options.heartbeat_interval / 2, 0.01)


def stall_threshold(options: CoordinatorOptions) -> float:
    """A monitor round later than this after the previous one means the coordinator stalled: a round
    period plus half the heartbeat timeout (lateness of its own that would eat a member's margin)."""
    return monitor_period(options) + options.heartbeat_timeout / 2


class StallWatch:
    """When the heartbeat monitor last ran, and how many stalls it noticed."""

    def __init__(self, options: CoordinatorOptions, started: float) -> None:
        self.threshold = stall_threshold(options)
        self.most_extra = options.heartbeat_timeout
        # The coordinator's start counts as a round: a stall before the first one (members joined, then
        # the process was stopped at once) is a stall like any other.
        self.last_tick = started
        self.stalls = 0

    def on_time(self, jobs: list[Job], now: float) -> bool:
        """Records a monitor round at ``now``; whether it came on time. A late one (this process was
        stopped or not scheduled, and read no heartbeats meanwhile) restarts the clock of every live
        member of ``jobs`` instead (logged): nobody is judged on heartbeats it could not read."""
        last, self.last_tick = self.last_tick, now
        if now - last <= self.threshold:
            return True
        self.stalls += 1
        restart_at = now + min(now - last, self.most_extra)
        log.warning(
            "coordinator stalled for %.1fs (its process was stopped or not scheduled): restarting the heartbeat "
            "clocks of %d members %.1fs from now instead of judging them on heartbeats it could not read",
            now - last, restart_clocks(jobs, restart_at), restart_at - now,
        )  # fmt: skip
        return False

    def spare_closed(self, job_id: str, member: Member, now: float) -> bool:
        """Whether a live member whose heartbeat stream just closed is spared for now: while the monitor
        is overdue (this coordinator is resuming from a stall, and the member may have given up on it
        meanwhile and be reconnecting), it gets a heartbeat timeout to come back, like any silent member."""
        if not self.overdue(now):
            return False
        member.last_heartbeat = now
        log.warning(
            "job %s rank %d: heartbeat stream closed while this coordinator was stalled; waiting for it to reconnect",
            job_id, member.rank,
        )  # fmt: skip
        return True

    def overdue(self, now: float) -> bool:
        """Whether the monitor is late now (the coordinator is resuming from a stall not yet handled)."""
        return now - self.last_tick > self.threshold


def restart_clocks(jobs: list[Job], now: float) -> int:
    """Restarts the heartbeat clock of every live member of ``jobs`` at ``now``; returns how many."""
    count = 0
    for job in jobs:
        if not job.complete:
            continue
        for member in job.members:
            if member.state == MemberState.ALIVE:
                member.last_heartbeat = max(member.last_heartbeat, now)
                count += 1
    return count


def mass_silence(expired: list[Member], alive: int) -> bool:
    """Whether ``expired`` members of a job with ``alive`` live ones look like a stall of the coordinator."""
    return len(expired) >= MASS_SILENCE_MIN and 2 * len(expired) >= alive


def judge(job: Job, timeout: float, now: float) -> list[Member]:
    """The members of ``job`` to fail for ``timeout`` seconds of silence, after taking a mass silence
    for a stall once (their clocks restart at ``now``, logged)."""
    expired = job.expired(timeout)
    alive = sum(1 for m in job.members if m.state == MemberState.ALIVE)
    if not expired or not mass_silence(expired, alive):
        return expired
    first = [m for m in expired if not m.pardoned]
    if not first:
        return expired
    for member in first:
        member.last_heartbeat, member.pardoned = now, True
    log.warning(
        "job %s: %d of its %d live members went silent at once (ranks %s); taking it for a stall of "
        "this coordinator and giving them another %gs",
        job.job_id, len(first), alive, ranks_text(first), timeout,
    )  # fmt: skip
    return [m for m in expired if m.pardoned and m not in first]


def ranks_text(members: list[Member], most: int = 16) -> str:
    ranks = [m.rank for m in members]
    return str(ranks) if len(ranks) <= most else f"{ranks[:most]} and {len(ranks) - most} more"
