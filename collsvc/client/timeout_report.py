"""A collective's timeout, told with who never entered the call (the coordinator's view of progress)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from collsvc.client.backends.base import Call
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.errors import CollectiveTimeoutError, CollsvcError, describe_waiting

log = logging.getLogger(__name__)
# How long the coordinator may wait for the members that look late to report their progress as of now
# (members answer at once; one that is stopped keeps its last heartbeat's report).
FRESH_PROGRESS_WAIT_S = 2.0


def late_members(
    client: CoordinatorClient, hosts: Mapping[int, str], rank: int, call: Call, fallback: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The ranks ``call`` waits for, each with its host and last completed collective: those the
    coordinator says never started it (as of now: it asks those that look late first); ``fallback``
    (the data plane's own list) where the coordinator cannot be asked or names none, and for
    point-to-point messages: the coordinator counts a group's collectives, not the messages of one pair
    and tag (asked about the group's call of that number, it named the receiver itself when the sender
    had sent with another tag and gone on). Never raises."""
    not_started: list[dict[str, Any]] = []
    if not call.point_to_point:
        try:
            not_started = client.progress(call.group.name, call.seq, FRESH_PROGRESS_WAIT_S)
        except (CollsvcError, ValueError) as exc:
            log.warning("rank %d: could not ask who is missing: %s", rank, exc)
    waiting = not_started or fallback
    for entry in waiting:
        entry.setdefault("host", hosts.get(int(entry["rank"]), ""))
    return waiting


def who_is_missing(
    client: CoordinatorClient,
    hosts: Mapping[int, str],
    rank: int,
    job_timeout: float,
    call: Call,
    error: CollectiveTimeoutError,
) -> CollectiveTimeoutError:
    """``error`` (rank ``rank``'s timeout in ``call``) retold with the ranks it waited for
    (:func:`late_members`). Never raises."""
    waiting = late_members(client, hosts, rank, call, error.waiting_on)
    limit = job_timeout if call.timeout is None else call.timeout  # barrier(timeout=...)
    who = describe_waiting(waiting) if waiting else "no rank that could be named (every member answered)"
    return CollectiveTimeoutError(
        f"{call.title()} in group '{call.group.name}' timed out after "
        f"{limit:g}s on rank {rank} (the timeout of this call); waiting on {who}",
        waiting,
    )
