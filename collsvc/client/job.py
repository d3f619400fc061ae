"""Joining a job: the peer endpoint, the coordinator handshake, liveness, and backend choice.

:func:`connect` returns a :class:`Job`: everything one process holds for one job, shared by the world
communicator and every sub-communicator made from it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from collsvc.client.backends.base import Backend, Call, GroupSpec, Signature
from collsvc.client.backends.reduction import reducing_ns
from collsvc.client.backends.ring.backend import RingBackend
from collsvc.client.backends.ring.grpc_transport import GrpcTransport, PeerServer
from collsvc.client.backends.ring.local_frames import for_job as frames_for_job
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.client.backends.shm.groups import LocalGroups
from collsvc.client.coordinator_channel import wait_for_launch_signal
from collsvc.client.departures import Departures
from collsvc.client.devices import choose_backend, local_device
from collsvc.client.failure_state import FailureState
from collsvc.client.heartbeat import Watcher
from collsvc.client.peer_address import peer_binding
from collsvc.client.progress import OpRecord, ProgressTracker
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.client.timeout_report import late_members, who_is_missing
from collsvc.client.work import GroupExecutors
from collsvc.config import coordinator_ready_fd, timeline_target
from collsvc.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CollsvcError,
    RankFailedError,
    RendezvousError,
)
from collsvc.failure_report import install as install_failure_report
from collsvc.observability.recorder import CallRecorder, Span
from collsvc.options import InitOptions, Limits
from collsvc.proto.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)


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
        path = self.progress.dump(self.options.job_id, self.rank, error)
        log.error("job %s rank %d: %s (recent collectives in %s)", self.options.job_id, self.rank, error, path)

    def _departure(self, error: RankFailedError) -> bool:
        """Whether ``error`` only says that members left cleanly (no failure recorded meanwhile)."""
        return self.failure.error() is None and self.departed.all_gone(error.ranks)

    def close(self) -> None:
        """Leaves the job and releases every resource (idempotent)."""
        if self.closed:
            return
        self.closed = True
        failure = self.failure.error()
        # Ranks that failed, left or were late: named to the others, with the error, so that they blame
        # them and not this member, which merely ended after them.
        blamed = failure.ranks if isinstance(failure, (RankFailedError, CollectiveTimeoutError)) else []
        cause = [r for r in blamed if r != self.rank]
        self.client.leave(self.progress.snapshot(), cause, str(failure) if cause else "")
        self.watcher.stop()
        self.recorder.close()
        self.executors.shutdown()
        if self.nccl is not None:
            self.nccl.close()
        self.ring.close()
        self.transport.close()
        self.server.stop()
        self.client.close()


def connect(options: InitOptions) -> Job:
    """Serves the peer endpoint, joins the job, starts liveness and picks the backend.

    Raises:
        RendezvousError: world size disagreement, duplicate rank, full job, or no coordinator in time.
        AuthenticationError: the coordinator refused the token or TLS.
        BackendUnavailableError: ``backend="nccl"`` without CuPy or a GPU.
        OSError: the peer endpoint could not be bound.
    """
    client = CoordinatorClient(  # creating its channel does not dial yet
        options.coordinator,
        options.job_id,
        token=options.token,
        tls=options.tls,
        timeout=options.timeout,
        join_timeout=options.join_timeout,
    )
    # Both connections to the coordinator open while the peer endpoint starts, not one after the other;
    # under `collsvc run`, once its coordinator listens (it starts with the ranks).
    launch_signal = coordinator_ready_fd()
    if launch_signal is None:
        client.connect_ahead(options.heartbeat_interval)
    mailbox = Mailbox()
    try:
        bind_host, advertise_host = peer_binding(options)
        server = PeerServer(
            bind_host,
            options.peer_port,
            mailbox,
            token=options.token,
            tls=options.tls,
            max_message_bytes=Limits().max_message_bytes,
        )
    except BaseException:
        client.close()
        raise
    peer_address = f"[{advertise_host}]:{server.port}" if ":" in advertise_host else f"{advertise_host}:{server.port}"
    started = time.monotonic()
    try:
        device = local_device(options.local_rank_hint)  # probes CuPy: slow where it is installed
        if launch_signal is not None:
            wait_for_launch_signal(launch_signal, options.join_timeout or options.timeout)
            client.connect_ahead(options.heartbeat_interval)
        join = client.join(
            world_size=options.world_size,
            rank=options.rank,
            host=options.host,
            peer_address=peer_address,
            device=device,
            pid=os.getpid(),
            local_rank_hint=options.local_rank_hint,
        )
        job = _assemble(options, client, join, client.members(), server, mailbox)
    except BaseException:
        server.stop(0)
        client.close()
        raise
    try:
        job.start()
    except BaseException:
        job.close()  # leave cleanly: the others learn at once, and the coordinator logs no failure
        raise
    log.info(
        "job %s: joined as rank %d of %d on %s in %.3fs (peer endpoint %s)",
        options.job_id,
        join.rank,
        join.world_size,
        options.host,
        time.monotonic() - started,
        peer_address,
    )
    if len(job.members) != options.world_size:
        raise RendezvousError(f"coordinator returned {len(job.members)} members for a world of {options.world_size}")
    return job


def _assemble(
    options: InitOptions,
    client: CoordinatorClient,
    join: coordinator_pb2.JoinResponse,
    members: list[common_pb2.Member],
    server: PeerServer,
    mailbox: Mailbox,
) -> Job:
    """Builds a joined job's parts and the :class:`Job` that holds them. Nothing starts yet but the
    inbox of the frames from local peers and its thread (``local_frames``), so that peers reach it
    as soon as they can send; closing the Job's transport stops them."""
    members = sorted(members, key=lambda m: m.rank)
    failure = FailureState()
    failure.add_listener(mailbox.fail)
    progress = ProgressTracker()
    recorder = CallRecorder(options.job_id, join.rank, options.host, timeline_target(), reduce_clock=reducing_ns)
    hosts = {m.rank: m.host for m in members}
    job_key = f"{options.job_id}|{join.job_incarnation}"
    max_message_bytes = Limits().max_message_bytes
    local_frames, local_groups = None, None
    if options.shared_memory:
        local_frames = frames_for_job(join.rank, hosts, job_key, options.token, mailbox, max_message_bytes)
        local_groups = LocalGroups(job_key, options.timeout)
    transport = GrpcTransport(
        join.rank,
        {m.rank: m.peer_address for m in members},
        hosts,
        mailbox,
        token=options.token,
        tls=options.tls,
        max_message_bytes=max_message_bytes,
        local_frames=local_frames,
    )
    ring = RingBackend(
        transport.channel,
        hosts=hosts,
        local_groups=local_groups,
        hierarchical=options.hierarchical,
        small_bytes=options.small_bytes,
        rooted_agreement=options.rooted_agreement,
    )
    # The mailbox and the shared-memory groups both hold waits that a departure can doom.
    departed = Departures([mailbox, ring])
    watcher = Watcher(
        client,
        join.rank,
        interval=max(options.heartbeat_interval, join.heartbeat_interval_s),  # the coordinator's pace for large jobs
        progress=progress,
        failure=failure,
        departed=departed.record,
        coordinator_grace=options.coordinator_grace,
        stats=recorder.stats.snapshot,
    )
    return Job(
        options,
        client,
        join,
        members,
        server=server,
        mailbox=mailbox,
        transport=transport,
        ring=ring,
        failure=failure,
        departed=departed,
        progress=progress,
        recorder=recorder,
        watcher=watcher,
    )
