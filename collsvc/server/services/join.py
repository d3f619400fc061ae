"""Join and JoinBatch: admit members to a job, wait once until it is full, answer each of them.

A host's launcher may join all of its ranks in one JoinBatch call instead of one Join per rank: each
member is admitted exactly as its own Join would be (same checks, same idempotency key), so the two
calls mix freely within one job. At scale this is what the coordinator's cost hangs on: gRPC's own
cost per call is most of a Join, so N ranks on N/k hosts cost about N/k calls instead of N.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from collsvc.errors import RendezvousError
from collsvc.server.interceptors import Context
from collsvc.server.services.convert import join_request
from collsvc.server.services.heartbeat_pace import least_interval
from collsvc.server.services.hub import Hub, wait_seconds
from collsvc.server.state.common import Member

# Ranks named in one error message at most (the rest are counted).
MAX_RANKS_NAMED = 64


def rank_list(ranks: list[int], limit: int = MAX_RANKS_NAMED) -> str:
    """``ranks`` as ``[1, 5]``, or its first ``limit`` entries and how many there are in all: an error
    travels in the call's trailing metadata, which gRPC caps at a few KiB."""
    if len(ranks) <= limit:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:limit]))}, ...] ({len(ranks)} ranks)"


def client_address(peer: str) -> str:
    """The client's address without its port, from ``context.peer()``: ``"ipv4:10.0.0.5:41234"`` ->
    ``"10.0.0.5"``, ``"ipv6:[::1]:41234"`` -> ``"::1"`` (an IPv4-mapped one as IPv4); others as given."""
    scheme, _, rest = peer.partition(":")
    if scheme == "ipv4":
        return rest.rpartition(":")[0] or rest
    if scheme == "ipv6" and rest.startswith("["):
        host = rest[1 : rest.find("]")]
        return host.removeprefix("::ffff:") if "." in host else host
    return peer


def _check_batch(requests: Sequence[Any]) -> None:
    """Raises ValueError for an empty batch or one that names several jobs."""
    if not requests:
        raise ValueError("JoinBatch carries no members")
    jobs = {request.job_id for request in requests}
    if len(jobs) > 1:
        raise ValueError(f"JoinBatch members name {len(jobs)} jobs ({sorted(jobs)[:4]}); one batch joins one job")


async def join_members(hub: Hub, requests: Sequence[Any], context: Context) -> list[Any]:
    """Admits every request's member, waits until the job is full, and returns their JoinResponses.

    The members are counted against the client's join quota while they wait. When the wait ends
    without the job being full (timeout, or the caller went away) every member of this call is
    withdrawn; when one member is refused, those admitted before it in the same call are withdrawn.

    Raises:
        ValueError: an empty batch, or one naming several jobs.
        ResourceLimitError: the client's join quota (see :class:`~collsvc.server.state.joins.JoinQuota`).
        RendezvousError: the job was not full within the longest timeout of the members.
        the errors of :meth:`~collsvc.server.state.jobs.Job.join` for a refused member.
    """
    _check_batch(requests)
    job_id = requests[0].job_id
    client = client_address(context.peer())
    hub.join_quota.admit(client, job_id, len(requests))
    try:
        return await _join(hub, requests, context)
    finally:
        hub.join_quota.release(client, job_id, len(requests))


async def _join(hub: Hub, requests: Sequence[Any], context: Context) -> list[Any]:
    rt = hub.find_or_create(requests[0].job_id)
    job = rt.job
    members: list[Member] = []

    def withdraw() -> None:
        for member in members:
            job.cancel_join(member)
        hub.drop_if_finished(rt)  # a job this very call created, or that only its members held, goes

    try:
        for request in requests:
            members.append(job.join(join_request(request)))
    except Exception:
        withdraw()
        raise
    if job.complete and not rt.joined.is_set():
        rt.on_complete()
    wait = wait_seconds(max(request.timeout_s for request in requests), context)
    try:
        completed = await rt.joined.wait(wait)
    except BaseException:  # the caller went away: its places are free again
        withdraw()
        raise
    if not completed:
        joined, missing = job.joined, job.not_joined()
        withdraw()
        raise RendezvousError(
            f"job {job.job_id!r}: only {joined} of {requests[0].world_size} members joined within {wait:.3g}s"
            + (f"; ranks that never joined: {rank_list(missing)}" if missing else "")
        )
    interval = least_interval(hub.options, len(job.members))
    return [rt.join_reply(member, interval) for member in members]
