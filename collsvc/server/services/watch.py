"""The Watch stream: heartbeats with progress in, job events out."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from collsvc.observability.stats import keep_latest
from collsvc.server.interceptors import Context
from collsvc.server.services.convert import progress_tuples
from collsvc.server.services.hub import Hub, JobRuntime, Stream
from collsvc.server.state.common import Member

log = logging.getLogger(__name__)
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs


async def _read_heartbeats(rt: JobRuntime, member: Member, stream: Stream, context: Context) -> None:
    """Records every heartbeat (and what it answers); when the client's side ends (or breaks), ends the
    stream."""
    job = rt.job
    try:
        while True:
            request = await context.read()
            if request is _EOF:
                break
            job.heartbeat(member, progress_tuples(request.progress))
            if request.answers:
                rt.progress_requests.answered(member.rank, request.answers)
            if request.stats:
                keep_latest(member.stats, request.stats)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the call broke; the reason is not ours to report
        log.debug("job %s rank %d: heartbeat stream read ended: %r", job.job_id, member.rank, exc)
    stream.queue.put_nowait(None)


async def watch(hub: Hub, context: Context) -> None:
    """Serves one Watch call.

    The first request names the member (job, rank, secret); the reply starts with
    EVENT_KIND_WATCHING and any failure that happened before the stream opened. When the stream ends
    while the member has neither left nor been replaced by a newer stream, the member has failed.

    Raises:
        AuthenticationError: unknown job or rank, or wrong secret.
    """
    first = await context.read()
    if first is _EOF:
        return
    rt, member = hub.authenticate(first.job_id, first.rank, first.member_secret)
    job = rt.job
    job.heartbeat(member, progress_tuples(first.progress))
    stream = hub.open_stream(rt, member, first.last_event_seq)
    log.debug("job %s rank %d (%s): watching", job.job_id, member.rank, member.host)
    reader = asyncio.ensure_future(_read_heartbeats(rt, member, stream, context))
    try:
        while True:
            event = await stream.queue.get()
            if event is None:
                break
            await context.write(event)
    finally:
        reader.cancel()  # no await here: this may run while the call itself is being cancelled
        hub.close_stream(rt, member, stream)
