"""Running one numbered call of a job: its deadline, progress record and timeline span, and what a
failed call becomes (the error every caller sees, told to the other members).

``client/connect.py`` builds one :class:`CallRunner` per joined job from the job's parts; every
Communicator of the job runs its calls through it. It never sees the ``Job``, whose lifecycle (start,
backend choice, close) is apart from running calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from collsvc.client.backends.base import Backend, Call, CallCounter, GroupSpec, Signature
from collsvc.client.coordinator_access import CoordinatorAccess
from collsvc.client.departures import Departures
from collsvc.client.failure_state import FailureState
from collsvc.client.progress import OpRecord, ProgressTracker, StreamProgress
from collsvc.client.timeout_report import late_members, who_is_missing
from collsvc.client.work import GroupExecutors, OrderedExecutor
from collsvc.errors import CollectiveMismatchError, CollectiveTimeoutError, CollsvcError, RankFailedError
from collsvc.observability.recorder import CallRecorder, Span
from collsvc.proto.v1 import coordinator_pb2

log = logging.getLogger(__name__)


class CallRunner:
    """Runs the numbered calls of one joined job in this process.

    Attributes:
        failure: the job's first failure (the fast path reads its ``recorded`` flag without a call).
        departed: the members that left cleanly (the fast path reads its ``anyone_left`` flag).
        closed: set once this process left the job (then no call runs).
        timeout: the job's timeout in seconds (a call's default limit).
    """

    def __init__(
        self,
        *,
        job_id: str,
        rank: int,
        hosts: Mapping[int, str],
        timeout: float,
        coordinator: CoordinatorAccess,
        failure: FailureState,
        departed: Departures,
        progress: ProgressTracker,
        recorder: CallRecorder,
        executors: GroupExecutors,
    ) -> None:
        self._job_id = job_id
        self._rank = rank
        self._hosts = hosts
        self._coordinator = coordinator
        self._progress = progress
        self._recorder = recorder
        self._executors = executors
        self.failure = failure
        self.departed = departed
        self.timeout = timeout
        self.closed = False

    def executor_of(self, group: str) -> OrderedExecutor:
        """The executor that runs ``group``'s calls in issue order (one per group: see GroupExecutors)."""
        return self._executors.of(group)

    def fail(self, error: BaseException) -> None:
        """Records ``error`` as the job's failure unless one is recorded: pending and later calls raise it."""
        self.failure.set(error)

    def check_usable(self, members: frozenset[int]) -> None:
        """Raises the job's failure, or the first departure among ``members`` (the cause; later ones
        may be its victims: members whose call failed because of it, and which then ended)."""
        self.failure.check()
        if self.departed:
            error = self.departed.first_among(members)
            if error is not None:
                raise error

    def ended_by(self) -> BaseException | None:
        """What this member's job ended on, as its Leave tells the others: the job's failure, or else a
        departure over a broken path (a cut link) that ended one of its calls without failing the job
        (a member that left is not a failure here). None when neither happened."""
        return self.failure.error() or self.departed.first_unreachable()

    def execute(
        self,
        group: GroupSpec,
        stream: str,
        seq: int,
        signature: Signature,
        timeout: float | None,
        body: Callable[[Call, Backend], Any],
        backend: Backend,
        gpu_context: Callable[[], AbstractContextManager[Any]] | None,
    ) -> Any:
        """Runs one numbered call now, on this thread: its deadline starts here; its progress and
        timeline span are recorded; a failure is mapped by :meth:`on_failure`.

        Raises:
            CollsvcError: the job's failure before the call, or what the call failed with.
        """
        self.failure.check()
        limit = self.timeout if timeout is None else timeout
        call = Call(group, stream, seq, signature, time.monotonic() + limit, limit)
        record = self._progress.start(stream, seq, signature.text)
        span = self._recorder.start(call)
        try:
            if gpu_context is None:
                result = body(call, backend)
            else:
                with gpu_context():
                    result = body(call, backend)
        except CollsvcError as exc:
            raise self.call_failed(call, record, span, exc) from exc
        self._progress.finish(record)
        self._recorder.finish(span)
        return result

    def call_failed(self, call: Call, record: OpRecord, span: Span, error: CollsvcError) -> CollsvcError:
        """Records a failed call (its progress ``record``, recorder ``span``); returns what its caller raises."""
        self._progress.finish(record, type(error).__name__)
        self._recorder.finish(span, type(error).__name__)
        return self.on_failure(call, error)

    def on_failure(self, call: Call, error: CollsvcError) -> CollsvcError:
        """Turns a failed call into the error every caller sees, and tells the others.

        Timeouts are enriched with who never entered the call; mismatches are reported to the
        coordinator, which fans them out to every member. The job is failed from then on.
        """
        if isinstance(error, RankFailedError) and self._departure(error):
            # A member left cleanly and this call needed it: only this call (and later calls of
            # groups containing it, see Communicator._check_usable) fail; groups without it go on.
            log.info("job %s rank %d: %s", self._job_id, self._rank, error)
            return error
        if isinstance(error, CollectiveTimeoutError) and self.failure.error() is None:
            client = self._coordinator.client
            error = who_is_missing(client, self._hosts, self._rank, self.timeout, call, error)
        if isinstance(error, CollectiveMismatchError):
            details = {str(k): v for k, v in error.details.items()}
            self._coordinator.report(coordinator_pb2.EVENT_KIND_COLLECTIVE_MISMATCH, str(error), details)
        self.failure.set(error)  # the first failure also writes the flight recorder (Job._write_flight_recorder)
        recorded = self.failure.error()
        return recorded if isinstance(recorded, CollsvcError) else error

    def late_for(self, group: GroupSpec, stream: str, seq: int, signature: Signature) -> list[dict[str, Any]]:
        """The ranks call ``seq`` of ``stream`` still waits for, as a timed-out call names them (for a
        message: its peer). Never raises."""
        call = Call(group, stream, seq, signature, 0.0)
        peer = [{"rank": r} for r in group.ranks if r != self._rank] if call.point_to_point else []
        return late_members(self._coordinator.client, self._hosts, self._rank, call, peer)

    def _departure(self, error: RankFailedError) -> bool:
        """Whether ``error`` only says that members left cleanly (no failure recorded meanwhile)."""
        return self.failure.error() is None and self.departed.all_gone(error.ranks)

    @property
    def recording_timeline(self) -> bool:
        """Whether the job records a timeline (per-call phases only the general path measures)."""
        return self._recorder.timeline is not None

    def hooks(self, stream: str) -> StreamHooks:
        """What prepared calls of ``stream`` record through (``Backend.prepare``)."""
        return StreamHooks(stream, self.timeout, self._progress, self._recorder, self.call_failed)


class StreamHooks:
    """The :class:`~collsvc.client.backends.base.CallHooks` of one stream of a job's calls."""

    __slots__ = ("stream", "limit", "_progress", "_recorder", "failed")

    def __init__(
        self,
        stream: str,
        limit: float,
        progress: ProgressTracker,
        recorder: CallRecorder,
        failed: Callable[[Call, Any, Any, CollsvcError], CollsvcError],
    ) -> None:
        """``failed``: :meth:`CallRunner.call_failed` (records a failed call, returns what to raise)."""
        self.stream = stream
        self.limit = limit
        self._progress = progress
        self._recorder = recorder
        self.failed = failed

    @property
    def recording_timeline(self) -> bool:
        """Whether the job records a timeline now (per-call phases only the general path measures)."""
        return self._recorder.timeline is not None

    def progress(self) -> StreamProgress:
        """The stream's progress recorder, for one thread running its calls in order."""
        return self._progress.stream(self.stream)

    def counter(self, signature: Signature, group: GroupSpec) -> CallCounter | None:
        """The statistics' counter of ``signature`` in ``group`` (None when they keep no more pairs)."""
        return self._recorder.counter(signature, group)
