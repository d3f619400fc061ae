"""The coordinator's live side: per-job asyncio primitives, event fan-out and the heartbeat monitor.

The state classes decide; the hub wakes whoever waits on a decision (one :class:`Broadcast` per
join, barrier or key, set once, waking all its waiters in one pass) and pushes job events to every
member's Watch stream. Everything here runs on the server's event loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from collsvc.errors import AuthenticationError
from collsvc.options import CoordinatorOptions
from collsvc.proto.v1 import coordinator_pb2
from collsvc.server.interceptors import Context
from collsvc.server.services.broadcast import Broadcast
from collsvc.server.services.convert import join_reply, members_reply_bytes
from collsvc.server.services.departure_news import DepartureNews
from collsvc.server.services.heartbeat_pace import pace_for
from collsvc.server.services.liveness import StallWatch, judge
from collsvc.server.services.member_events import left_event, member_event, running_across_hosts
from collsvc.server.services.progress_requests import ProgressRequests
from collsvc.server.state.barriers import BarrierKey
from collsvc.server.state.common import Clock, Member, MemberState, WaitingInfo
from collsvc.server.state.credentials import MemberSecrets, secrets_for
from collsvc.server.state.jobs import BAD_CREDENTIALS, Job
from collsvc.server.state.joins import JoinQuota
from collsvc.server.state.recovery import Reregistration
from collsvc.server.state.registry import Registry

log = logging.getLogger(__name__)
Events = coordinator_pb2.EventKind
# How old the report of who a timed-out barrier waits for may be (members' progress comes with their
# heartbeats, about this often).
WAITING_REPORT_MAX_AGE_S = 1.0


# Used when a request carries no timeout; the call's own deadline still applies.
DEFAULT_WAIT_S = 300.0


def wait_seconds(timeout_s: float, context: Context) -> float:
    """How long a server-side wait may last: the request's timeout, capped by the call deadline."""
    wait = timeout_s if timeout_s > 0 else DEFAULT_WAIT_S
    remaining = context.time_remaining()
    if remaining is not None:
        wait = min(wait, max(remaining, 0.0))
    return wait


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Waits for ``event`` up to ``seconds``; returns whether it was set."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        return event.is_set()
    return True


@dataclass(eq=False)
class Stream:
    """One open Watch stream: events for it queue here; ``None`` ends it."""

    rank: int
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


class JobRuntime:
    """What waits on one job: its join, barriers and keys, and its members' Watch streams."""

    def __init__(self, job: Job, clock: Clock = time.monotonic) -> None:
        self.job = job
        self.joined = Broadcast()  # set once every member joined (ranks assigned)
        self.barrier_events: dict[BarrierKey, Broadcast] = {}
        self.key_events: dict[str, Broadcast] = {}
        self._key_waiters: dict[str, int] = {}
        self.streams: dict[int, Stream] = {}
        # Set while the job is usable; clear while a rebuilt job waits for its members to re-register.
        self.usable = asyncio.Event()
        if not job.recovering:
            self.usable.set()
        self.events: list[Any] = []  # every numbered Watch event, replayed to a stream that missed some
        self.departures = DepartureNews(self._announce_departures, lambda: len(self.streams), clock)
        self.progress_requests = ProgressRequests()  # members asked for their progress as of now
        self._members_cache: tuple[int, bytes] | None = None
        # (group, generation) -> (arrivals then, when, the timed-out reply's waiting list).
        self._barrier_waiting: dict[BarrierKey, tuple[int, float, list[WaitingInfo]]] = {}

    def members_bytes(self) -> bytes:
        """The serialized member table, rebuilt only when a member's state changed."""
        cache = self._members_cache
        if cache is None or cache[0] != self.job.version:
            cache = self._members_cache = (self.job.version, members_reply_bytes(self.job))
        return cache[1]

    def join_reply(self, member: Member, heartbeat_interval: float = 0.0) -> Any:
        """The JoinResponse for ``member`` of the complete job (``heartbeat_interval``: the job's pace)."""
        return join_reply(self.job, member, heartbeat_interval)

    def barrier_event(self, key: BarrierKey) -> Broadcast:
        """The signal of barrier ``key``: set when it completes, or when a failure wakes every barrier."""
        event = self.barrier_events.get(key)
        if event is None:
            event = self.barrier_events[key] = Broadcast()
        return event

    def complete_barrier(self, key: BarrierKey) -> None:
        """Wakes every waiter of barrier ``key`` in one pass (it just completed)."""
        self._barrier_waiting.pop(key, None)
        event = self.barrier_events.pop(key, None)
        if event is not None:
            event.set()

    def wake_barriers(self) -> None:
        """Wakes every barrier waiter so that it re-checks the job (after a failure, leave or abort)."""
        events, self.barrier_events = self.barrier_events, {}
        for event in events.values():
            event.set()

    def barrier_waiting_on(self, key: BarrierKey) -> list[WaitingInfo]:
        """Who barrier ``key`` still waits for, with their progress as of at most
        :data:`WAITING_REPORT_MAX_AGE_S` ago, computed again when someone arrives.

        Every waiter of a barrier that times out reports the same list; without the cache each of
        n waiters would scan the n members of the group (and log it).
        """
        group, generation = key
        arrivals = self.job.barriers.arrivals(group, generation)
        now = time.monotonic()
        cached = self._barrier_waiting.get(key)
        if cached is not None and cached[0] == arrivals and now - cached[1] < WAITING_REPORT_MAX_AGE_S:
            return cached[2]
        waiting = self.job.barrier_waiting_on(group, generation)
        self._barrier_waiting[key] = (arrivals, now, waiting)
        log.warning(
            "job %s group %s: barrier #%d timed out waiting on ranks %s",
            self.job.job_id, group, generation, [w.rank for w in waiting],
        )  # fmt: skip
        return waiting

    async def wait_for_key(self, key: str, seconds: float) -> bool:
        """Waits up to ``seconds`` for the next write of ``key``; returns whether one happened."""
        event = self.key_events.get(key)
        if event is None:
            event = self.key_events[key] = Broadcast()
        self._key_waiters[key] = self._key_waiters.get(key, 0) + 1
        try:
            return await event.wait(seconds)
        finally:
            # Forget the event once its last waiter gave up, so never-set keys do not pile up.
            remaining = self._key_waiters.pop(key) - 1
            if remaining:
                self._key_waiters[key] = remaining
            elif self.key_events.get(key) is event:
                del self.key_events[key]

    def notify_key(self, key: str) -> None:
        event = self.key_events.pop(key, None)
        if event is not None:
            event.set()

    def on_complete(self) -> None:
        """Wakes every waiting joiner in one pass (each builds its own reply as it resumes)."""
        self.joined.set()

    def send(self, event: Any, *, exclude: Collection[int] = ()) -> None:
        """Numbers ``event``, logs it for later replay, and queues it on every stream but ``exclude``'s.

        An excluded member (the one failed, the one leaving) is not told now.
        """
        self.departures.flush()  # a departure that came first is told first
        event.seq = self.job.next_event_seq()
        # A member that left is not told of its own leave, even on replay; a failed member that comes
        # back is told that it was declared failed. Members that already left need no departure news.
        left = event.kind == Events.EVENT_KIND_MEMBER_LEFT
        self.events.append((event, frozenset(exclude) if left else frozenset()))
        members = self.job.members
        payload = event.SerializeToString()  # once, not once per stream
        for rank, stream in self.streams.items():
            if rank in exclude or (left and rank < len(members) and members[rank].state is MemberState.LEFT):
                continue
            stream.queue.put_nowait(payload)

    def _announce_departures(self, members: list[Member]) -> None:
        self.send(left_event(members, []), exclude={m.rank for m in members})

    def replay(self, stream: Stream, after: int) -> None:
        """Queues on ``stream`` every logged event numbered above ``after`` that was meant for it."""
        for event, exclude in self.events:
            if event.seq > after and stream.rank not in exclude:
                stream.queue.put_nowait(event)

    def wake_if_usable(self) -> None:
        """Wakes whoever waits for a rebuilt job once it is whole again."""
        if not self.job.recovering and not self.usable.is_set():
            self.usable.set()


class Hub:
    """All jobs and their runtimes, plus the failure paths that must reach every member."""

    def __init__(
        self,
        options: CoordinatorOptions,
        *,
        clock: Clock = time.monotonic,
        secrets: MemberSecrets | None = None,
    ) -> None:
        self.options = options
        self.registry = Registry(clock=clock, limits=options.limits, secrets=secrets or secrets_for(options))
        self.join_quota = JoinQuota(options.limits)
        self._clock = clock
        self._runtimes: dict[str, JobRuntime] = {}
        self.stall_watch = StallWatch(options, clock())  # when the heartbeat monitor last ran, and stalls seen
        self.draining = False  # set by :meth:`drain` when this coordinator stops

    def drain(self) -> None:
        """This coordinator is stopping: the Watch streams its stop cancels from now on are not members
        failing (they re-register with the coordinator that comes back), so none is reported failed."""
        self.draining = True

    def runtime(self, job: Job) -> JobRuntime:
        rt = self._runtimes.get(job.job_id)
        if rt is None or rt.job is not job:
            rt = self._runtimes[job.job_id] = JobRuntime(job, self._clock)
        return rt

    def find(self, job_id: str) -> JobRuntime:
        """The runtime of an existing job. Raises NotFoundError."""
        return self.runtime(self.registry.get(job_id))

    def find_or_create(self, job_id: str) -> JobRuntime:
        return self.runtime(self.registry.get_or_create(job_id))

    def authenticate(self, job_id: str, rank: int, secret: str) -> tuple[JobRuntime, Member]:
        """The runtime and member for member credentials; one error for every kind of mismatch."""
        job = self.registry.find(job_id)
        if job is None:
            raise AuthenticationError(BAD_CREDENTIALS)
        return self.runtime(job), job.authenticate(rank, secret)

    def drop_if_finished(self, rt: JobRuntime) -> None:
        if self.registry.drop_if_finished(rt.job) and self._runtimes.get(rt.job.job_id) is rt:
            del self._runtimes[rt.job.job_id]
            # Anyone still waiting on a key of the dropped job times out by itself; barrier waiters
            # were woken by the leave or failure that finished the job.

    # --------------------------------------------------------------------------- failure paths

    def fail(self, rt: JobRuntime, ranks: Iterable[int], reason: str) -> None:
        """Marks members failed and tells every other member; pending barriers fail."""
        failed = rt.job.fail(ranks, reason)
        rt.wake_if_usable()  # a failure ends a rebuild: the waiters must see it
        if not failed:
            return
        event = member_event(Events.EVENT_KIND_MEMBER_FAILED, failed, reason)
        rt.send(event, exclude={m.rank for m in failed})
        rt.wake_barriers()
        self.drop_if_finished(rt)

    def leave(
        self,
        rt: JobRuntime,
        member: Member,
        cause: list[int] | None = None,
        cause_reason: str = "",
        *,
        unreachable: bool = False,
    ) -> None:
        """``cause``: ranks whose failure (or lateness: ``cause_reason`` says which) had failed the
        member's job before it left (named to the others); ``unreachable``: a delivery to them had
        failed, and the others are told which of them this coordinator knew to be running."""
        running = None
        if cause and unreachable:
            interval = pace_for(self.options, len(rt.job.members)).interval
            running = running_across_hosts(rt.job, member, cause, interval, self._clock())
        if not rt.job.leave(member):
            return
        # The member's own stream stays open: the client ends it after Leave returns. A departure that
        # names the ranks that failed the member's job is told at once; plain ones go out in batches.
        if cause:
            rt.send(left_event([member], cause, cause_reason, running), exclude=(member.rank,))
        else:
            rt.departures.add(member)
        rt.wake_barriers()
        self.drop_if_finished(rt)

    def abort(self, rt: JobRuntime, member: Member, reason: str) -> None:
        aborted = rt.job.abort(reason, member.rank)
        rt.wake_if_usable()
        if not aborted:
            return
        rt.send(member_event(Events.EVENT_KIND_JOB_ABORTED, [member], rt.job.abort_reason or reason))
        rt.wake_barriers()

    def mismatch(self, rt: JobRuntime, member: Member, reason: str, details: dict[str, Any]) -> None:
        merged = rt.job.merge_mismatch(details, reason)
        rt.wake_if_usable()
        ranks = sorted(int(k) for k in merged if str(k).lstrip("-").isdigit())
        culprits = [rt.job.members[r] for r in ranks if 0 <= r < len(rt.job.members)]
        log.warning("job %s rank %d: collective mismatch: %s", rt.job.job_id, member.rank, reason)
        rt.send(member_event(Events.EVENT_KIND_COLLECTIVE_MISMATCH, culprits, reason, json.dumps(merged)))
        rt.wake_barriers()

    # -------------------------------------------------------------------------------- streams

    def open_stream(self, rt: JobRuntime, member: Member, last_event_seq: int = 0) -> Stream:
        """Registers a Watch stream for ``member`` (replacing an older one) and replays the events
        numbered above ``last_event_seq`` (the last one the member received), so that a member that
        reconnects neither misses an event nor sees one twice."""
        old = rt.streams.get(member.rank)
        if old is not None:
            old.queue.put_nowait(None)
        stream = rt.streams[member.rank] = Stream(member.rank)
        stream.queue.put_nowait(member_event(Events.EVENT_KIND_WATCHING, [member], ""))
        rt.replay(stream, last_event_seq)
        return stream

    # ------------------------------------------------------------------------------ recovery

    def reregister(self, report: Reregistration, job_id: str) -> tuple[JobRuntime, Member]:
        """Takes back a member of a running job, rebuilding the job when this coordinator does not know it.

        Raises:
            AuthenticationError: the secret does not prove the rank (or this coordinator's key is random).
            RendezvousError: the job here is another instance, or is still joining.
        """
        job = self.registry.find(job_id)
        # A job nobody joined here may exist already: a key/value call of a member that had not yet
        # noticed the restart creates it. It is rebuilt all the same (its keys are kept).
        if job is None or (not job.complete and not job.pending_members()):
            if not self.registry.secrets.stable:
                raise AuthenticationError(BAD_CREDENTIALS)  # without a stable key nothing can be proven
            if not self.registry.secrets.verify(job_id, report.incarnation, report.rank, report.secret):
                raise AuthenticationError(BAD_CREDENTIALS)
            job = job or self.registry.get_or_create(job_id)
            job.rebuild(report)
        rt = self.runtime(job)
        member = job.reregister(report)
        if job.recovering:
            rt.usable.clear()  # the runtime may predate the rebuild (a stray key/value call made it)
        else:
            rt.usable.set()
        return rt, member

    def close_stream(self, rt: JobRuntime, member: Member, stream: Stream) -> None:
        """A Watch stream ended; if it was the member's current one and it had not left, it failed (unless
        this coordinator is draining: then its own stop ended the stream)."""
        if rt.streams.get(member.rank) is not stream:
            return  # replaced by a newer stream, or the member left
        del rt.streams[member.rank]
        rt.progress_requests.gone(member.rank)
        if member.gone or self.draining or self.stall_watch.spare_closed(rt.job.job_id, member, self._clock()):
            return
        self.fail(rt, [member.rank], "its heartbeat stream closed without leaving the job")

    # -------------------------------------------------------------------------------- monitor

    def check_heartbeats(self) -> None:
        """Fails every member silent for longer than the heartbeat timeout (see :func:`liveness.judge`)."""
        for job in self.registry.jobs():
            timeout = pace_for(self.options, job.world_size or 0).timeout
            expired = judge(job, timeout, self._clock())
            silent = [m.rank for m in expired if m.registered]
            if silent:
                self.fail(self.runtime(job), silent, f"missed heartbeats for {timeout:g}s")
            absent = [m.rank for m in expired if not m.registered]
            if absent:
                reason = f"did not re-register within {timeout:g}s after the coordinator restarted"
                self.fail(self.runtime(job), absent, reason)

    def tick(self) -> None:
        """One heartbeat monitor round: :meth:`check_heartbeats`, unless it came late (see
        :meth:`liveness.StallWatch.on_time`) or this coordinator is draining."""
        if not self.draining and self.stall_watch.on_time(self.registry.jobs(), self._clock()):
            self.check_heartbeats()
