"""The pieces that keep a large rendezvous O(n): one-pass wake-ups, few-rank barrier checks, cached
timeout reports and the field-check shortcut (no network; the event loop is real)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from collsvc.options import CoordinatorOptions, Limits
from collsvc.proto.v1 import coordinator_pb2 as pb
from collsvc.server.request_limits import RequestLimits
from collsvc.server.services.broadcast import Broadcast
from collsvc.server.services.hub import Hub
from collsvc.server.services.join import rank_list
from collsvc.server.state.barriers import BarrierBook
from collsvc.server.state.jobs import Job

from .conftest import FakeClock, join


def test_set_wakes_every_waiter_with_one_timer_for_all() -> None:
    async def main() -> None:
        signal = Broadcast()
        waiters = [asyncio.ensure_future(signal.wait(60.0 + i)) for i in range(500)]
        await asyncio.sleep(0)  # let every waiter register
        assert len(signal) == 500
        loop = asyncio.get_running_loop()
        timers = [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
        assert len(timers) == 1  # the earliest deadline only, not one timer per waiter
        signal.set()
        assert await asyncio.gather(*waiters) == [True] * 500
        assert len(signal) == 0
        assert await signal.wait(0.0)  # after set, at once, even without time to wait

    asyncio.run(main())


def test_each_waiter_keeps_its_own_deadline() -> None:
    async def main() -> None:
        signal = Broadcast()
        late = asyncio.ensure_future(signal.wait(60.0))
        assert not await signal.wait(0.01)  # expires alone; the later waiter stays
        assert not late.done() and len(signal) == 1
        assert not await signal.wait(0.0)  # no time to wait: not set
        signal.set()
        assert await late

    asyncio.run(main())


def test_cancelled_waiters_are_cleared_out() -> None:
    async def main() -> None:
        signal = Broadcast()
        waiters = [asyncio.ensure_future(signal.wait(3600.0)) for _ in range(3000)]
        await asyncio.sleep(0)
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert len(signal) < 1500  # compacted, not held until the deadlines an hour away
        survivor = asyncio.ensure_future(signal.wait(3600.0))
        await asyncio.sleep(0)
        signal.set()
        assert await survivor

    asyncio.run(main())


def test_arrived_among_looks_only_at_the_ranks_asked_about() -> None:
    book = BarrierBook()
    assert not book.arrive("world", 1, 3, 4)
    assert not book.arrive("world", 1, 5, 4)
    assert book.arrivals("world", 1) == 2
    assert book.arrived_among("world", 1, [5, 7]) == [5]
    assert book.arrived_among("world", 2, [5]) == []
    assert not book.arrive("world", 1, 0, 4)
    assert book.arrive("world", 1, 1, 4)
    assert book.arrivals("world", 1) == 0
    assert book.arrived_among("world", 1, [5, 7]) == [5, 7]  # complete: everybody arrived


def test_timed_out_barrier_report_is_built_once_per_change_of_arrivals(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(), clock=clock)
    rt = hub.find_or_create("j")
    for i in range(4):
        join(rt.job, 4, host=f"h{i}", requested_rank=i)
    key = ("world", 1)
    rt.job.barrier_arrive("world", 1, 0)
    first = rt.barrier_waiting_on(key)
    assert [w.rank for w in first] == [1, 2, 3]
    assert rt.barrier_waiting_on(key) is first  # every waiter that times out shares it
    rt.job.barrier_arrive("world", 1, 2)
    assert [w.rank for w in rt.barrier_waiting_on(key)] == [1, 3]
    rt.job.barrier_arrive("world", 1, 1)
    assert rt.job.barrier_arrive("world", 1, 3)
    rt.complete_barrier(key)
    assert rt.barrier_waiting_on(key) == []


def test_small_messages_skip_the_field_checks_that_cannot_fail() -> None:
    limits = RequestLimits(Limits(max_name_bytes=16))
    assert not limits.may_exceed(16)  # no 16-byte message holds a field over 16 bytes
    assert limits.may_exceed(17)
    defaults = RequestLimits(Limits())
    barrier = pb.BarrierRequest(job_id="job", group="world", rank=65535, generation=1, member_secret="s" * 32)
    assert not defaults.may_exceed(barrier.ByteSize())


def test_ranks_that_never_joined_are_found_once_per_admission(make_job: Callable[..., Job]) -> None:
    job = make_job()
    first = join(job, 6, requested_rank=0)
    join(job, 6, requested_rank=3)
    missing = job.not_joined()
    assert missing == [1, 2, 4, 5]
    assert job.not_joined() is missing  # the next waiter that times out gets the same answer
    assert job.cancel_join(first)  # it joined and gave up: not "never joined", and no rescan
    assert job.not_joined() is missing
    join(job, 6, requested_rank=4)
    assert job.not_joined() == [0, 1, 2, 5]


def test_long_rank_lists_in_errors_are_cut_and_counted() -> None:
    assert rank_list([1]) == "[1]"
    assert rank_list(list(range(64))) == str(list(range(64)))
    text = rank_list(list(range(10_000)))
    assert text.startswith("[0, 1, 2,") and text.endswith(", 63, ...] (10000 ranks)")
    assert len(text) < 400
