"""The Coordinator servicer: translates messages into calls on the state and waits on the hub.

Every method is wrapped by :func:`collsvc.server.interceptors.translate_errors`, the one place where
exceptions become gRPC statuses.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from typing import Any

import grpc

from collsvc.errors import AuthenticationError, RendezvousError
from collsvc.proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from collsvc.server.interceptors import (
    Context,
    TokenCheckedHandlers,
    lenient_deserializer,
    stream_deserializer,
    translate_errors,
)
from collsvc.server.request_limits import RequestLimits
from collsvc.server.services.convert import (
    job_status,
    progress_tuples,
    reregistration,
    waiting_protos,
)
from collsvc.server.services.hub import Hub, JobRuntime, wait_event, wait_seconds
from collsvc.server.services.join import join_members
from collsvc.server.services.progress_requests import silent, unfinished, waiting_elsewhere
from collsvc.server.services.watch import watch
from collsvc.server.state.common import Member, NotFoundError
from collsvc.server.state.jobs import Job

log = logging.getLogger(__name__)
pb = coordinator_pb2
Events = coordinator_pb2.EventKind
SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]

# Every member passing a barrier gets the same answer: serialized once, not once per member.
BARRIER_PASSED = pb.BarrierResponse(complete=True).SerializeToString()
# The longest a GetProgress call waits for members to report their progress as of now.
MAX_FRESH_PROGRESS_S = 10.0
# The longest error message a leaving member may pass on to the others.
MAX_CAUSE_REASON_CHARS = 2000


async def usable(rt: JobRuntime, timeout_s: float, context: Context) -> JobRuntime:
    """``rt`` once its job is usable: a job rebuilt after a coordinator restart first waits (bounded by
    the request's timeout) until every member re-registered or the others were declared failed.

    Raises:
        RendezvousError: the job is still being rebuilt when the wait ends.
    """
    if not rt.usable.is_set() and not await wait_event(rt.usable, wait_seconds(timeout_s, context)):
        missing = [m.rank for m in rt.job.members if not m.registered and not m.gone]
        raise RendezvousError(
            f"job {rt.job.job_id!r} is still being rebuilt after a coordinator restart; "
            f"ranks {missing} have not re-registered yet"
        )
    return rt


def host_ranks(job: Job, caller: Member, ranks: Iterable[int]) -> list[int]:
    """``ranks``, once each member is checked to be on ``caller``'s host (as the members joined): a
    member arrives at a barrier for others only where they passed a barrier of their own together.

    Raises:
        AuthenticationError: a rank is not a member of the job, or lives on another host.
    """
    members = job.members
    for rank in ranks:
        if not 0 <= rank < len(members) or members[rank].host != caller.host:
            raise AuthenticationError(
                f"rank {caller.rank} (host {caller.host!r}) may arrive at a barrier only for members of its own "
                f"host; rank {rank} is not one"
            )
    return list(ranks)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):  # type: ignore[misc]
    """Serves one :class:`Hub`."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    async def _find_or_create(self, job_id: str, context: Context, timeout_s: float = 0.0) -> JobRuntime:
        return await usable(self.hub.find_or_create(job_id), timeout_s, context)

    async def _find(self, job_id: str, context: Context) -> JobRuntime:
        return await usable(self.hub.find(job_id), 0.0, context)

    # ------------------------------------------------------------------------------ rendezvous

    @translate_errors
    async def Join(self, request: Any, context: Context) -> Any:
        return (await join_members(self.hub, [request], context))[0]

    @translate_errors
    async def JoinBatch(self, request: Any, context: Context) -> Any:
        return pb.JoinBatchResponse(members=await join_members(self.hub, request.members, context))

    @translate_errors
    async def GetMembers(self, request: Any, context: Context) -> bytes:
        rt = self.hub.find(request.job_id)
        if not rt.job.complete:
            raise NotFoundError(f"job {request.job_id!r} has not completed its rendezvous yet")
        return rt.members_bytes()  # serialized once per change of any member's state

    @translate_errors
    async def Barrier(self, request: Any, context: Context) -> Any:
        rt, caller = self.hub.authenticate(request.job_id, request.rank, request.member_secret)
        if not rt.usable.is_set():
            await usable(rt, request.timeout_s, context)
        job, group, generation = rt.job, request.group or "world", request.generation
        key = (group, generation)
        complete = False
        for rank in (request.rank, *host_ranks(job, caller, request.on_behalf_of)):
            complete = job.barrier_arrive(group, generation, rank)
        if complete:
            rt.complete_barrier(key)
            job.record_barrier_wait(group, 0.0)  # the last to arrive waits for nobody
            return BARRIER_PASSED
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        deadline = arrived + wait_seconds(request.timeout_s, context)
        while True:
            remaining = deadline - loop.time()
            woken = await rt.barrier_event(key).wait(remaining)
            # Woken by a failure, leave or abort: raise it (a member that left after arriving here left
            # because this barrier failed for it: the others time out naming who never arrived). Only
            # the members that left are looked at, so waking n waiters costs O(n), not O(n^2).
            job.check_healthy(group, excused=job.barriers.arrived_among(group, generation, job.left_ranks))
            if job.barriers.is_complete(group, generation):
                job.record_barrier_wait(group, loop.time() - arrived)
                return BARRIER_PASSED
            if not woken or remaining <= 0:
                job.count_failure("barrier_timeout")
                return pb.BarrierResponse(complete=False, waiting_on=waiting_protos(rt.barrier_waiting_on(key)))

    # -------------------------------------------------------------------------------- key/value

    @translate_errors
    async def SetKey(self, request: Any, context: Context) -> Any:
        rt = self.hub.find_or_create(request.job_id)
        if request.restore:  # a re-registered member restoring its keys: no need to wait for the others
            rt.job.kv.restore(request.key, request.value)
            rt.notify_key(request.key)
            return pb.SetKeyResponse()
        await usable(rt, 0.0, context)
        rt.job.kv.set(request.key, request.value)
        rt.notify_key(request.key)
        return pb.SetKeyResponse()

    @translate_errors
    async def GetKey(self, request: Any, context: Context) -> Any:
        rt = await self._find_or_create(request.job_id, context, request.timeout_s)
        value = rt.job.kv.get(request.key)
        if value is None and request.wait:
            deadline = asyncio.get_running_loop().time() + wait_seconds(request.timeout_s, context)
            while value is None:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0 or not await rt.wait_for_key(request.key, remaining):
                    break
                value = rt.job.kv.get(request.key)
        if value is None:
            return pb.GetKeyResponse(found=False)
        return pb.GetKeyResponse(found=True, value=value)

    @translate_errors
    async def AddKey(self, request: Any, context: Context) -> Any:
        rt = await self._find_or_create(request.job_id, context)
        value = rt.job.kv.add(request.key, request.amount)
        rt.notify_key(request.key)
        return pb.AddKeyResponse(value=value)

    @translate_errors
    async def CompareSetKey(self, request: Any, context: Context) -> Any:
        rt = await self._find_or_create(request.job_id, context)
        swapped, value = rt.job.kv.compare_set(
            request.key,
            expect_absent=request.expect_absent,
            expected=request.expected,
            desired=request.desired,
        )
        if swapped:
            rt.notify_key(request.key)
        return pb.CompareSetKeyResponse(swapped=swapped, value=value)

    @translate_errors
    async def DeleteKey(self, request: Any, context: Context) -> Any:
        rt = await self._find_or_create(request.job_id, context)
        return pb.DeleteKeyResponse(deleted=rt.job.kv.delete(request.key))

    # ------------------------------------------------------------------------ liveness, failures

    @translate_errors
    async def Watch(self, request_iterator: Any, context: Context) -> None:
        await watch(self.hub, context)

    @translate_errors
    async def ReportFailure(self, request: Any, context: Context) -> Any:
        rt, member = self.hub.authenticate(request.job_id, request.rank, request.member_secret)
        await usable(rt, 0.0, context)
        kind = request.kind
        if kind == Events.EVENT_KIND_JOB_ABORTED:
            self.hub.abort(rt, member, request.reason)
        elif kind == Events.EVENT_KIND_COLLECTIVE_MISMATCH:
            try:
                details = json.loads(request.details_json or "{}")
            except json.JSONDecodeError as exc:
                raise ValueError(f"details_json is not valid JSON: {exc}") from None
            if not isinstance(details, dict):
                raise ValueError("details_json must be a JSON object mapping ranks to signatures")
            self.hub.mismatch(rt, member, request.reason, details)
        elif kind == Events.EVENT_KIND_MEMBER_FAILED:
            self.hub.fail(rt, [member.rank], request.reason or "reported a local error")
        else:
            raise ValueError(f"cannot report event kind {Events.Name(kind) if kind in Events.values() else kind}")
        return pb.ReportFailureResponse()

    @translate_errors
    async def Leave(self, request: Any, context: Context) -> Any:
        rt, member = self.hub.authenticate(request.job_id, request.rank, request.member_secret)
        await usable(rt, 0.0, context)
        rt.job.heartbeat(member, progress_tuples(request.progress))  # its final progress
        cause = sorted({r for r in request.cause_ranks if 0 <= r < len(rt.job.members) and r != member.rank})
        reason = request.cause_reason[:MAX_CAUSE_REASON_CHARS]
        self.hub.leave(rt, member, cause, reason, unreachable=request.cause_unreachable)
        return pb.LeaveResponse()

    # --------------------------------------------------------------------- progress and groups

    @translate_errors
    async def GetProgress(self, request: Any, context: Context) -> Any:
        rt = await self._find(request.job_id, context)
        group = request.group or "world"
        heard: set[int] = set()
        if request.fresh_within_s > 0:  # first, progress as of now from those that look late
            late = [w.rank for w in rt.job.not_started(group, request.seq)]
            seconds = wait_seconds(min(request.fresh_within_s, MAX_FRESH_PROGRESS_S), context)
            heard = await rt.progress_requests.refresh(rt.streams, late, seconds)
        not_started = rt.job.not_started(group, request.seq)
        blocked = waiting_elsewhere(rt.job.members, group, not_started, heard)  # victims, not the cause
        named = [w for w in not_started if w.rank not in blocked]
        if blocked and not named:  # held up by a member inside the call: the one that cannot answer
            inside = unfinished(rt.job.members, rt.job.group_ranks(group), group, request.seq)
            seconds = wait_seconds(min(request.fresh_within_s, MAX_FRESH_PROGRESS_S), context)
            heard |= await rt.progress_requests.refresh(rt.streams, inside, seconds)
            named = silent(rt.job.members, inside, group, heard)
        return pb.GetProgressResponse(not_started=waiting_protos(named))

    @translate_errors
    async def NewGroup(self, request: Any, context: Context) -> Any:
        rt = self.hub.find(request.job_id)
        if not request.restore:  # a re-registered member restoring its group needs nobody else
            await usable(rt, 0.0, context)
        rt.job.new_group(request.name, list(request.ranks))
        return pb.NewGroupResponse()

    @translate_errors
    async def FindGroup(self, request: Any, context: Context) -> Any:
        ranks = (await self._find(request.job_id, context)).job.find_group(request.name)
        return pb.FindGroupResponse(found=ranks is not None, ranks=ranks or ())

    @translate_errors
    async def GetStatus(self, request: Any, context: Context) -> Any:
        jobs = [self.hub.find(request.job_id).job] if request.job_id else self.hub.registry.jobs()
        return pb.GetStatusResponse(jobs=[job_status(job) for job in jobs])

    @translate_errors
    async def Reregister(self, request: Any, context: Context) -> Any:
        rt, member = self.hub.reregister(reregistration(request), request.job_id)
        log.info("job %s rank %d (%s): re-registered (job %s)", rt.job.job_id, member.rank, member.host, rt.job.state)
        return pb.ReregisterResponse(recovering=rt.job.recovering)


# Methods that may answer with bytes serialized ahead of time.
_PRESERIALIZED = frozenset({"GetMembers", "Barrier", "Watch"})


def add_coordinator(server: grpc.aio.Server, servicer: CoordinatorServicer, *, token: str | None = None) -> None:
    """Registers ``servicer``; GetMembers, Barrier and Watch may answer with bytes serialized ahead of
    time (the member table once per change, the passed barrier once, a job event once for all streams).

    Every request is checked against the hub's limits as it is deserialized (size first, then each
    field; see :mod:`collsvc.server.request_limits`). With ``token``, every call must present it
    (:class:`~collsvc.server.interceptors.TokenCheckedHandlers`) before its body is parsed.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    limits = RequestLimits(servicer.hub.options.limits)
    for method in SERVICE.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        behavior = getattr(servicer, method.name)
        serialize = response_cls.SerializeToString
        if method.name in _PRESERIALIZED:
            serialize = _bytes_or_message
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                behavior, request_deserializer=stream_deserializer(request_cls, limits), response_serializer=serialize
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                behavior, request_deserializer=lenient_deserializer(request_cls, limits), response_serializer=serialize
            )
    generic = grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)
    server.add_generic_rpc_handlers((TokenCheckedHandlers(generic, token) if token else generic,))


def _bytes_or_message(reply: Any) -> bytes:
    return reply if isinstance(reply, bytes) else reply.SerializeToString()
