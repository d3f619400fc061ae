"""Members' progress as of now, asked for when a collective times out.

Members report which calls they started with their heartbeats, once a period. A rank that times out
asks the coordinator who never started the call; a member that started it since its last heartbeat
would be named although it is there. So the coordinator first asks the members that look late for
their progress now: an unnumbered PROGRESS_WANTED event on each one's Watch stream, which the member
answers with a heartbeat carrying the event's ``request_id`` (its progress read after the event came).
The coordinator waits for every answer, a bounded time; a member that cannot answer (stopped, gone)
keeps its last reported progress.

When many ranks time out on the same call (every rank but a stuck one, in a large job), their requests
share the questions: a member with a question on its way and unanswered is not asked again; each
request waits for the answer to that question. A question is asked anew once the request that asked
it has ended unanswered, so a lost question cannot make later requests wait in vain.

Members that look late but are not to blame are then left out (:func:`waiting_elsewhere`): a member
that answered (or left the job cleanly) while inside an earlier collective of the group, not yet
finished, is waiting there for others: it arrived at every call it could. Over the gRPC ring the
members of a stuck call can be one call apart (a ring lets a member finish call k while a neighbour
still waits in it); the one that timed out first in call k and left was named as missing by those
waiting in call k + 1, next to the stopped rank that held them all up. A member that never answered
(stopped, dead) is judged by its last report, and one that finished its last call and did not start
this one is late.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from collsvc.proto.v1 import coordinator_pb2
from collsvc.server.services.broadcast import Broadcast
from collsvc.server.state.common import Member, MemberState, WaitingInfo


class EventQueue(Protocol):
    """A member's Watch stream, as far as asking it goes."""

    queue: asyncio.Queue[Any]


@dataclass(eq=False)
class _Request:
    request_id: int
    # rank -> the id of the question it waits for: its own, or an open one asked by an earlier request
    pending: dict[int, int]
    answered: Broadcast = field(default_factory=Broadcast)
    heard: set[int] = field(default_factory=set)  # ranks that answered (not those whose stream ended)


class ProgressRequests:
    """The progress requests of one job that wait for answers. Used from the coordinator's event loop."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._open: list[_Request] = []
        self._asked: dict[int, int] = {}  # rank -> the id of the question on its way to it, unanswered

    async def refresh(self, streams: Mapping[int, EventQueue], ranks: Iterable[int], seconds: float) -> set[int]:
        """Asks members ``ranks`` (those with a Watch stream in ``streams``) for their progress now, unless
        a question is already on its way to one, and waits up to ``seconds`` for every answer (or the
        end of its stream); returns the ranks that answered (their progress is then recorded, by the
        heartbeat that answered)."""
        request = _Request(next(self._ids), {})
        for rank in ranks:
            stream = streams.get(rank)
            if stream is None:
                continue
            asked = self._asked.get(rank)
            if asked is None:
                asked = self._asked[rank] = request.request_id
                event = coordinator_pb2.WatchEvent(
                    kind=coordinator_pb2.EVENT_KIND_PROGRESS_WANTED, ranks=[rank], request_id=asked
                )
                stream.queue.put_nowait(event)
            request.pending[rank] = asked
        if not request.pending:
            return request.heard
        self._open.append(request)
        try:
            await request.answered.wait(seconds)
            return request.heard
        finally:
            self._open.remove(request)
            for rank, asked in request.pending.items():  # unanswered questions it asked: ask anew later
                if asked == request.request_id and self._asked.get(rank) == asked:
                    del self._asked[rank]

    def answered(self, rank: int, request_id: int) -> None:
        """Member ``rank`` sent a heartbeat answering question ``request_id`` (and so every earlier one)."""
        asked = self._asked.get(rank)
        if asked is not None and asked <= request_id:
            del self._asked[rank]
        for request in list(self._open):
            waits_for = request.pending.get(rank)
            if waits_for is not None and waits_for <= request_id:
                request.heard.add(rank)
                self._settle(request, rank)

    def gone(self, rank: int) -> None:
        """Member ``rank``'s Watch stream ended: it answers nothing any more."""
        self._asked.pop(rank, None)
        for request in list(self._open):
            if rank in request.pending:
                self._settle(request, rank)

    @staticmethod
    def _settle(request: _Request, rank: int) -> None:
        del request.pending[rank]
        if not request.pending:
            request.answered.set()


def waiting_elsewhere(members: Sequence[Member], group: str, late: Iterable[WaitingInfo], heard: set[int]) -> set[int]:
    """The ranks among ``late`` (members that have not started a call of ``group``) that are waiting for
    others in an earlier call of the group: they started one and did not finish it, as they said just
    now (``heard``: they answered a progress request) or as they left the job cleanly."""
    out = set()
    for waiting in late:
        member = members[waiting.rank]
        record = member.progress.get(group)
        if record is None or record.started_seq <= record.finished_seq:
            continue  # between calls: late
        if waiting.rank in heard or member.state == MemberState.LEFT:
            out.add(waiting.rank)
    return out


def unfinished(members: Sequence[Member], ranks: Iterable[int], group: str, seq: int) -> list[int]:
    """The members among ``ranks`` that have not finished call ``seq`` of ``group`` and are still in
    the job."""
    out = []
    for rank in ranks:
        member = members[rank]
        record = member.progress.get(group)
        if not member.gone and (record is None or record.finished_seq < seq):
            out.append(rank)
    return out


def silent(members: Sequence[Member], ranks: Iterable[int], group: str, heard: set[int]) -> list[WaitingInfo]:
    """``ranks`` that did not answer (``heard``), as waiting entries: when every member that has not
    started a call is waiting in an earlier one, the call is held up by a member inside it that cannot
    answer (stopped, or stuck in native code)."""
    out = []
    for rank in ranks:
        if rank in heard:
            continue
        member = members[rank]
        record = member.progress.get(group)
        out.append(
            WaitingInfo(rank, member.host, record.last_op if record else "", record.finished_seq if record else 0)
        )
    return out
