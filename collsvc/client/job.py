"""Joining a job: the peer endpoint, the coordinator handshake, liveness, and backend choice.

:func:`connect` returns a :class:`Job`: everything one process holds for one job, shared by the world
communicator and every sub-communicator made from it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import socket
import time

from collsvc.client.backends.base import Backend, Call
from collsvc.client.backends.reduction import reducing_ns
from collsvc.client.backends.ring.backend import RingBackend
from collsvc.client.backends.ring.grpc_transport import GrpcTransport, PeerServer
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.client.backends.shm.groups import LocalGroups
from collsvc.client.coordinator_channel import wait_for_launch_signal
from collsvc.client.failure_state import FailureState
from collsvc.client.heartbeat import Watcher
from collsvc.client.progress import ProgressTracker
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.client.work import OrderedExecutor
from collsvc.config import coordinator_ready_fd, timeline_target
from collsvc.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CollsvcError,
    RankFailedError,
    RendezvousError,
)
from collsvc.failure_report import install as install_failure_report
from collsvc.observability.recorder import CallRecorder
from collsvc.proto.v1 import common_pb2, coordinator_pb2
from collsvc.types import InitOptions, Limits

log = logging.getLogger(__name__)


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_address(address: str) -> tuple[str, int | None]:
    """``host:port`` (or ``[v6]:port``, or a bare host) -> (host, port or None)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if address.count(":") == 1:
        host, port = address.split(":")
        return host, int(port)
    return address, None


def peer_binding(options: InitOptions) -> tuple[str, str]:
    """(address to bind the peer endpoint on, host peers should dial).

    A loopback coordinator means a single-host job: bind loopback only. Otherwise bind every interface
    and advertise ``COLLSVC_ADVERTISE_ADDRESS`` or the local address that routes to the coordinator.
    """
    coordinator_host, coordinator_port = split_address(options.coordinator)
    if options.advertise_address:
        advertised, _ = split_address(options.advertise_address)
        return ("127.0.0.1" if _is_loopback(coordinator_host) and _is_loopback(advertised) else "0.0.0.0"), advertised
    if _is_loopback(coordinator_host):
        return "127.0.0.1", "127.0.0.1"
    try:
        # A UDP "connect" sends nothing; it asks the kernel which local address routes there.
        family = socket.AF_INET6 if ":" in coordinator_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((coordinator_host, coordinator_port or 29400))
            local = str(probe.getsockname()[0])
    except OSError:
        local = socket.gethostbyname(socket.gethostname())
    return "0.0.0.0", local


def _device(local_rank_hint: int | None) -> common_pb2.DeviceIdentity:
    try:
        from collsvc.client.devices import local_device
    except ImportError:
        return common_pb2.DeviceIdentity(kind="cpu")
    device: common_pb2.DeviceIdentity = local_device(local_rank_hint)
    return device


class Job:
    """One joined job in this process."""

    def __init__(
        self,
        options: InitOptions,
        client: CoordinatorClient,
        join: coordinator_pb2.JoinResponse,
        members: list[common_pb2.Member],
        server: PeerServer,
        mailbox: Mailbox,
    ) -> None:
        self.options = options
        self.client = client
        self.rank = join.rank
        self.join = join
        self.members = sorted(members, key=lambda m: m.rank)
        self.server = server
        self.mailbox = mailbox
        self.failure = FailureState()
        self.failure.add_listener(mailbox.fail)
        self.progress = ProgressTracker()
        self.recorder = CallRecorder(
            options.job_id, join.rank, options.host, timeline_target(), reduce_clock=reducing_ns
        )
        self.executor = OrderedExecutor(f"collsvc-r{join.rank}")
        self.transport = GrpcTransport(
            join.rank,
            {m.rank: m.peer_address for m in self.members},
            {m.rank: m.host for m in self.members},
            mailbox,
            token=options.token,
            tls=options.tls,
            max_message_bytes=Limits().max_message_bytes,
        )
        local_groups = None
        if options.shared_memory:
            local_groups = LocalGroups(f"{options.job_id}|{join.job_incarnation}", options.timeout)
        self.ring = RingBackend(
            self.transport.channel,
            hosts=self.hosts,
            local_groups=local_groups,
            hierarchical=options.hierarchical,
            small_bytes=options.small_bytes,
            rooted_agreement=options.rooted_agreement,
        )
        self.nccl: Backend | None = None  # NcclBackend, checked against the protocol by mypy
        self.backend_name = "ring"
        self.watcher = Watcher(
            client,
            join.rank,
            interval=options.heartbeat_interval,
            progress=self.progress,
            failure=self.failure,
            departed=self._departed,
            coordinator_grace=options.coordinator_grace,
            stats=self.recorder.stats.snapshot,
        )
        self.departed: dict[int, RankFailedError] = {}
        self.closed = False

    @property
    def hosts(self) -> dict[int, str]:
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
        try:
            from collsvc.client.devices import choose_backend
        except ImportError:
            return
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

    def _departed(self, ranks: list[int], error: RankFailedError, finished: dict[int, dict[str, int]]) -> None:
        for rank in ranks:
            self.departed.setdefault(rank, error)
        self.mailbox.depart(ranks, error, finished)
        self.ring.depart(ranks, error, finished)  # shared-memory waiters too, not only the gRPC mailbox

    def _abort_backends(self, error: BaseException) -> None:
        self.ring.abort(error)
        if self.nccl is not None:
            self.nccl.abort(error)

    def backend_for(self, on_gpu: bool) -> Backend:
        return self.nccl if on_gpu and self.nccl is not None else self.ring

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
            error = self._timeout_error(call, error)
        if isinstance(error, CollectiveMismatchError):
            details = {str(k): v for k, v in error.details.items()}
            self.client.report(coordinator_pb2.EVENT_KIND_COLLECTIVE_MISMATCH, str(error), details)
        self.failure.set(error)  # the first failure also writes the flight recorder (_write_flight_recorder)
        recorded = self.failure.error()
        return recorded if isinstance(recorded, CollsvcError) else error

    def _write_flight_recorder(self, error: BaseException) -> None:
        """Dumps the flight recorder on this rank's first failure, whether its own call or a job event
        (another rank's mismatch report, a failed member) brought it: every rank leaves a dump for
        ``collsvc diagnose``, not only the ones that noticed first."""
        path = self.progress.dump(self.options.job_id, self.rank, error)
        log.error("job %s rank %d: %s (recent collectives in %s)", self.options.job_id, self.rank, error, path)

    def _departure(self, error: RankFailedError) -> bool:
        """Whether ``error`` only says that members left cleanly (no failure recorded meanwhile)."""
        return self.failure.error() is None and bool(error.ranks) and all(rank in self.departed for rank in error.ranks)

    def _timeout_error(self, call: Call, error: CollectiveTimeoutError) -> CollectiveTimeoutError:
        waiting = error.waiting_on
        try:
            not_started = self.client.progress(call.group.name, call.seq)
        except CollsvcError as exc:
            log.warning("job %s rank %d: could not ask who is missing: %s", self.options.job_id, self.rank, exc)
            not_started = []
        if not_started:
            waiting = not_started
        hosts = self.hosts
        for entry in waiting:
            entry.setdefault("host", hosts.get(int(entry["rank"]), ""))
        named = ", ".join(
            f"{w['rank']} ({w.get('host', '')}; last completed: {w.get('last_op') or 'none'})" for w in waiting
        )
        limit = self.options.timeout if call.timeout is None else call.timeout  # barrier(timeout=...)
        return CollectiveTimeoutError(
            f"{call.signature.op} #{call.seq} in group '{call.group.name}' timed out after "
            f"{limit:g}s on rank {self.rank}; waiting on rank{'s' if len(waiting) > 1 else ''} {named}",
            waiting,
        )

    def close(self) -> None:
        """Leaves the job and releases every resource (idempotent)."""
        if self.closed:
            return
        self.closed = True
        failure = self.failure.error()
        cause = [r for r in failure.ranks if r != self.rank] if isinstance(failure, RankFailedError) else []
        self.client.leave(self.progress.snapshot(), cause)
        self.watcher.stop()
        self.recorder.close()
        self.executor.shutdown()
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
        device = _device(options.local_rank_hint)  # probes CuPy: slow where it is installed
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
        job = Job(options, client, join, client.members(), server, mailbox)
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
