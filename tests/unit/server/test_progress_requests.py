"""The coordinator's questions to late members about their progress (server/services/progress_requests.py):
many requests about the same members share one question each."""

from __future__ import annotations

import asyncio
from typing import Any

from collsvc.server.services.progress_requests import ProgressRequests


class Stream:
    """A member's Watch stream as the requests see it: a queue of events."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def questions(self) -> list[int]:
        asked = []
        while not self.queue.empty():
            asked.append(self.queue.get_nowait().request_id)
        return asked


def test_requests_about_the_same_members_share_one_question_each() -> None:
    async def main() -> None:
        requests = ProgressRequests()
        streams = {1: Stream(), 2: Stream()}
        many = [asyncio.ensure_future(requests.refresh(streams, [1, 2], 5.0)) for _ in range(50)]
        await asyncio.sleep(0)  # every request asks (or finds a question on its way)
        first = streams[1].questions()
        assert len(first) == 1 and len(streams[2].questions()) == 1
        requests.answered(1, first[0])
        assert not any(f.done() for f in many)  # rank 2 has not answered yet
        requests.gone(2)
        assert all(heard == {1} for heard in await asyncio.gather(*many))  # rank 2's stream ended unanswered

    asyncio.run(main())


def test_a_question_left_unanswered_is_asked_again_by_a_later_request() -> None:
    async def main() -> None:
        requests = ProgressRequests()
        streams = {3: Stream()}
        assert await requests.refresh(streams, [3], 0.01) == set()  # the member never answered
        lost = streams[3].questions()
        later = asyncio.ensure_future(requests.refresh(streams, [3], 5.0))
        await asyncio.sleep(0)
        again = streams[3].questions()
        assert len(lost) == len(again) == 1 and again[0] > lost[0]
        requests.answered(3, lost[0])  # a late answer to the lost question: progress older than asked for
        await asyncio.sleep(0)
        assert not later.done()
        requests.answered(3, again[0])
        assert await later == {3}

    asyncio.run(main())


def test_a_member_without_a_stream_is_not_waited_for() -> None:
    async def main() -> None:
        requests = ProgressRequests()
        assert await requests.refresh({}, [0, 1], 5.0) == set()

    asyncio.run(main())
