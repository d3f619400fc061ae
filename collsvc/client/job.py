"""A joined job: everything one process holds for one job, shared by the world communicator and every
sub-communicator made from it; liveness, backend choice, and running one numbered call.

``client/joining.py`` (:func:`~collsvc.client.joining.connect`) joins a job and builds its :class:`Job`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from collsvc.client import fork_guard
from collsvc.client.backends.base import Backend, Call, GroupSpec, Signature
from collsvc.client.backends.ring.backend import RingBackend
from collsvc.client.backends.ring.grpc_transport import GrpcTransport
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.client.backends.ring.peer_server import PeerServer
from collsvc.client.departures import Departures
from collsvc.client.devices import choose_backend
from collsvc.client.failure_state import FailureState
from collsvc.client.heartbeat import Watcher
from collsvc.client.progress import OpRecord, ProgressTracker
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.client.timeout_report import late_members, who_is_missing
from collsvc.client.work import GroupExecutors
from collsvc.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CollsvcError,
    RankFailedError,
)
from collsvc.observability.failure_report import install as install_failure_report
from collsvc.observability.recorder import CallRecorder, Span
from collsvc.options import InitOptions
from collsvc.proto.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)
# How long a member that finished cleanly waits for its peers to confirm the frames it sent over bulk
# lanes before it leaves (ring/lanes.py): only a stopped or cut-off peer takes that long.
LANE_DRAIN_SECONDS = 5.0


class Job:
    """One joined job in this process."""

    def __init__(
        self,
        options: InitOptions,
        client: CoordinatorClient,
        join: coordinator_pb2.JoinResponse,
        members: list[common_pb2.Member],
        *,
        server: PeerServer,
        mailbox: Mailbox,
        transport: GrpcTransport,
        ring: RingBackend,
        failure: FailureState,
        departed: Departures,
        progress: ProgressTracker,
        recorder: CallRecorder,
        watcher: Watcher,
    ) -> None:
        self.options = options
        self.client = client
        self.rank = join.rank
        self.join = join
        self.members = members
        self.server = server
        self.mailbox = mailbox
        self.transport = transport
        self.ring = ring
        self.nccl: Backend | None = None  # set by start() when the job runs on NCCL
        self.backend_name = "ring"
        self.failure = failure
        self.departed = departed
        self.progress = progress
        self.recorder = recorder
        self.watcher = watcher
        self.executors = GroupExecutors(f"collsvc-r{join.rank}")  # one per group: see GroupExecutors
        self.closed = False
        fork_guard.track(self)

    def forked(self) -> None:
        """In a child forked from this process: every call on the job (a collective, a coordinator
        call) raises ForkedChildError. Recorded without the failure's lock (another thread may have held
        it at the fork) and listeners (they would abort the parent's backends and write its dump)."""
        self.failure.recorded = fork_guard.child_error(f"a call on job '{self.options.job_id}' (rank {self.rank})")
        self.client = fork_guard.ChildClient(self.failure.recorded)  # type: ignore[assignment]

    @functools.cached_property
    def hosts(self) -> dict[int, str]:
        """Global rank -> host name of every member (the member table does not change)."""
        return {m.rank: m.host for m in self.members}

    def start(self) -> None:
        """Starts liveness and picks the backend.

        Raises:
            RendezvousError / BackendUnavailableError: the requested backend cannot run on these members.
        """
        self.watcher.start(self.options.timeout)
        install_failure_report()  # an uncaught collsvc error then reads as a short story
        self._choose_backend()
        self.failure.add_listener(self._abort_backends)
        self.failure.add_listener(self._write_flight_recorder)  # after waking every waiter: file I/O

    def _choose_backend(self) -> None:
        name, reason = choose_backend(self.options.backend, self.members, self.rank)
        log.info("job %s rank %d: backend %s (%s)", self.options.job_id, self.rank, name, reason)
        if name == "nccl":
            from collsvc.client.backends.nccl.backend import NcclBackend

            self.nccl = NcclBackend(
                rank=self.rank,
                size=len(self.members),
                kv=self,
                barrier=self.named_barrier,
                timeout=self.options.timeout,
                failure=self.failure,
                device=next(m.device.index for m in self.members if m.rank == self.rank),
                report=self.on_failure,  # a failure found after the call returned: named and recorded
            )
        self.backend_name = name

    # Key/value and barrier services injected into backends (the NCCL unique id travels this way).
    def set(self, key: str, value: bytes) -> None:
        self.client.set(key, value)

    def get(self, key: str, timeout: float) -> bytes:
        return self.client.get(key, timeout)

    def named_barrier(self, name: str, timeout: float) -> None:
        """A coordinator barrier over the members of the group named after the first "/" of ``name``
        (``"nccl-init/world"`` -> group ``world``), separate from the group's user barriers."""
        group = name.partition("/")[2] or "world"
        count = self.client.add(f"named-barrier/{name}/{self.rank}", 1)
        tag = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=2).digest(), "little")
        self.client.barrier(group, self.rank, (1 << 40) + (tag << 20) + count, timeout)

    def _abort_backends(self, error: BaseException) -> None:
        self.ring.abort(error)
        if self.nccl is not None:
            self.nccl.abort(error)

    def backend_for(self, on_gpu: bool) -> Backend:
        return self.nccl if on_gpu and self.nccl is not None else self.ring

    def check_usable(self, members: frozenset[int]) -> None:
        """Raises the job's failure, or the first departure among ``members`` (the cause; later ones
        may be its victims: members whose call failed because of it, and which then ended)."""
        self.failure.check()
        if self.departed:
            error = self.departed.first_among(members)
            if error is not None:
                raise error

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
        limit = self.options.timeout if timeout is None else timeout
        call = Call(group, stream, seq, signature, time.monotonic() + limit, limit)
        record = self.progress.start(stream, seq, signature.text)
        span = self.recorder.start(call)
        try:
            if gpu_context is None:
                result = body(call, backend)
            else:
                with gpu_context():
                    result = body(call, backend)
        except CollsvcError as exc:
            raise self.call_failed(call, record, span, exc) from exc
        self.progress.finish(record)
        self.recorder.finish(span)
        return result

    def call_failed(self, call: Call, record: OpRecord, span: Span, error: CollsvcError) -> CollsvcError:
        """Records a failed call (its progress ``record``, recorder ``span``); returns what its caller raises."""
        self.progress.finish(record, type(error).__name__)
        self.recorder.finish(span, type(error).__name__)
        return self.on_failure(call, error)

    def on_failure(self, call: Call, error: CollsvcError) -> CollsvcError:
        """Turns a failed call into the error every caller sees, and tells the others.

        Timeouts are enriched with who never entered the call; mismatches are reported to the
        coordinator, which fans them out to every member. The job is failed from then on.
        """
        if isinstance(error, RankFailedError) and self._departure(error):
            # A member left cleanly and this call needed it: only this call (and later calls of
            # groups containing it, see Communicator._check_usable) fail; groups without it go on.
            log.info("job %s rank %d: %s", self.options.job_id, self.rank, error)
            return error
        if isinstance(error, CollectiveTimeoutError) and self.failure.error() is None:
            error = who_is_missing(self.client, self.hosts, self.rank, self.options.timeout, call, error)
        if isinstance(error, CollectiveMismatchError):
            details = {str(k): v for k, v in error.details.items()}
            self.client.report(coordinator_pb2.EVENT_KIND_COLLECTIVE_MISMATCH, str(error), details)
        self.failure.set(error)  # the first failure also writes the flight recorder (_write_flight_recorder)
        recorded = self.failure.error()
        return recorded if isinstance(recorded, CollsvcError) else error

    def late_for(self, group: GroupSpec, stream: str, seq: int, signature: Signature) -> list[dict[str, Any]]:
        """The ranks call ``seq`` of ``stream`` still waits for, as a timed-out call names them (for a
        message: its peer). Never raises."""
        call = Call(group, stream, seq, signature, 0.0)
        peer = [{"rank": r} for r in group.ranks if r != self.rank] if call.point_to_point else []
        return late_members(self.client, self.hosts, self.rank, call, peer)

    def _write_flight_recorder(self, error: BaseException) -> None:
        """Dumps the flight recorder on this rank's first failure, whether its own call or a job event
        (another rank's mismatch report, a failed member) brought it: every rank leaves a dump for
        ``collsvc diagnose``, not only the ones that noticed first."""
        if fork_guard.forked_child():
            return  # the dump is the rank's, and a child's failure is not the rank's
        path = self.progress.dump(self.options.job_id, self.rank, error)
        log.error("job %s rank %d: %s (recent collectives in %s)", self.options.job_id, self.rank, error, path)

    def _departure(self, error: RankFailedError) -> bool:
        """Whether ``error`` only says that members left cleanly (no failure recorded meanwhile)."""
        return self.failure.error() is None and self.departed.all_gone(error.ranks)

    def close(self) -> None:
        """Leaves the job and releases every resource (idempotent). In a forked child it only marks
        the job closed: the rank, not the child, is the member, and its resources are the rank's."""
        if self.closed:
            return
        self.closed = True
        if fork_guard.forked_child():
            return
        # A departure over a broken path (a cut link) ended a call of this member without failing the
        # job (a member that left is not a failure here): it is still what this member ends after.
        failure = self.failure.error() or self.departed.first_unreachable()
        # Ranks that failed, left or were late: named to the others, with the error, so that they blame
        # them and not this member, which merely ended after them.
        blamed = failure.ranks if isinstance(failure, (RankFailedError, CollectiveTimeoutError)) else []
        cause = [r for r in blamed if r != self.rank]
        if failure is None:  # a failed job's frames no longer matter: its peers learn of it at once
            self.transport.drain(LANE_DRAIN_SECONDS)
        unreachable = isinstance(failure, RankFailedError) and failure.unreachable
        self.client.leave(self.progress.snapshot(), cause, str(failure) if cause else "", unreachable=unreachable)
        self.watcher.stop()
        self.recorder.close()
        self.executors.shutdown()
        if self.nccl is not None:
            self.nccl.close()
        self.ring.close()
        self.transport.close()
        self.server.stop()
        self.client.close()
