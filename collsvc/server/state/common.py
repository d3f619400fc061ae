"""Small shared pieces of the coordinator's pure state: the clock type, member states, records."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Monotonic seconds; injected so that tests drive time by hand.
Clock = Callable[[], float]

WORLD = "world"


class NotFoundError(LookupError):
    """A job or group the request names does not exist (sent as ERROR_REASON_NOT_FOUND)."""


class MemberState(enum.IntEnum):
    """Mirrors ``collsvc.proto.v1.MemberState`` value for value, so conversion is ``int(state)``."""

    JOINING = 1
    ALIVE = 2
    LEFT = 3
    FAILED = 4


@dataclass(slots=True)
class ProgressRecord:
    """What a member last did in one group (sequence numbers count from 1)."""

    started_seq: int = 0
    finished_seq: int = 0
    last_op: str = ""


@dataclass(frozen=True, slots=True)
class Device:
    """The accelerator a member runs on (``kind`` "cpu" has no uuid)."""

    kind: str = "cpu"
    uuid: str = ""
    pci_bus_id: str = ""
    index: int = 0


@dataclass(frozen=True, slots=True)
class WaitingInfo:
    """A member that has not reached a barrier or a collective yet."""

    rank: int
    host: str
    last_op: str
    finished_seq: int


@dataclass(slots=True)
class Member:
    """One member of a job. ``rank`` and the placement fields are -1 until the job is complete."""

    arrival: int
    host: str
    peer_address: str
    device: Device
    pid: int
    requested_rank: int | None
    local_rank_hint: int | None
    secret: str = ""
    join_key: str = ""  # the idempotency key of its Join: a retried Join finds this member again
    rank: int = -1
    local_rank: int = -1
    local_size: int = 0
    node_rank: int = -1
    state: MemberState = MemberState.JOINING
    last_heartbeat: float = 0.0
    # False for a member of a rebuilt job (coordinator restart) until it re-registers.
    registered: bool = True
    # Set when its silence was taken for a stall of the coordinator (its clock restarted once); cleared
    # by its next heartbeat.
    pardoned: bool = False
    progress: dict[str, ProgressRecord] = field(default_factory=dict)
    # (op, group) -> the member's latest running totals (a CollectiveStats message) from its heartbeats.
    stats: dict[tuple[str, str], Any] = field(default_factory=dict)

    @property
    def gone(self) -> bool:
        """True once the member left or failed; it takes part in nothing after that."""
        return self.state in (MemberState.LEFT, MemberState.FAILED)
