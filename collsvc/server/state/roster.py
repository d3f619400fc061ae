"""Who is joining a job: the checks a Join must pass, the waiting members, and rank assignment.

A Join is first checked (:meth:`Roster.check`, no side effects), then admitted (:meth:`Roster.admit`).
When the last member arrives the roster hands out ranks (:meth:`Roster.assign`). A Join retried with
the same idempotency key (its reply was lost with a broken connection) finds the member it made
instead of adding a second one.
"""

from __future__ import annotations

from dataclasses import dataclass

from collsvc.errors import RendezvousError, ResourceLimitError
from collsvc.options import Limits
from collsvc.server.state.common import Device, Member, MemberState
from collsvc.server.state.ranks import assign_ranks


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """What a joining member says about itself.

    ``idempotency_key`` is random per ``collsvc.init`` attempt and the same on each retry ("" when the
    client sends none: no retry detection).
    """

    world_size: int
    requested_rank: int | None
    host: str
    peer_address: str
    device: Device
    pid: int
    local_rank_hint: int | None
    idempotency_key: str = ""


class Roster:
    """The members of one job while it gathers them.

    Args:
        job_id: for error messages.
        limits: ``max_world_size`` bounds the world size.
    """

    def __init__(self, job_id: str, limits: Limits) -> None:
        self._job_id = job_id
        self._limits = limits
        self.world_size: int | None = None
        self._pending: dict[int, Member] = {}  # by arrival
        self._requested: dict[int, Member] = {}  # by requested rank
        self._by_key: dict[str, Member] = {}  # by idempotency key, kept after completion for retries
        self._calls: dict[int, int] = {}  # arrival -> Join calls waiting for that member
        self._arrivals = 0
        self._not_joined: tuple[int, list[int] | None] | None = None  # (arrivals then, the answer)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def full(self) -> bool:
        """Whether every member of the world size joined."""
        return self.world_size is not None and len(self._pending) == self.world_size

    def pending(self) -> list[Member]:
        """The waiting members, in arrival order."""
        return list(self._pending.values())

    def not_joined(self) -> list[int] | None:
        """The ranks no waiting member asked for; None when unknown (some member lets us assign).

        Computed once per admission: when a large job times out, each of its n waiters asks and then
        withdraws, and a scan of the world per waiter would cost O(n^2). A member that withdrew since
        the last admission did join, so it is not named.
        """
        cached = self._not_joined
        if cached is not None and cached[0] == self._arrivals:
            return cached[1]
        missing: list[int] | None = None
        if self.world_size is not None and all(m.requested_rank is not None for m in self._pending.values()):
            missing = [rank for rank in range(self.world_size) if rank not in self._requested]
        self._not_joined = (self._arrivals, missing)
        return missing

    def retry_of(self, request: JoinRequest) -> Member | None:
        """The member an earlier Join with the same idempotency key made (and counts this call), or None."""
        member = self._by_key.get(request.idempotency_key) if request.idempotency_key else None
        if member is not None and member.arrival in self._calls:
            self._calls[member.arrival] += 1
        return member

    def check(self, request: JoinRequest, *, full: bool, state: str) -> None:
        """Raises the reason ``request`` cannot join; returns when it can.

        Args:
            request: the join.
            full: whether the job already has all its members (it completed).
            state: the job's phase, for the message.

        Raises:
            ValueError: world_size below 1, or a requested rank outside ``[0, world_size)``.
            ResourceLimitError: world_size above the coordinator's limit.
            RendezvousError: world sizes disagree, the requested rank is taken, or the job is full.
        """
        world_size, host = request.world_size, request.host
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if world_size > self._limits.max_world_size:
            raise ResourceLimitError(
                f"world_size {world_size} exceeds this coordinator's limit of {self._limits.max_world_size}"
            )
        if self.world_size is not None and world_size != self.world_size:
            raise RendezvousError(
                f"job {self._job_id!r} has world_size {self.world_size} but a member on host {host!r} "
                f"asked for world_size {world_size}; every member must use the same world size"
            )
        if full or len(self._pending) >= world_size:
            raise RendezvousError(
                f"job {self._job_id!r} is full: all {world_size} members already joined "
                f"(state {state}); use another job id or wait until the job ends"
            )
        rank = request.requested_rank
        if rank is None:
            return
        if not 0 <= rank < world_size:
            raise ValueError(f"requested rank {rank} is outside [0, {world_size})")
        holder = self._requested.get(rank)
        if holder is not None:
            raise RendezvousError(
                f"rank {rank} of job {self._job_id!r} is already taken by a member on host {holder.host!r} "
                f"(pid {holder.pid}); a member on host {host!r} (pid {request.pid}) asked for it too"
            )

    def admit(self, request: JoinRequest) -> Member:
        """Adds a member that passed :meth:`check`."""
        self.world_size = request.world_size
        member = Member(
            arrival=self._arrivals,
            host=request.host,
            peer_address=request.peer_address,
            device=request.device,
            pid=request.pid,
            requested_rank=request.requested_rank,
            local_rank_hint=request.local_rank_hint,
            join_key=request.idempotency_key,
        )
        self._arrivals += 1
        self._pending[member.arrival] = member
        self._calls[member.arrival] = 1
        if request.requested_rank is not None:
            self._requested[request.requested_rank] = member
        if request.idempotency_key:
            self._by_key[request.idempotency_key] = member
        return member

    def withdraw(self, member: Member) -> bool:
        """One Join call for ``member`` gave up; the member leaves when it was the last. Returns whether it left."""
        calls = self._calls.get(member.arrival)
        if calls is None:
            return False
        if calls > 1:
            self._calls[member.arrival] = calls - 1
            return False
        del self._calls[member.arrival]
        del self._pending[member.arrival]
        if member.requested_rank is not None:
            self._requested.pop(member.requested_rank, None)
        if member.join_key:
            self._by_key.pop(member.join_key, None)
        if not self._pending:
            self.world_size = None  # nobody is waiting: the next joiner may choose again
        return True

    def assign(self, now: float) -> tuple[list[Member], int]:
        """Gives every waiting member its rank (the roster is full); returns them by rank, and the host count."""
        pending = list(self._pending.values())
        keys = [(m.host, m.requested_rank, m.local_rank_hint, m.pid, m.arrival) for m in pending]
        placements, num_nodes = assign_ranks(keys, len(pending))
        members = [pending[0]] * len(pending)
        for member, place in zip(pending, placements, strict=True):
            member.rank = place.rank
            member.local_rank = place.local_rank
            member.local_size = place.local_size
            member.node_rank = place.node_rank
            member.state = MemberState.ALIVE
            # Members that never open a heartbeat stream are still covered: their clock starts now.
            member.last_heartbeat = now
            members[place.rank] = member
        self._pending.clear()
        self._requested.clear()
        self._calls.clear()
        return members, num_nodes
