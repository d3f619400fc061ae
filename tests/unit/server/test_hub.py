"""The hub's failure paths with a fake clock: who is told what (no network)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from collsvc.options import CoordinatorOptions
from collsvc.proto.v1 import coordinator_pb2
from collsvc.server.services.heartbeat_pace import (
    MAX_HEARTBEATS_PER_SECOND,
    HeartbeatPace,
    least_interval,
    pace_for,
)
from collsvc.server.services.hub import Hub
from collsvc.server.state.common import Device, MemberState
from collsvc.server.state.roster import JoinRequest

from .conftest import FakeClock, drain

Events = coordinator_pb2.EventKind


def _job(hub: Hub, n: int) -> tuple[Any, list[Any]]:
    rt = hub.find_or_create("j")
    for i in range(n):
        rt.job.join(
            JoinRequest(
                world_size=n,
                requested_rank=i,
                host=f"h{i}",
                peer_address="",
                device=Device(),
                pid=i,
                local_rank_hint=None,
            )
        )
    return rt, rt.job.members


def test_missed_heartbeats_fail_the_member_and_tell_the_others(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(heartbeat_timeout=5.0), clock=clock)
    rt, members = _job(hub, 3)
    streams = [hub.open_stream(rt, m) for m in members]
    assert [e.kind for e in drain(streams[0])] == [Events.EVENT_KIND_WATCHING]
    drain(streams[1]), drain(streams[2])
    clock.advance(3.0)
    rt.job.heartbeat(members[0])
    rt.job.heartbeat(members[1])
    clock.advance(2.5)
    hub.check_heartbeats()
    assert members[2].state == MemberState.FAILED
    for stream in streams[:2]:
        (event,) = drain(stream)
        assert event.kind == Events.EVENT_KIND_MEMBER_FAILED
        assert list(event.ranks) == [2] and list(event.hosts) == ["h2"]
    assert drain(streams[2]) == []


def test_late_stream_replays_past_failures(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(), clock=clock)
    rt, members = _job(hub, 3)
    hub.fail(rt, [1], "crashed")
    hub.abort(rt, members[0], "user abort")
    events = drain(hub.open_stream(rt, members[2]))
    # In the order they happened, numbered from 1 (WATCHING belongs to the stream: 0).
    assert [(e.kind, e.seq) for e in events] == [
        (Events.EVENT_KIND_WATCHING, 0),
        (Events.EVENT_KIND_MEMBER_FAILED, 1),
        (Events.EVENT_KIND_JOB_ABORTED, 2),
    ]


def test_a_reconnecting_stream_gets_only_the_events_it_missed(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(), clock=clock)
    rt, members = _job(hub, 4)
    first = hub.open_stream(rt, members[0])
    hub.leave(rt, members[3])
    seen = [e.seq for e in drain(first)]
    assert seen == [0, 1]
    hub.fail(rt, [2], "crashed")  # while rank 0 is reconnecting: it must get this one, and only it
    events = drain(hub.open_stream(rt, members[0], last_event_seq=1))
    assert [(e.kind, e.seq) for e in events] == [(Events.EVENT_KIND_WATCHING, 0), (Events.EVENT_KIND_MEMBER_FAILED, 2)]
    # The member that left is not told of its own leave when it reconnects.
    assert [e.kind for e in drain(hub.open_stream(rt, members[3]))] == [
        Events.EVENT_KIND_WATCHING,
        Events.EVENT_KIND_MEMBER_FAILED,
    ]


def test_broken_stream_without_leave_is_a_failure_but_after_leave_is_not(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(), clock=clock)
    rt, members = _job(hub, 3)
    streams = [hub.open_stream(rt, m) for m in members]
    for s in streams:
        drain(s)
    hub.leave(rt, members[1])
    hub.close_stream(rt, members[1], streams[1])
    assert members[1].state == MemberState.LEFT
    assert [e.kind for e in drain(streams[0])] == [Events.EVENT_KIND_MEMBER_LEFT]
    hub.close_stream(rt, members[2], streams[2])
    assert members[2].state == MemberState.FAILED
    assert [e.kind for e in drain(streams[0])] == [Events.EVENT_KIND_MEMBER_FAILED]


def test_streams_a_draining_coordinator_ends_fail_no_one(clock: FakeClock) -> None:
    """Stopping, the coordinator cancels its Watch streams one by one; the members re-register with the
    coordinator that comes back, so none of them is reported failed to the others (whose streams are
    still open) and no heartbeat check runs meanwhile."""
    hub = Hub(CoordinatorOptions(heartbeat_timeout=5.0), clock=clock)
    rt, members = _job(hub, 3)
    streams = [hub.open_stream(rt, m) for m in members]
    for s in streams:
        drain(s)
    hub.drain()
    hub.close_stream(rt, members[1], streams[1])
    clock.advance(60.0)
    hub.tick()
    assert [m.state for m in members] == [MemberState.ALIVE] * 3
    assert drain(streams[0]) == [] and drain(streams[2]) == []


def test_job_is_dropped_when_everyone_is_gone(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(), clock=clock)
    rt, members = _job(hub, 2)
    hub.leave(rt, members[0])
    assert hub.registry.find("j") is rt.job
    hub.fail(rt, [1], "crashed")
    assert hub.registry.find("j") is None


def test_mismatch_reports_are_merged_and_fanned_out(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(), clock=clock)
    rt, members = _job(hub, 2)
    streams = [hub.open_stream(rt, m) for m in members]
    for s in streams:
        drain(s)
    hub.mismatch(rt, members[0], "ops differ", {"0": {"op": "all_reduce"}})
    hub.mismatch(rt, members[1], "ops differ", {"1": {"op": "broadcast"}})
    last = drain(streams[0])[-1]
    assert last.kind == Events.EVENT_KIND_COLLECTIVE_MISMATCH
    assert json.loads(last.details_json) == {"0": {"op": "all_reduce"}, "1": {"op": "broadcast"}}
    assert list(last.ranks) == [0, 1]


def test_key_waits_are_woken_by_a_write_and_forgotten_after_a_timeout(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(), clock=clock)
    rt = hub.find_or_create("j")

    async def main() -> None:
        assert not await rt.wait_for_key("never", 0.01)
        assert rt.key_events == {}
        waiter = asyncio.ensure_future(rt.wait_for_key("k", 10.0))
        await asyncio.sleep(0)  # let the waiter register
        rt.job.kv.set("k", b"v")
        rt.notify_key("k")
        assert await asyncio.wait_for(waiter, 5.0)
        assert rt.key_events == {}

    asyncio.run(main())


def test_departures_that_follow_one_another_are_told_together_and_before_later_events(clock: FakeClock) -> None:
    async def main() -> None:
        hub = Hub(CoordinatorOptions(), clock=clock)
        rt, members = _job(hub, 6)
        streams = [hub.open_stream(rt, m) for m in members]
        for s in streams:
            drain(s)
        hub.leave(rt, members[1])  # nothing told within the spacing: told at once
        assert [list(e.ranks) for e in drain(streams[0])] == [[1]]
        hub.leave(rt, members[2])
        hub.leave(rt, members[3])
        assert drain(streams[0]) == []  # waiting for the next batch
        hub.fail(rt, [4], "crashed")  # a later event: the departures before it go first, together
        events = drain(streams[0])
        assert [(e.kind, list(e.ranks)) for e in events] == [
            (Events.EVENT_KIND_MEMBER_LEFT, [2, 3]),
            (Events.EVENT_KIND_MEMBER_FAILED, [4]),
        ]
        assert json.loads(events[0].details_json)["finished"].keys() == {"2", "3"}
        # Members that left hear no more departures; the one that failed is told it was failed.
        assert [e.kind for e in drain(streams[1])] == [Events.EVENT_KIND_MEMBER_FAILED]
        clock.advance(1.0)  # past the spacing: the next departure is told at once again
        hub.leave(rt, members[5])
        assert [list(e.ranks) for e in drain(streams[0])] == [[5]]
        assert drain(streams[1]) == []

    asyncio.run(main())


def test_a_large_job_heartbeats_less_often_and_waits_longer_in_proportion(clock: FakeClock) -> None:
    options = CoordinatorOptions(heartbeat_interval=1.0, heartbeat_timeout=5.0)
    assert pace_for(options, 8) == HeartbeatPace(1.0, 5.0)
    assert pace_for(options, int(MAX_HEARTBEATS_PER_SECOND)) == HeartbeatPace(1.0, 5.0)
    big = int(2 * MAX_HEARTBEATS_PER_SECOND)
    assert pace_for(options, big) == HeartbeatPace(2.0, 10.0)
    hub = Hub(options, clock=clock)
    rt, members = _job(hub, big)
    assert least_interval(options, big) == 2.0 and least_interval(options, 8) == 0.0  # 0: the member's own pace
    clock.advance(6.0)  # past the configured timeout, within this job's
    hub.check_heartbeats()
    assert all(m.state == MemberState.ALIVE for m in members)
    rt.job.heartbeat(members[0])
    clock.advance(4.5)
    hub.check_heartbeats()  # all but one silent at once: taken for a stall of the coordinator, once
    assert all(m.state == MemberState.ALIVE for m in members)
    rt.job.heartbeat(members[0])
    clock.advance(10.5)
    hub.check_heartbeats()
    assert members[0].state == MemberState.ALIVE
    assert all(m.state == MemberState.FAILED for m in members[1:])


def test_a_late_monitor_round_restarts_every_clock_instead_of_judging(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(heartbeat_interval=1.0, heartbeat_timeout=5.0), clock=clock)
    rt, members = _job(hub, 3)
    streams = [hub.open_stream(rt, m) for m in members]
    hub.tick()
    clock.advance(8.0)  # the coordinator was stopped: no round ran, no heartbeat was read
    hub.tick()
    assert all(m.state == MemberState.ALIVE for m in members) and hub.stall_watch.stalls == 1
    # On-time rounds: rank 2 is really silent. Its clock restarted the stall's length later (at most a
    # timeout: 5 s), time for a member whose stream broke during the stall to reconnect; it is named
    # a timeout after that, not before.
    for round_ in range(21):
        for member in members[:2]:  # their heartbeats are taken in
            rt.job.heartbeat(member)
        clock.advance(0.5)
        hub.tick()
        if round_ == 18:
            assert members[2].state == MemberState.ALIVE
    assert [m.state for m in members] == [MemberState.ALIVE, MemberState.ALIVE, MemberState.FAILED]
    (event,) = [e for e in drain(streams[0]) if e.kind == Events.EVENT_KIND_MEMBER_FAILED]
    assert list(event.ranks) == [2]


def test_a_stall_before_the_first_monitor_round_is_a_stall_too(clock: FakeClock) -> None:
    # The members joined and the coordinator was stopped before its monitor ever ran: its first round
    # comes late all the same, and judges nobody.
    hub = Hub(CoordinatorOptions(heartbeat_interval=1.0, heartbeat_timeout=5.0), clock=clock)
    rt, members = _job(hub, 3)
    clock.advance(10.0)
    rt.job.heartbeat(members[0])  # one member's heartbeat is taken in before the round runs
    hub.tick()
    assert all(m.state == MemberState.ALIVE for m in members) and hub.stall_watch.stalls == 1


def test_many_members_silent_at_once_are_given_one_more_timeout(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(heartbeat_timeout=5.0), clock=clock)
    rt, members = _job(hub, 4)
    clock.advance(5.5)
    hub.check_heartbeats()
    assert all(m.state == MemberState.ALIVE for m in members)
    for member in members[:3]:
        rt.job.heartbeat(member)
    clock.advance(5.5)
    hub.check_heartbeats()  # the three came back; rank 3 stayed silent through a second timeout
    assert [m.state for m in members][:3] == [MemberState.ALIVE] * 3
    assert members[3].state == MemberState.FAILED


def test_a_stream_closed_during_a_stall_gets_time_to_reconnect(clock: FakeClock) -> None:
    hub = Hub(CoordinatorOptions(heartbeat_interval=1.0, heartbeat_timeout=5.0), clock=clock)
    rt, members = _job(hub, 2)
    streams = [hub.open_stream(rt, m) for m in members]
    hub.tick()
    clock.advance(8.0)  # stopped; rank 1's side gave up on the stream meanwhile
    hub.close_stream(rt, members[1], streams[1])
    assert members[1].state == MemberState.ALIVE
    hub.tick()
    clock.advance(0.5)
    hub.close_stream(rt, members[0], streams[0])  # outside a stall: a closed stream is a failure
    assert members[0].state == MemberState.FAILED


def test_a_leave_after_an_unreachable_peer_says_which_of_them_the_coordinator_heard_from(clock: FakeClock) -> None:
    """Rank 0 could deliver to neither rank 1 (heartbeating: a cut link), rank 2 (silent for three
    intervals: stopped or dead) nor rank 3 (left cleanly, so it was running): the others are told 1 and
    3 ran. A leave that blames lateness (not a failed delivery) vouches for no one."""
    hub = Hub(CoordinatorOptions(heartbeat_interval=1.0, heartbeat_timeout=5.0), clock=clock)
    rt, members = _job(hub, 5)
    streams = [hub.open_stream(rt, m) for m in members]
    for stream in streams:
        drain(stream)
    clock.advance(3.0)
    rt.job.heartbeat(members[1])
    hub.leave(rt, members[3])
    hub.leave(rt, members[0], [1, 2, 3], "sending to rank 1 failed", unreachable=True)
    (event,) = [e for e in drain(streams[4]) if e.kind == Events.EVENT_KIND_MEMBER_LEFT and list(e.ranks) == [0]]
    details = json.loads(event.details_json)
    assert details["cause"] == [1, 2, 3] and details["running"] == {"1": "h1", "3": "h3"} and details["unreachable"]
    hub.leave(rt, members[4], [1], "all_reduce timed out waiting on rank 1")
    (late,) = [e for e in drain(streams[1]) if list(e.ranks) == [4]]
    assert not {"running", "unreachable"} & set(json.loads(late.details_json))
