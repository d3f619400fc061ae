"""A restarted coordinator rebuilds a running job from its members' re-registrations (fake clock)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from collsvc.errors import AuthenticationError, RankFailedError, RendezvousError
from collsvc.options import CoordinatorOptions, Limits
from collsvc.proto.v1 import coordinator_pb2
from collsvc.server.services.hub import Hub
from collsvc.server.state.barriers import BarrierBook
from collsvc.server.state.common import Device, MemberState
from collsvc.server.state.credentials import MemberSecrets, member_key
from collsvc.server.state.kvstore import KVStore
from collsvc.server.state.lifecycle import JobPhase
from collsvc.server.state.recovery import Reregistration
from collsvc.server.state.roster import JoinRequest

from .conftest import FakeClock, drain

Events = coordinator_pb2.EventKind
KEY = member_key("job-token")


def _hub(clock: FakeClock, secrets: MemberSecrets | None = None) -> Hub:
    return Hub(CoordinatorOptions(heartbeat_timeout=5.0), clock=clock, secrets=secrets or MemberSecrets(KEY))


def _running_job(hub: Hub, n: int) -> tuple[Any, list[Any]]:
    rt = hub.find_or_create("j")
    for i in range(n):
        rt.job.join(JoinRequest(n, i, f"h{i}", f"h{i}:1", Device(), 100 + i, None))
    return rt, rt.job.members


def _report(member: Any, incarnation: int, world_size: int, **kw: Any) -> Reregistration:
    fields: dict[str, Any] = dict(
        rank=member.rank,
        secret=member.secret,
        incarnation=incarnation,
        world_size=world_size,
        num_nodes=world_size,
        host=member.host,
        peer_address=member.peer_address,
        device=member.device,
        pid=member.pid,
        local_rank=0,
        local_size=1,
        node_rank=member.rank,
    )
    fields.update(kw)
    return Reregistration(**fields)


def test_members_rebuild_the_job_on_a_restarted_coordinator(clock: FakeClock) -> None:
    before = _hub(clock)
    rt, members = _running_job(before, 3)
    incarnation = rt.job.incarnation
    after = _hub(clock)  # the same token: the same member key
    rebuilt, member = after.reregister(_report(members[1], incarnation, 3), "j")
    job = rebuilt.job
    assert job.phase is JobPhase.RECOVERING and not rebuilt.usable.is_set()
    assert job.incarnation == incarnation and member.host == "h1" and member.rank == 1
    after.reregister(_report(members[0], incarnation, 3), "j")
    after.reregister(_report(members[0], incarnation, 3), "j")  # a retry changes nothing
    assert job.recovering
    after.reregister(_report(members[2], incarnation, 3), "j")
    assert job.phase is JobPhase.RUNNING and rebuilt.usable.is_set()
    assert [m.host for m in job.members] == ["h0", "h1", "h2"]
    # The members' secrets go on working for every later call.
    assert job.authenticate(2, members[2].secret) is job.members[2]


def test_a_reregistering_member_must_prove_its_secret(clock: FakeClock) -> None:
    rt, members = _running_job(_hub(clock), 2)
    incarnation = rt.job.incarnation
    forged = _report(members[0], incarnation, 2, secret=members[1].secret)
    with pytest.raises(AuthenticationError):
        _hub(clock).reregister(forged, "j")
    with pytest.raises(AuthenticationError):  # another token: another key
        _hub(clock, MemberSecrets(member_key("other-token"))).reregister(_report(members[0], incarnation, 2), "j")
    with pytest.raises(AuthenticationError):  # a coordinator with a random key can prove nothing
        Hub(CoordinatorOptions(), clock=clock).reregister(_report(members[0], incarnation, 2), "j")
    after = _hub(clock)
    after.reregister(_report(members[0], incarnation, 2), "j")
    with pytest.raises(RendezvousError, match="another instance"):
        after.reregister(_report(members[1], incarnation + 1, 2), "j")


def test_a_member_that_never_reregisters_is_failed_and_the_others_told(clock: FakeClock) -> None:
    rt, members = _running_job(_hub(clock), 3)
    after = _hub(clock)
    rebuilt, _ = after.reregister(_report(members[0], rt.job.incarnation, 3, last_event_seq=4), "j")
    after.reregister(_report(members[1], rt.job.incarnation, 3), "j")
    streams = [after.open_stream(rebuilt, rebuilt.job.members[r], last_event_seq=4) for r in (0, 1)]
    for stream in streams:
        drain(stream)
    clock.advance(3.0)
    for r in (0, 1):
        rebuilt.job.heartbeat(rebuilt.job.members[r])
    clock.advance(2.5)
    after.check_heartbeats()
    job = rebuilt.job
    assert job.members[2].state == MemberState.FAILED and job.phase is JobPhase.FAILED
    assert rebuilt.usable.is_set()  # waiters wake up to the failure
    for stream in streams:
        (event,) = drain(stream)
        assert event.kind == Events.EVENT_KIND_MEMBER_FAILED and list(event.ranks) == [2]
        assert "did not re-register" in event.reason
        assert event.seq == 5  # numbered after the last event the members saw before the restart
    with pytest.raises(RankFailedError):
        job.barrier_arrive("world", 1, 0)


def test_a_barrier_half_full_at_the_restart_completes_once() -> None:
    book = BarrierBook()
    # Before the restart ranks 1 and 2 arrived at barrier 4; after it, everybody arrives again.
    assert not book.arrive("world", 4, 1, 3)
    assert not book.arrive("world", 4, 2, 3)
    assert not book.arrive("world", 4, 2, 3)  # a retried arrival counts once
    assert book.missing("world", 4, range(3)) == [0]
    assert book.arrive("world", 4, 0, 3)
    assert book.pending() == []


def test_a_barrier_some_member_saw_complete_answers_the_others_at_once() -> None:
    book = BarrierBook()  # the restarted coordinator's
    assert not book.arrive("world", 7, 2, 3)  # rank 2 lost the reply of barrier 7 and retries it
    book.mark_completed("world", 7)  # rank 0 re-registers: it saw barrier 7 complete
    assert book.is_complete("world", 7) and book.pending() == []
    assert book.arrive("world", 7, 1, 3)
    assert not book.arrive("world", 8, 1, 3)


def test_a_completed_internal_barrier_does_not_complete_user_barriers() -> None:
    book = BarrierBook()
    named = (1 << 40) + (5 << 20) + 1  # a named barrier's generation (Job.named_barrier)
    for rank in range(2):
        book.arrive("world", named, rank, 2)
    assert book.is_complete("world", named)
    assert not book.arrive("world", 1, 0, 2)  # user barrier 1 still waits for rank 1
    assert book.arrive("world", 1, 1, 2)


def test_restored_keys_keep_what_is_there_and_the_larger_counter() -> None:
    kv = KVStore(Limits())
    kv.restore("nccl-id", b"abc")
    kv.restore("nccl-id", b"other")
    assert kv.get("nccl-id") == b"abc"
    kv.restore("count", b"3")
    kv.restore("count", b"5")
    kv.restore("count", b"4")
    assert kv.get("count") == b"5"


def test_groups_and_left_members_survive_the_rebuild(clock: FakeClock) -> None:
    rt, members = _running_job(_hub(clock), 3)
    after = _hub(clock)
    rebuilt, _ = after.reregister(_report(members[0], rt.job.incarnation, 3, left_ranks=(2,)), "j")
    rebuilt.job.new_group("pair", [0, 1])  # restored by rank 0 (NewGroup with restore)
    after.reregister(_report(members[1], rt.job.incarnation, 3, left_ranks=(2,)), "j")
    job = rebuilt.job
    assert job.phase is JobPhase.RUNNING  # rank 2 left before the restart: nobody waits for it
    assert job.members[2].state == MemberState.LEFT
    assert job.find_group("pair") == (0, 1)
    assert not job.barrier_arrive("pair", 1, 0)


def test_waiters_of_a_rebuilt_job_wake_when_it_is_whole(clock: FakeClock) -> None:
    async def scenario() -> None:
        rt, members = _running_job(_hub(clock), 2)
        after = _hub(clock)
        rebuilt, _ = after.reregister(_report(members[0], rt.job.incarnation, 2), "j")
        waiter = asyncio.ensure_future(rebuilt.usable.wait())
        await asyncio.sleep(0)
        assert not waiter.done()
        after.reregister(_report(members[1], rt.job.incarnation, 2), "j")
        await asyncio.wait_for(waiter, 5.0)

    asyncio.run(scenario())


def test_a_job_made_by_a_stray_key_call_is_rebuilt_keeping_its_keys(clock: FakeClock) -> None:
    rt, members = _running_job(_hub(clock), 2)
    after = _hub(clock)
    after.find_or_create("j").job.kv.set("early", b"1")  # a member's SetKey before it noticed the restart
    rebuilt, _ = after.reregister(_report(members[0], rt.job.incarnation, 2), "j")
    assert rebuilt.job.recovering and rebuilt.job.kv.get("early") == b"1"
    assert not rebuilt.usable.is_set()  # calls wait for the other member
