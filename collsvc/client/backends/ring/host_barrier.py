"""A barrier over several hosts that only the hosts' leaders pass across them.

The members of the group on this host first pass a shared-memory barrier among themselves. Then the
first of them (the host's leader) passes the barrier among the leaders (``across_hosts``: a
dissemination barrier over the peers' lanes) and tells the others how it went through a shared-memory
broadcast: an empty answer when it passed, the error otherwise (its type and attributes survive, see
:func:`collsvc.errors.error_details`).

Nothing is blamed falsely: a member that never arrives keeps its host's leader from the leaders'
barrier, so the others' timeouts first name its host's leader; the call runner then asks the coordinator who
never started the call (progress from heartbeats), which names that one member.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from collsvc.errors import CollsvcError, build_error, error_details, reason_for

# How long past the call's deadline the other members wait for the leader's answer: the leaders'
# barrier ends at the deadline, and its answer (with the call runner's question to the coordinator of who never
# started the call) may come a few seconds later on a loaded machine.
ANSWER_GRACE = 15.0


class HostGroup(Protocol):
    """The shared-memory group of this host's members (``LocalGroup``), as far as this module uses it."""

    def barrier(self, deadline: float, *, digest: int = 0) -> None: ...

    def broadcast(self, buf: np.ndarray, root: int, deadline: float, *, digest: int = 0) -> None: ...


def encode_error(error: BaseException) -> bytes:
    """``error`` as the leader sends it to the other members of its host."""
    if isinstance(error, CollsvcError):
        reason, details = reason_for(error), error_details(error)
    else:  # a bad argument or a fault: the others fail with its text, as a collsvc error
        reason, details = 0, {}
    message = str(error) or type(error).__name__
    return json.dumps({"reason": reason, "message": message, "details": details}).encode()


def decode_error(blob: bytes) -> CollsvcError:
    """The error :func:`encode_error` sent."""
    sent = json.loads(blob)
    return build_error(int(sent["reason"]), str(sent["message"]), sent.get("details") or {})


def pass_for_host(
    host: HostGroup,
    local: Sequence[int],
    local_index: int,
    across_hosts: Callable[[], None],
    deadline: float,
    digest: int,
) -> None:
    """Passes a barrier of a group that spans hosts: this host's members together, then its leader
    with the other hosts' leaders for all of them.

    Args:
        host: the shared-memory group of this host's members of the group.
        local: their global ranks, in group order (the first leads).
        local_index: this member's position in ``local``.
        across_hosts: passes the barrier among the hosts' leaders (run by this host's leader only).
        deadline: the call's deadline (``time.monotonic()``).
        digest: the call's signature digest (for the shared-memory mismatch check).

    Raises:
        CollectiveTimeoutError / CollectiveMismatchError: from this host's barrier.
        CollsvcError: the leaders' barrier failed (on the leader as raised, on the others as sent).
    """
    host.barrier(deadline, digest=digest)
    length = np.zeros(1, np.int64)
    answer_by = deadline + ANSWER_GRACE
    if local_index == 0:
        try:
            across_hosts()
        except Exception as exc:
            blob = encode_error(exc)
            length[0] = len(blob)
            host.broadcast(length, 0, answer_by, digest=digest)
            host.broadcast(np.frombuffer(blob, np.uint8).copy(), 0, answer_by, digest=digest)
            raise
        host.broadcast(length, 0, answer_by, digest=digest)
        return
    host.broadcast(length, 0, answer_by, digest=digest)
    if length[0]:
        sent = np.zeros(int(length[0]), np.uint8)
        host.broadcast(sent, 0, answer_by, digest=digest)
        raise decode_error(sent.tobytes())
