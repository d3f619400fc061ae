"""The composition root of a joined job: the peer endpoint, the coordinator handshake, and every part
of the job, built here and only here.

:func:`connect` returns a :class:`~collsvc.client.job.Job`, which holds the parts for their lifecycle
and hands its communicators the few they use: the call runner (``client/calls.py``), the coordinator's
access (``client/coordinator_access.py``), the backends. Nothing else reaches into the parts.
"""

from __future__ import annotations

import logging
import os
import time

from collsvc.client import fork_guard
from collsvc.client.backends.reduction import reducing_ns
from collsvc.client.backends.ring.backend import RingBackend
from collsvc.client.backends.ring.grpc_transport import GrpcTransport
from collsvc.client.backends.ring.local_frames import for_job as frames_for_job
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.client.backends.ring.peer_server import PeerServer
from collsvc.client.backends.shm.groups import LocalGroups
from collsvc.client.calls import CallRunner
from collsvc.client.coordinator_access import CoordinatorAccess
from collsvc.client.coordinator_channel import wait_for_launch_signal
from collsvc.client.departures import Departures
from collsvc.client.devices import local_device
from collsvc.client.failure_state import FailureState
from collsvc.client.heartbeat import Watcher
from collsvc.client.job import Job
from collsvc.client.peer_address import peer_binding
from collsvc.client.progress import ProgressTracker
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.client.work import GroupExecutors
from collsvc.config import coordinator_ready_fd, timeline_target
from collsvc.errors import (
    RendezvousError,
)
from collsvc.observability.recorder import CallRecorder
from collsvc.options import InitOptions, Limits
from collsvc.proto.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)


def connect(options: InitOptions) -> Job:
    """Serves the peer endpoint, joins the job, starts liveness and picks the backend.

    Raises:
        RendezvousError: world size disagreement, duplicate rank, full job, or no coordinator in time.
        AuthenticationError: the coordinator refused the token or TLS.
        BackendUnavailableError: ``backend="nccl"`` without CuPy or a GPU.
        OSError: the peer endpoint could not be bound.
        ForkedChildError: this process was forked from one that joined a job (its gRPC is unusable).
    """
    fork_guard.check_member("joining a job")
    fork_guard.note_member()  # from now on gRPC runs here: children of this process are no members
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
            lane_port=options.lane_port if options.tcp_lane and options.tls is None else None,
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
    fork_guard.warn_if_grpc_forks(options.job_id, join.rank)
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
        lane=options.tcp_lane,
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
        host=next((m.host for m in members if m.rank == join.rank), None),
        interval=max(options.heartbeat_interval, join.heartbeat_interval_s),  # the coordinator's pace for large jobs
        progress=progress,
        failure=failure,
        departed=departed.record,
        coordinator_grace=options.coordinator_grace,
        stats=recorder.stats.snapshot,
    )
    coordinator = CoordinatorAccess(client)
    executors = GroupExecutors(f"collsvc-r{join.rank}")  # one per group: see GroupExecutors
    calls = CallRunner(
        job_id=options.job_id,
        rank=join.rank,
        hosts=hosts,
        timeout=options.timeout,
        coordinator=coordinator,
        failure=failure,
        departed=departed,
        progress=progress,
        recorder=recorder,
        executors=executors,
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
        progress=progress,
        recorder=recorder,
        watcher=watcher,
        executors=executors,
        coordinator=coordinator,
        calls=calls,
    )
