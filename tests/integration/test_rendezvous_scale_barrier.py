"""Hundreds of ranks on one real coordinator: one wake-up for all of them, and the same answers as
for a few (timeouts name who is missing, a member that leaves fails the others' barrier)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from collsvc.errors import RankFailedError, error_from_rpc
from collsvc.proto.v1 import coordinator_pb2 as pb
from collsvc.proto.v1 import coordinator_pb2_grpc

from .conftest import TOKEN

RANKS = 300
CALL_TIMEOUT = 60.0


class Ranks:
    """``RANKS`` simulated members sharing a few grpc.aio channels."""

    def __init__(self, address: str) -> None:
        self.channels = [grpc.aio.insecure_channel(address) for _ in range(4)]
        self.stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in self.channels]
        self.metadata = (("authorization", f"Bearer {TOKEN}"),)
        self.replies: list[Any] = []

    async def call(self, index: int, method: str, request: Any, timeout: float = CALL_TIMEOUT) -> Any:
        stub = self.stubs[index % len(self.stubs)]
        try:
            return await getattr(stub, method)(request, metadata=self.metadata, timeout=timeout)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, method) from exc

    async def join_all(self, job_id: str) -> None:
        requests = [
            pb.JoinRequest(job_id=job_id, world_size=RANKS, host=f"h{i % 16}", pid=i, timeout_s=CALL_TIMEOUT)
            for i in range(RANKS)
        ]
        self.replies = await asyncio.gather(*(self.call(i, "Join", r) for i, r in enumerate(requests)))

    def barrier(self, job_id: str, index: int, generation: int, timeout_s: float = CALL_TIMEOUT) -> Any:
        reply = self.replies[index]
        request = pb.BarrierRequest(
            job_id=job_id,
            rank=reply.rank,
            member_secret=reply.member_secret,
            generation=generation,
            timeout_s=timeout_s,
        )
        return self.call(index, "Barrier", request, timeout_s + 10)

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close(None)


@pytest.fixture
def address(start_coordinator: Callable[..., tuple[Any, Any]]) -> str:
    thread, _ = start_coordinator(heartbeat_timeout=600.0)  # nobody heartbeats here
    return str(thread.address)


def test_hundreds_of_ranks_join_and_pass_back_to_back_barriers(address: str) -> None:
    async def main() -> None:
        ranks = Ranks(address)
        try:
            await ranks.join_all("big")
            assert sorted(r.rank for r in ranks.replies) == list(range(RANKS))
            assert len({r.member_secret for r in ranks.replies}) == RANKS
            for generation in (1, 2):
                replies = await asyncio.gather(*(ranks.barrier("big", i, generation) for i in range(RANKS)))
                assert all(reply.complete and not reply.waiting_on for reply in replies)
        finally:
            await ranks.close()

    asyncio.run(main())


def test_every_waiter_of_a_timed_out_barrier_names_the_one_missing_rank(address: str) -> None:
    async def main() -> None:
        ranks = Ranks(address)
        try:
            await ranks.join_all("late")
            absent = RANKS // 2
            replies = await asyncio.gather(
                *(ranks.barrier("late", i, 1, timeout_s=0.5) for i in range(RANKS) if i != absent)
            )
            missing = ranks.replies[absent].rank
            assert all(not reply.complete for reply in replies)
            assert {tuple(w.rank for w in reply.waiting_on) for reply in replies} == {(missing,)}
        finally:
            await ranks.close()

    asyncio.run(main())


def test_a_member_leaving_fails_the_barrier_of_every_waiter(address: str) -> None:
    async def main() -> None:
        ranks = Ranks(address)
        try:
            await ranks.join_all("leave")
            leaver = ranks.replies[0]
            waiting = [asyncio.ensure_future(ranks.barrier("leave", i, 1)) for i in range(1, RANKS)]
            # Most arrivals are waiting when the Leave lands (they are woken by it); one that lands
            # later is refused on arrival with the same error.
            status = await ranks.call(0, "GetStatus", pb.GetStatusRequest(job_id="leave"))
            assert status.jobs[0].state == "running"
            await ranks.call(
                0, "Leave", pb.LeaveRequest(job_id="leave", rank=leaver.rank, member_secret=leaver.member_secret)
            )
            outcomes = await asyncio.gather(*waiting, return_exceptions=True)
            assert all(isinstance(o, RankFailedError) for o in outcomes), {type(o).__name__ for o in outcomes}
            assert all(o.ranks == [leaver.rank] for o in outcomes if isinstance(o, RankFailedError))
        finally:
            await ranks.close()

    asyncio.run(main())
