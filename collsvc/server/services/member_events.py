"""The job events the coordinator sends its members about other members (failed, left, aborted,
mismatched), and what a departure says about the peers it blames."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from collsvc.proto.v1 import coordinator_pb2
from collsvc.server.state.common import Member, MemberState
from collsvc.server.state.jobs import Job

Events = coordinator_pb2.EventKind


def left_event(
    members: list[Member], cause: list[int], cause_reason: str = "", running: dict[int, str] | None = None
) -> Any:
    """MEMBER_LEFT with each member's final progress, so the others can fail at once exactly the calls
    it never finished (a clean leave after finishing a call must not fail that call elsewhere), and
    the ranks that had failed its job, if any (``cause``), with the error that said so (``cause_reason``)
    and, when a delivery to them had failed (``running`` not None), those of them this coordinator knew
    to be running (rank -> host; see :func:`running_across_hosts`)."""
    finished = {str(m.rank): {group: record.finished_seq for group, record in m.progress.items()} for m in members}
    details: dict[str, Any] = {"finished": finished}
    if cause:
        details["cause"] = cause
        if cause_reason:
            details["cause_reason"] = cause_reason
        if running is not None:  # it could not deliver to them: which of them were running
            details["unreachable"] = True
            details["running"] = {str(rank): host for rank, host in running.items()}
    return member_event(Events.EVENT_KIND_MEMBER_LEFT, members, "left the job", json.dumps(details))


def running_across_hosts(
    job: Job, member: Member, unreachable: list[int], interval: float, now: float
) -> dict[int, str]:
    """Of the ranks ``member`` could not deliver to, those this coordinator knows were running when it
    left, on another host (rank -> host): a member that left cleanly itself, or one whose last heartbeat
    (a real one, not a clock restarted after a stall) came within two heartbeat intervals. Between
    them and ``member`` it is the path that failed, not a process: a cut link."""
    running: dict[int, str] = {}
    for rank in unreachable:
        peer = job.members[rank]
        if peer.host == member.host or peer.state in (MemberState.FAILED, MemberState.JOINING):
            continue
        fresh = not peer.pardoned and now - peer.last_heartbeat <= 2 * interval
        if peer.state == MemberState.LEFT or fresh:
            running[rank] = peer.host
    return running


def member_event(
    kind: coordinator_pb2.EventKind, members: Iterable[Member], reason: str, details_json: str = ""
) -> Any:
    """A WatchEvent of ``kind`` about ``members`` (their ranks and hosts)."""
    members = list(members)
    return coordinator_pb2.WatchEvent(
        kind=kind,
        ranks=[m.rank for m in members],
        hosts=[m.host for m in members],
        reason=reason,
        details_json=details_json,
    )
