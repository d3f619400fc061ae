"""One job: its lifecycle, members, groups, barriers, key/value store and failure record.

Every operation is O(1) per request except the one-off work when the job completes (rank assignment,
O(n log n)) and the rare reports that by nature list members (timeouts, progress, status). The phase
changes only through :mod:`collsvc.server.state.lifecycle`; joining lives in
:mod:`collsvc.server.state.roster`, and what went wrong in :mod:`collsvc.server.state.failures`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Collection, Iterable, Sequence

from collsvc.errors import AbortedError, AuthenticationError, RendezvousError
from collsvc.observability.stats import Histogram
from collsvc.options import Limits
from collsvc.server.state.barriers import BarrierBook
from collsvc.server.state.common import (
    Clock,
    Member,
    MemberState,
    NotFoundError,
    ProgressRecord,
    WaitingInfo,
)
from collsvc.server.state.credentials import MemberSecrets
from collsvc.server.state.failures import FailureRecord
from collsvc.server.state.groups import Groups
from collsvc.server.state.kvstore import KVStore
from collsvc.server.state.lifecycle import JobAction, JobPhase, Lifecycle
from collsvc.server.state.recovery import Reregistration, placeholder
from collsvc.server.state.roster import JoinRequest, Roster

log = logging.getLogger(__name__)

# The one message for every member-credential failure, so that a caller learns nothing about which
# jobs or ranks exist.
BAD_CREDENTIALS = "invalid member credentials"

_MAX_PROGRESS_GROUPS = 1024
_MAX_OP_CHARS = 1024


class Job(FailureRecord):
    """A job on the coordinator, from its first request until every member left or failed.

    Args:
        job_id: the job's name.
        clock: monotonic seconds.
        limits: sizes checked before anything is stored.
        incarnation: a random 64-bit number naming this instance of the job.
        secrets: makes and checks the members' secrets.
    """

    def __init__(self, job_id: str, *, clock: Clock, limits: Limits, incarnation: int, secrets: MemberSecrets) -> None:
        super().__init__(job_id)
        self.job_id = job_id
        self.incarnation = incarnation
        self._clock = clock
        self._limits = limits
        self._secrets = secrets
        self.lifecycle = Lifecycle(job_id)
        self._roster = Roster(job_id, limits)
        self.num_nodes = 0
        self.members: list[Member] = []  # by rank, once complete
        self.kv = KVStore(limits)
        self.barriers = BarrierBook()
        self._groups = Groups(0, limits.max_keys_per_job)
        self.version = 0  # bumped whenever a member's state changes (GetMembers cache key)
        self._gone = 0
        self._unregistered: set[int] = set()  # ranks of a rebuilt job that have not re-registered
        self.event_seq = 0  # the number of the last Watch event of this job
        self.barrier_waits: dict[str, Histogram] = {}  # group -> seconds members waited in barriers

    # ----------------------------------------------------------------------------------- phases

    @property
    def phase(self) -> JobPhase:
        return self.lifecycle.phase

    @property
    def complete(self) -> bool:
        """Whether every member has its rank (the job ran, or is being rebuilt after a restart)."""
        return bool(self.members)

    @property
    def recovering(self) -> bool:
        return self.lifecycle.phase is JobPhase.RECOVERING

    @property
    def state(self) -> str:
        """ "joining", "running", "recovering", "failed" or "aborted"."""
        return self.lifecycle.phase.value

    @property
    def world_size(self) -> int | None:
        return len(self.members) if self.members else self._roster.world_size

    def _fail_phase(self) -> None:
        if self.recovering:
            self.finish_recovery()
        self.lifecycle.apply(JobAction.FAIL)

    def _abort_phase(self) -> None:
        if self.recovering:
            self.finish_recovery()
        self.lifecycle.apply(JobAction.ABORT)

    # ----------------------------------------------------------------------------------- joining

    def pending_members(self) -> list[Member]:
        """Members waiting for the job to complete, in arrival order."""
        return self._roster.pending()

    @property
    def joined(self) -> int:
        """How many members have joined so far."""
        return len(self.members) if self.complete else len(self._roster)

    def not_joined(self) -> list[int] | None:
        """While joining, the ranks no member has asked for yet; None when that is unknown.

        Known only when every waiting member asked for its rank (``COLLSVC_RANK``, a Kubernetes
        completion index); ranks the coordinator assigns exist only once everybody has joined.
        """
        return None if self.complete else self._roster.not_joined()

    def join(self, request: JoinRequest) -> Member:
        """Adds a member; completes the job (assigns every rank) when it is the last one.

        A Join retried with the idempotency key of an earlier one returns that one's member.

        Returns:
            The member; its rank is set once ``complete`` is true.

        Raises:
            AbortedError: the job was aborted.
            ValueError, ResourceLimitError, RendezvousError: see :meth:`Roster.check`.
        """
        retried = self._roster.retry_of(request)
        if retried is not None:
            return retried
        if self.abort_reason is not None:
            raise AbortedError(f"job {self.job_id!r} was aborted: {self.abort_reason}", self.abort_reason)
        self._roster.check(request, full=self.complete, state=self.state)
        member = self._roster.admit(request)
        if self._roster.full:
            self._complete()
        return member

    def _complete(self) -> None:
        self.members, self.num_nodes = self._roster.assign(self._clock())
        for member in self.members:
            member.secret = self._secrets.secret(self.job_id, self.incarnation, member.rank)
        self._groups.world_size = len(self.members)
        self.lifecycle.apply(JobAction.COMPLETE)
        self.version += 1
        log.info("job %s: complete with %d ranks on %d hosts", self.job_id, len(self.members), self.num_nodes)

    def cancel_join(self, member: Member) -> bool:
        """Withdraws a member whose join timed out or was cancelled; returns whether it was pending."""
        return not self.complete and self._roster.withdraw(member)

    # ------------------------------------------------------------------------------- recovery

    def rebuild(self, first: Reregistration) -> None:
        """Turns a new, empty job into the running job ``first`` belongs to (the coordinator restarted).

        Every rank gets a placeholder whose heartbeat clock starts now: a member that does not
        re-register within the heartbeat timeout is failed like any silent member.

        Raises:
            RendezvousError: the job already has members or a joining member.
        """
        if self.complete or len(self._roster) or self.phase is not JobPhase.JOINING:
            raise RendezvousError(f"job {self.job_id!r} is already {self.state} on this coordinator")
        self.lifecycle = Lifecycle(self.job_id, JobPhase.RECOVERING)
        self.incarnation = first.incarnation
        self.num_nodes = first.num_nodes
        now = self._clock()
        self.members = [placeholder(rank, now) for rank in range(first.world_size)]
        for member in self.members:
            member.secret = self._secrets.secret(self.job_id, self.incarnation, member.rank)
        self._groups.world_size = first.world_size
        self._unregistered = set(range(first.world_size))
        self.version += 1
        log.warning("job %s: rebuilding %d ranks from their re-registrations", self.job_id, first.world_size)

    def reregister(self, report: Reregistration) -> Member:
        """Takes back a member of a rebuilt job (or confirms one that is already known).

        Raises:
            AuthenticationError: the secret is not this rank's (one message for every mismatch).
            RendezvousError: the report names another instance or world size of this job.
        """
        if not self.complete:
            raise RendezvousError(f"job {self.job_id!r} is {self.state} on this coordinator, not running")
        if report.incarnation != self.incarnation or report.world_size != len(self.members):
            raise RendezvousError(
                f"job {self.job_id!r} on this coordinator is another instance (incarnation {self.incarnation:x}, "
                f"{len(self.members)} ranks) than rank {report.rank}'s ({report.incarnation:x}, {report.world_size})"
            )
        member = self.authenticate(report.rank, report.secret)
        if member.registered:
            return member  # a retry, or a reconnect to a coordinator that never went away
        report.fill(member)
        member.last_heartbeat = self._clock()
        for group, generation in report.barriers:
            self.barriers.mark_completed(group, generation)
        for rank in report.left_ranks:
            if 0 <= rank < len(self.members) and not self.members[rank].gone:
                self.leave(self.members[rank])
                self._unregistered.discard(rank)
        self.event_seq = max(self.event_seq, report.last_event_seq)
        self._unregistered.discard(member.rank)
        self.version += 1
        if not self._unregistered and self.recovering:
            self.finish_recovery()
        return member

    def finish_recovery(self) -> list[Member]:
        """Ends the rebuild (all re-registered, or a failure cannot wait); returns who never re-registered."""
        missing = [self.members[rank] for rank in sorted(self._unregistered)]
        self._unregistered.clear()
        self.lifecycle.apply(JobAction.RECOVERED)
        log.warning(
            "job %s: rebuilt after the coordinator restart%s",
            self.job_id,
            f"; ranks {[m.rank for m in missing]} never re-registered" if missing else "",
        )
        return missing

    def next_event_seq(self) -> int:
        """Numbers the next Watch event of this job (after every number the members saw before)."""
        self.event_seq += 1
        return self.event_seq

    # ------------------------------------------------------------------------------ membership

    def member(self, rank: int) -> Member:
        """The member with ``rank``.

        Raises:
            RendezvousError: the job is not complete yet.
            ValueError: no such rank.
        """
        self._require_complete()
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
        member.pardoned = False
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
        failed = [m for m in (self.member(rank) for rank in ranks) if not m.gone]
        if not failed:
            return []
        self._fail_phase()
        for member in failed:
            self._set_state(member, MemberState.FAILED)
        self.record_failed(failed, reason)
        return failed

    def expired(self, timeout: float) -> list[Member]:
        """ALIVE members silent for longer than ``timeout`` seconds."""
        if not self.complete:
            return []
        limit = self._clock() - timeout
        return [m for m in self.members if m.state == MemberState.ALIVE and m.last_heartbeat < limit]

    @property
    def finished(self) -> bool:
        """True when nobody is left: every member left or failed (or nobody joined and no data)."""
        if self.complete:
            return self._gone >= len(self.members)
        return not len(self._roster) and len(self.kv) == 0

    # ------------------------------------------------------------------------------- metrics

    def record_barrier_wait(self, group: str, seconds: float) -> None:
        """Records how long one member waited in a barrier of ``group`` (bounded: groups are bounded)."""
        histogram = self.barrier_waits.get(group)
        if histogram is None:
            histogram = self.barrier_waits[group] = Histogram()
        histogram.observe(seconds)

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

    def group_contains(self, name: str, rank: int) -> bool:
        return self._groups.contains(name, rank)

    def new_group(self, name: str, ranks: Sequence[int]) -> None:
        """Registers group ``name``; see :meth:`Groups.add` for the errors."""
        self._require_complete()
        self._groups.add(name, ranks)

    def find_group(self, name: str) -> tuple[int, ...] | None:
        """The ranks of group ``name``, or None."""
        return self._groups.find(name) if self.complete else None

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
