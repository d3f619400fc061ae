"""Translation between the pure state and protocol messages (no decisions here)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from collsvc.proto.v1 import common_pb2, coordinator_pb2
from collsvc.server.state.common import WORLD, Device, Member, WaitingInfo
from collsvc.server.state.jobs import Job
from collsvc.server.state.recovery import Reregistration
from collsvc.server.state.roster import JoinRequest


def device_from_proto(device: Any) -> Device:
    return Device(kind=device.kind or "cpu", uuid=device.uuid, pci_bus_id=device.pci_bus_id, index=device.index)


def join_request(request: Any) -> JoinRequest:
    """A ``JoinRequest`` message as the state's :class:`JoinRequest`."""
    return JoinRequest(
        world_size=request.world_size,
        requested_rank=request.requested_rank if request.HasField("requested_rank") else None,
        host=request.host,
        peer_address=request.peer_address,
        device=device_from_proto(request.device),
        pid=request.pid,
        local_rank_hint=request.local_rank_hint if request.HasField("local_rank_hint") else None,
        idempotency_key=request.idempotency_key,
    )


def reregistration(request: Any) -> Reregistration:
    """A ``ReregisterRequest`` message as the state's :class:`Reregistration`."""
    member = request.member
    return Reregistration(
        rank=request.rank,
        secret=request.member_secret,
        incarnation=request.job_incarnation,
        world_size=request.world_size,
        num_nodes=request.num_nodes,
        host=member.host,
        peer_address=member.peer_address,
        device=device_from_proto(member.device),
        pid=member.pid,
        local_rank=member.local_rank,
        local_size=member.local_size,
        node_rank=member.node_rank,
        barriers=tuple((b.group or WORLD, b.generation) for b in request.barriers),
        left_ranks=tuple(request.left_ranks),
        last_event_seq=request.last_event_seq,
    )


def member_proto(job: Job, member: Member, *, with_heartbeat: bool) -> Any:
    """A ``Member`` message; ``seconds_since_heartbeat`` only when asked (it goes stale at once)."""
    device = member.device
    return common_pb2.Member(
        rank=member.rank,
        host=member.host,
        local_rank=member.local_rank,
        local_size=member.local_size,
        node_rank=member.node_rank,
        peer_address=member.peer_address,
        device=common_pb2.DeviceIdentity(
            kind=device.kind, uuid=device.uuid, pci_bus_id=device.pci_bus_id, index=device.index
        ),
        pid=member.pid,
        state=cast("common_pb2.MemberState", int(member.state)),
        seconds_since_heartbeat=job.seconds_since_heartbeat(member) if with_heartbeat else 0.0,
    )


def join_reply(job: Job, member: Member, heartbeat_interval: float = 0.0) -> Any:
    return coordinator_pb2.JoinResponse(
        heartbeat_interval_s=heartbeat_interval,
        rank=member.rank,
        world_size=len(job.members),
        local_rank=member.local_rank,
        local_size=member.local_size,
        node_rank=member.node_rank,
        num_nodes=job.num_nodes,
        job_incarnation=job.incarnation,
        member_secret=member.secret,
    )


def members_reply_bytes(job: Job) -> bytes:
    """The serialized ``GetMembersResponse`` (states as of now; no heartbeat ages)."""
    reply = coordinator_pb2.GetMembersResponse(job_incarnation=job.incarnation)
    reply.members.extend(member_proto(job, m, with_heartbeat=False) for m in job.members)
    return reply.SerializeToString()


def waiting_protos(entries: Iterable[WaitingInfo]) -> list[Any]:
    return [
        coordinator_pb2.WaitingMember(rank=w.rank, host=w.host, last_op=w.last_op, finished_seq=w.finished_seq)
        for w in entries
    ]


def job_status(job: Job) -> Any:
    """A ``JobStatus``: members with live state and heartbeat age, groups, world progress, failure."""
    status = coordinator_pb2.JobStatus(
        job_id=job.job_id, world_size=job.world_size or 0, state=job.state, failure=job.failure_text
    )
    members = job.members if job.complete else job.pending_members()
    for member in members:
        entry = member_proto(job, member, with_heartbeat=True)
        if not job.complete and member.requested_rank is not None:
            entry.rank = member.requested_rank
        status.members.append(entry)
        status.world_stats.append(world_totals(member))
        record = member.progress.get(WORLD)
        status.progress.append(
            common_pb2.Progress(
                group=WORLD,
                started_seq=record.started_seq if record else 0,
                finished_seq=record.finished_seq if record else 0,
                last_op=record.last_op if record else "",
            )
        )
    for name, ranks in job.groups.items():
        status.groups.append(coordinator_pb2.GroupStatus(name=name, ranks=ranks))
    return status


def world_totals(member: Member) -> Any:
    """A member's "world" collectives summed over ops (count, seconds), from its heartbeats' totals."""
    totals = common_pb2.CollectiveStats(group=WORLD)
    for (_op, group), stats in member.stats.items():
        if group == WORLD:
            totals.count += stats.count
            totals.seconds += stats.seconds
    return totals


def progress_tuples(entries: Iterable[Any]) -> list[tuple[str, int, int, str]]:
    """Progress messages as (group, started_seq, finished_seq, last_op) tuples for the state classes."""
    return [(p.group, p.started_seq, p.finished_seq, p.last_op) for p in entries]
