"""Members' progress as of now, asked for when a collective times out.

Members report which calls they started with their heartbeats, once a period. A rank that times out
asks the coordinator who never started the call; a member that started it since its last heartbeat
would be named although it is there. So the coordinator first asks the members that look late for
their progress now: an unnumbered PROGRESS_WANTED event on each one's Watch stream, which the member
answers with a heartbeat carrying the event's ``request_id`` (its progress read after the event came).
The coordinator waits for every answer, a bounded time; a member that cannot answer (stopped, gone)
keeps its last reported progress.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from collsvc.proto.v1 import coordinator_pb2
from collsvc.server.services.broadcast import Broadcast


class EventQueue(Protocol):
    """A member's Watch stream, as far as asking it goes."""

    queue: asyncio.Queue[Any]


@dataclass(eq=False)
class _Request:
    request_id: int
    pending: set[int]
    answered: Broadcast = field(default_factory=Broadcast)


class ProgressRequests:
    """The progress requests of one job that wait for answers. Used from the coordinator's event loop."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._open: list[_Request] = []

    async def refresh(self, streams: Mapping[int, EventQueue], ranks: Iterable[int], seconds: float) -> bool:
        """Asks members ``ranks`` (those with a Watch stream in ``streams``) for their progress now and
        waits up to ``seconds`` for every answer; returns whether each answered (its progress is then
        recorded, by the heartbeat that answered) or its stream ended first."""
        request = _Request(next(self._ids), set())
        for rank in ranks:
            stream = streams.get(rank)
            if stream is not None:
                event = coordinator_pb2.WatchEvent(
                    kind=coordinator_pb2.EVENT_KIND_PROGRESS_WANTED, ranks=[rank], request_id=request.request_id
                )
                stream.queue.put_nowait(event)
                request.pending.add(rank)
        if not request.pending:
            return True
        self._open.append(request)
        try:
            return await request.answered.wait(seconds)
        finally:
            self._open.remove(request)

    def answered(self, rank: int, request_id: int) -> None:
        """Member ``rank`` sent a heartbeat answering request ``request_id`` (and so every earlier one)."""
        for request in self._open:
            if request.request_id <= request_id:
                self._settle(request, rank)

    def gone(self, rank: int) -> None:
        """Member ``rank``'s Watch stream ended: it answers nothing any more."""
        for request in self._open:
            self._settle(request, rank)

    @staticmethod
    def _settle(request: _Request, rank: int) -> None:
        request.pending.discard(rank)
        if not request.pending:
            request.answered.set()
