"""One job: membership, rank assignment, member states, groups, progress and its failure record.

Every operation is O(1) per request except the one-off work when the job completes (rank assignment,
O(n log n)) and the rare reports that by nature list members (timeouts, progress, status).
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from collsvc.errors import (
    AbortedError,
    AuthenticationError,
    CollectiveMismatchError,
    RankFailedError,
    RendezvousError,
    ResourceLimitError,
)
from collsvc.server.state.barriers import BarrierBook
from collsvc.server.state.common import (
    Clock,
    Device,
    Member,
    MemberState,
    NotFoundError,
    ProgressRecord,
    WaitingInfo,
)
from collsvc.server.state.groups import Groups
from collsvc.server.state.kvstore import KVStore
from collsvc.server.state.ranks import assign_ranks
from collsvc.types import Limits

log = logging.getLogger(__name__)

# The one message for every member-credential failure, so that a caller learns nothing about which
# jobs or ranks exist.
BAD_CREDENTIALS = "invalid member credentials"

_MAX_PROGRESS_GROUPS = 1024
_MAX_OP_CHARS = 1024


def _default_secret() -> str:
    return secrets.token_hex(16)


class Job:
    """A job on the coordinator, from its first request until every member left or failed.

    Args:
        job_id: the job's name.
        clock: monotonic seconds.
        limits: sizes checked before anything is stored.
        incarnation: a random 64-bit number naming this instance of the job.
        make_secret: makes each member's secret (injectable for tests).
    """

    def __init__(
        self,
        job_id: str,
        *,
        clock: Clock,
        limits: Limits,
        incarnation: int,
        make_secret: Callable[[], str] = _default_secret,
    ) -> None:
        self.job_id = job_id
        self.incarnation = incarnation
        self._clock = clock
        self._limits = limits
        self._make_secret = make_secret
        self.world_size: int | None = None
        self.complete = False
        self.num_nodes = 0
        self.members: list[Member] = []  # by rank, once complete
        self._pending: dict[int, Member] = {}  # by arrival, until complete
        self._requested: dict[int, Member] = {}
        self._arrivals = 0
        self.kv = KVStore(limits)
        self.barriers = BarrierBook()
        self._groups = Groups(0, limits.max_keys_per_job)
        self.failed_ranks: list[int] = []
        self.failure_reason = ""
        self.left_ranks: dict[int, None] = {}  # ordered set
        self.abort_reason: str | None = None
        self.abort_rank = -1
        self.mismatch: dict[str, Any] = {}
        self.mismatch_reason = ""
        self.version = 0  # bumped whenever a member's state changes (GetMembers cache key)
        self._gone = 0

    # ----------------------------------------------------------------------------------- joining

    def pending_members(self) -> list[Member]:
        """Members waiting for the job to complete, in arrival order."""
        return list(self._pending.values())

    @property
    def joined(self) -> int:
        """How many members have joined so far."""
        return len(self.members) if self.complete else len(self._pending)

    def join(
        self,
        *,
        world_size: int,
        requested_rank: int | None,
        host: str,
        peer_address: str,
        device: Device,
        pid: int,
        local_rank_hint: int | None,
    ) -> Member:
        """Adds a member; completes the job (assigns every rank) when it is the last one.

        Returns:
            The member; its rank is set once ``complete`` is true.

        Raises:
            AbortedError: the job was aborted.
            ValueError: world_size below 1, or a requested rank outside ``[0, world_size)``.
            ResourceLimitError: world_size above the coordinator's limit.
            RendezvousError: world sizes disagree, the requested rank is taken, or the job is full.
        """
        if self.abort_reason is not None:
            raise AbortedError(f"job {self.job_id!r} was aborted: {self.abort_reason}", self.abort_reason)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if world_size > self._limits.max_world_size:
            raise ResourceLimitError(
                f"world_size {world_size} exceeds this coordinator's limit of {self._limits.max_world_size}"
            )
        if self.world_size is not None and world_size != self.world_size:
            raise RendezvousError(
                f"job {self.job_id!r} has world_size {self.world_size} but a member on host {host!r} "
                f"asked for world_size {world_size}; every member must use the same world size"
            )
        if self.complete or len(self._pending) >= world_size:
            raise RendezvousError(
                f"job {self.job_id!r} is full: all {world_size} members already joined "
                f"(state {self.state}); use another job id or wait until the job ends"
            )
        if requested_rank is not None:
            if not 0 <= requested_rank < world_size:
                raise ValueError(f"requested rank {requested_rank} is outside [0, {world_size})")
            holder = self._requested.get(requested_rank)
            if holder is not None:
                raise RendezvousError(
                    f"rank {requested_rank} of job {self.job_id!r} is already taken by a member on host "
                    f"{holder.host!r} (pid {holder.pid}); a member on host {host!r} (pid {pid}) "
                    "asked for it too"
                )
        self.world_size = world_size
        member = Member(
            arrival=self._arrivals,
            host=host,
            peer_address=peer_address,
            device=device,
            pid=pid,
            requested_rank=requested_rank,
            local_rank_hint=local_rank_hint,
            secret=self._make_secret(),
        )
        self._arrivals += 1
        self._pending[member.arrival] = member
        if requested_rank is not None:
            self._requested[requested_rank] = member
        if len(self._pending) == world_size:
            self._complete()
        return member

    def _complete(self) -> None:
        pending = list(self._pending.values())
        keys = [(m.host, m.requested_rank, m.local_rank_hint, m.pid, m.arrival) for m in pending]
        placements, num_nodes = assign_ranks(keys, len(pending))
        self.members = [pending[0]] * len(pending)
        now = self._clock()
        for member, place in zip(pending, placements, strict=True):
            member.rank = place.rank
            member.local_rank = place.local_rank
            member.local_size = place.local_size
            member.node_rank = place.node_rank
            member.state = MemberState.ALIVE
            # Members that never open a heartbeat stream are still covered: their clock starts now.
            member.last_heartbeat = now
            self.members[place.rank] = member
        self.num_nodes = num_nodes
        self._groups.world_size = len(self.members)
        self._pending.clear()
        self._requested.clear()
        self.complete = True
        self.version += 1
        log.info("job %s: complete with %d ranks on %d hosts", self.job_id, len(self.members), num_nodes)

    def cancel_join(self, member: Member) -> bool:
        """Withdraws a member whose join timed out or was cancelled; returns whether it was pending."""
        if self.complete or self._pending.pop(member.arrival, None) is None:
            return False
        if member.requested_rank is not None:
            self._requested.pop(member.requested_rank, None)
        if not self._pending:
            self.world_size = None  # nobody is waiting: the next joiner may choose again
        return True

    # ------------------------------------------------------------------------------ membership

    def member(self, rank: int) -> Member:
        """The member with ``rank``.

        Raises:
            RendezvousError: the job is not complete yet.
            ValueError: no such rank.
        """
        if not self.complete:
            raise RendezvousError(f"job {self.job_id!r} has not completed its rendezvous yet")
        if not 0 <= rank < len(self.members):
            raise ValueError(f"rank {rank} is outside [0, {len(self.members)}) of job {self.job_id!r}")
        return self.members[rank]

    def authenticate(self, rank: int, secret: str) -> Member:
        """The member ``rank`` if ``secret`` is its secret.

        Raises:
            AuthenticationError: unknown rank or wrong secret (one message for both).
        """
        if not self.complete or not 0 <= rank < len(self.members):
            raise AuthenticationError(BAD_CREDENTIALS)
        member = self.members[rank]
        if not hmac.compare_digest(member.secret.encode(), secret.encode()):
            raise AuthenticationError(BAD_CREDENTIALS)
        return member

    def heartbeat(self, member: Member, progress: Iterable[tuple[str, int, int, str]] = ()) -> None:
        """Refreshes ``member``'s liveness and records its progress per group."""
        member.last_heartbeat = self._clock()
        for group, started, finished, last_op in progress:
            record = member.progress.get(group)
            if record is None:
                if len(member.progress) >= _MAX_PROGRESS_GROUPS:
                    continue
                record = member.progress[group] = ProgressRecord()
            record.started_seq = started
            record.finished_seq = finished
            record.last_op = last_op[:_MAX_OP_CHARS]

    def seconds_since_heartbeat(self, member: Member) -> float:
        """Seconds since ``member`` was last heard from (0 while the job is joining)."""
        return max(self._clock() - member.last_heartbeat, 0.0) if self.complete else 0.0

    def _set_state(self, member: Member, state: MemberState) -> None:
        if not member.gone:
            self._gone += 1
        member.state = state
        self.version += 1

    def leave(self, member: Member) -> bool:
        """Marks ``member`` as LEFT; returns False when it had already left or failed."""
        if member.gone:
            return False
        self._set_state(member, MemberState.LEFT)
        self.left_ranks[member.rank] = None
        log.info("job %s rank %d (%s): left", self.job_id, member.rank, member.host)
        return True

    def fail(self, ranks: Iterable[int], reason: str) -> list[Member]:
        """Marks the members ``ranks`` FAILED and the job failed; returns the members newly failed."""
        failed = []
        for rank in ranks:
            member = self.member(rank)
            if member.gone:
                continue
            self._set_state(member, MemberState.FAILED)
            self.failed_ranks.append(rank)
            failed.append(member)
            log.warning("job %s rank %d (%s): failed: %s", self.job_id, rank, member.host, reason)
        if failed and not self.failure_reason:
            self.failure_reason = reason
        return failed

    def expired(self, timeout: float) -> list[Member]:
        """ALIVE members silent for longer than ``timeout`` seconds."""
        if not self.complete:
            return []
        limit = self._clock() - timeout
        return [m for m in self.members if m.state == MemberState.ALIVE and m.last_heartbeat < limit]

    def abort(self, reason: str, rank: int) -> bool:
        """Aborts the job; returns False when it was already aborted."""
        if self.abort_reason is not None:
            return False
        self.abort_reason = reason or "aborted"
        self.abort_rank = rank
        self.version += 1
        log.warning("job %s: aborted by rank %d: %s", self.job_id, rank, self.abort_reason)
        return True

    def merge_mismatch(self, details: dict[str, Any], reason: str) -> dict[str, Any]:
        """Merges one reporter's ``{rank: signature}`` map into the job's; returns the merged map."""
        self.mismatch.update(details)
        if not self.mismatch_reason:
            self.mismatch_reason = reason or "collective mismatch"
        return self.mismatch

    @property
    def finished(self) -> bool:
        """True when nobody is left: every member left or failed (or nobody joined and no data)."""
        if self.complete:
            return self._gone >= len(self.members)
        return not self._pending and len(self.kv) == 0

    @property
    def state(self) -> str:
        """ "joining", "running", "failed" or "aborted"."""
        if self.abort_reason is not None:
            return "aborted"
        if self.failed_ranks or self.mismatch:
            return "failed"
        return "running" if self.complete else "joining"

    @property
    def failure_text(self) -> str:
        """A one-line account of what went wrong, "" when nothing did."""
        parts = []
        if self.abort_reason is not None:
            parts.append(f"aborted by rank {self.abort_rank}: {self.abort_reason}")
        if self.failed_ranks:
            parts.append(f"ranks {self.failed_ranks} failed: {self.failure_reason}")
        if self.mismatch:
            parts.append(f"collective mismatch: {self.mismatch_reason}")
        return "; ".join(parts)

    # ------------------------------------------------------------------------ groups, barriers

    def _require_complete(self) -> None:
        if not self.complete:
            raise RendezvousError(f"job {self.job_id!r} has not completed its rendezvous yet")

    @property
    def groups(self) -> dict[str, tuple[int, ...]]:
        """The named groups (not "world"), in registration order."""
        return self._groups.named

    def group_ranks(self, name: str) -> Sequence[int]:
        """The global ranks of group ``name`` ("world" is every rank).

        Raises:
            RendezvousError: the job is not complete.
            NotFoundError: no group of that name.
        """
        self._require_complete()
        try:
            return self._groups.ranks(name)
        except NotFoundError:
            raise NotFoundError(f"job {self.job_id!r} has no group {name!r}") from None

    def new_group(self, name: str, ranks: Sequence[int]) -> None:
        """Registers group ``name``; see :meth:`Groups.add` for the errors."""
        self._require_complete()
        self._groups.add(name, ranks)

    def find_group(self, name: str) -> tuple[int, ...] | None:
        """The ranks of group ``name``, or None."""
        return self._groups.find(name) if self.complete else None

    def check_healthy(self, group: str) -> None:
        """Raises the error every collective step in ``group`` must end with, if the job is broken.

        Raises:
            AbortedError: the job was aborted.
            RankFailedError: a member failed, or a member of ``group`` left.
            CollectiveMismatchError: a member reported mismatched collectives.
        """
        if self.abort_reason is not None:
            raise AbortedError(
                f"job {self.job_id!r} was aborted by rank {self.abort_rank}: {self.abort_reason}",
                self.abort_reason,
            )
        if self.failed_ranks:
            hosts = [self.members[r].host for r in self.failed_ranks]
            raise RankFailedError(
                f"job {self.job_id!r}: rank(s) {self.failed_ranks} on {hosts} failed: {self.failure_reason}",
                self.failed_ranks,
                hosts,
            )
        if self.left_ranks:
            left = [r for r in self.left_ranks if self._groups.contains(group, r)]
            if left:
                hosts = [self.members[r].host for r in left]
                raise RankFailedError(
                    f"job {self.job_id!r}: rank(s) {left} on {hosts} left group {group!r}", left, hosts
                )
        if self.mismatch:
            details = {int(k): v for k, v in self.mismatch.items() if str(k).lstrip("-").isdigit()}
            raise CollectiveMismatchError(f"job {self.job_id!r}: {self.mismatch_reason}", details)

    def barrier_arrive(self, group: str, generation: int, rank: int) -> bool:
        """Records ``rank`` at barrier ``(group, generation)``; returns whether it is complete.

        Raises:
            the errors of :meth:`group_ranks` and :meth:`check_healthy`; ValueError when ``rank``
            is not in the group or the generation is below 1.
        """
        ranks = self.group_ranks(group)
        self.check_healthy(group)
        if not self._groups.contains(group, rank):
            raise ValueError(f"rank {rank} is not a member of group {group!r} of job {self.job_id!r}")
        return self.barriers.arrive(group, generation, rank, len(ranks))

    def _waiting(self, ranks: Iterable[int], group: str) -> list[WaitingInfo]:
        out = []
        for rank in ranks:
            member = self.members[rank]
            record = member.progress.get(group) or ProgressRecord()
            out.append(WaitingInfo(rank, member.host, record.last_op, record.finished_seq))
        return out

    def barrier_waiting_on(self, group: str, generation: int) -> list[WaitingInfo]:
        """Members of ``group`` not yet at barrier ``generation``, with their last progress."""
        ranks: Collection[int] = self.group_ranks(group)
        return self._waiting(self.barriers.missing(group, generation, ranks), group)

    def not_started(self, group: str, seq: int) -> list[WaitingInfo]:
        """Members of ``group`` that have not started collective ``seq`` of that group."""
        ranks = self.group_ranks(group)
        late = [r for r in ranks if (self.members[r].progress.get(group) or ProgressRecord()).started_seq < seq]
        return self._waiting(late, group)
