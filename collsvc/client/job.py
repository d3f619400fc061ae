"""A joined job's lifecycle in this process: starting liveness, choosing the backend, closing.

``client/connect.py`` (:func:`~collsvc.client.connect.connect`) joins a job, builds its parts and the
:class:`Job` that holds them. The Job hands its communicators the few things they share (the call
runner of ``client/calls.py``, the coordinator's access, the backend for a call, the members); nobody
else reaches into its parts.
"""

from __future__ import annotations

import functools
import hashlib
import logging

from collsvc.client import fork_guard
from collsvc.client.backends.base import Backend
from collsvc.client.backends.ring.backend import RingBackend
from collsvc.client.backends.ring.grpc_transport import GrpcTransport
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.client.backends.ring.peer_server import PeerServer
from collsvc.client.calls import CallRunner
from collsvc.client.coordinator_access import CoordinatorAccess
from collsvc.client.devices import choose_backend
from collsvc.client.failure_state import FailureState
from collsvc.client.heartbeat import Watcher
from collsvc.client.job_handle import JobHandle
from collsvc.client.progress import ProgressTracker
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.client.work import GroupExecutors
from collsvc.errors import CollectiveTimeoutError, RankFailedError
from collsvc.observability.failure_report import install as install_failure_report
from collsvc.observability.recorder import CallRecorder
from collsvc.options import InitOptions
from collsvc.proto.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)
# How long a member that finished cleanly waits for its peers to confirm the frames it sent over bulk
# lanes before it leaves (ring/lanes.py): only a stopped or cut-off peer takes that long.
LANE_DRAIN_SECONDS = 5.0
# How long a Leave may wait for the coordinator: at least LEAVE_SECONDS, and as many heartbeat
# intervals as the coordinator waits for a silent member by default. A Leave given up on is cancelled,
# and the heartbeat stream closing after it reads as a member that died: on a host crowded past what
# the default pace covers (collsvc run -n 256 on 2 cores: one "failed" member in 9 of 10 runs), the
# coordinator answers slowly but still within the job's own pace.
LEAVE_SECONDS = 5.0
LEAVE_INTERVALS = 5.0


class Job:
    """One joined job in this process: its parts, held for their lifecycle.

    Attributes:
        options: the resolved options it joined with. rank: this process's global rank.
        members: every member, by rank. calls: runs the numbered calls of every communicator.
        coordinator: the coordinator calls of communicators and the code on them.
        handle: what code built on a communicator may see of the job (``comm.job``).
        backend_name: "ring" or "nccl", chosen by :meth:`start`.
    """

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
        progress: ProgressTracker,
        recorder: CallRecorder,
        watcher: Watcher,
        executors: GroupExecutors,
        coordinator: CoordinatorAccess,
        calls: CallRunner,
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
        self.progress = progress
        self.recorder = recorder
        self.watcher = watcher
        self.executors = executors
        self.coordinator = coordinator
        self.calls = calls
        self.handle = JobHandle(options, int(join.job_incarnation), self.hosts, coordinator, calls)
        fork_guard.track(self)

    @property
    def closed(self) -> bool:
        """Whether this process left the job."""
        return self.calls.closed

    def forked(self) -> None:
        """In a child forked from this process: every call on the job (a collective, a coordinator
        call) raises ForkedChildError. Recorded without the failure's lock (another thread may have held
        it at the fork) and listeners (they would abort the parent's backends and write its dump)."""
        self.failure.recorded = fork_guard.child_error(f"a call on job '{self.options.job_id}' (rank {self.rank})")
        self.client = fork_guard.ChildClient(self.failure.recorded)  # type: ignore[assignment]
        self.coordinator.forked(self.failure.recorded)

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
                report=self.calls.on_failure,  # a failure found after the call returned: named and recorded
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
        """The backend a call runs on: NCCL for GPU arrays on a job on NCCL, else the ring backend."""
        return self.nccl if on_gpu and self.nccl is not None else self.ring

    def _write_flight_recorder(self, error: BaseException) -> None:
        """Dumps the flight recorder on this rank's first failure, whether its own call or a job event
        (another rank's mismatch report, a failed member) brought it: every rank leaves a dump for
        ``collsvc diagnose``, not only the ones that noticed first."""
        if fork_guard.forked_child():
            return  # the dump is the rank's, and a child's failure is not the rank's
        path = self.progress.dump(self.options.job_id, self.rank, error)
        log.error("job %s rank %d: %s (recent collectives in %s)", self.options.job_id, self.rank, error, path)

    def close(self) -> None:
        """Leaves the job and releases every resource (idempotent). In a forked child it only marks
        the job closed: the rank, not the child, is the member, and its resources are the rank's."""
        if self.calls.closed:
            return
        self.calls.closed = True
        if fork_guard.forked_child():
            return
        failure = self.calls.ended_by()
        # Ranks that failed, left or were late: named to the others, with the error, so that they blame
        # them and not this member, which merely ended after them.
        blamed = failure.ranks if isinstance(failure, (RankFailedError, CollectiveTimeoutError)) else []
        cause = [r for r in blamed if r != self.rank]
        if failure is None:  # a failed job's frames no longer matter: its peers learn of it at once
            self.transport.drain(LANE_DRAIN_SECONDS)
        unreachable = isinstance(failure, RankFailedError) and failure.unreachable
        reason = str(failure) if cause else ""
        # A coordinator the watcher already lost gets the short wait: the Leave would only hang on it.
        paced = LEAVE_INTERVALS * self.watcher.interval if self.client.link.up else 0.0
        within = max(LEAVE_SECONDS, paced)
        self.client.leave(self.progress.snapshot(), cause, reason, unreachable=unreachable, within=within)
        self.watcher.stop()
        self.recorder.close()
        self.executors.shutdown()
        if self.nccl is not None:
            self.nccl.close()
        self.ring.close()
        self.transport.close()
        self.server.stop()
        self.client.close()
