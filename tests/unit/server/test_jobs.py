from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from collsvc.errors import (
    AbortedError,
    AuthenticationError,
    CollectiveMismatchError,
    RankFailedError,
    RendezvousError,
    ResourceLimitError,
)
from collsvc.options import Limits
from collsvc.server.state.common import MemberState, NotFoundError
from collsvc.server.state.jobs import Job
from collsvc.server.state.registry import Registry

from .conftest import FakeClock, join

MakeJob = Callable[..., Job]


def _complete(job: Job, n: int, hosts: int = 1) -> list[Any]:
    return [join(job, n, host=f"h{i % hosts}", pid=i) for i in range(n)]


def test_job_completes_when_world_size_members_joined(make_job: MakeJob, clock: FakeClock) -> None:
    job = make_job()
    members = [join(job, 3, host="h", pid=i) for i in range(2)]
    assert not job.complete and job.joined == 2 and job.state == "joining"
    members.append(join(job, 3, host="h", pid=2))
    assert job.complete and job.state == "running"
    assert sorted(m.rank for m in members) == [0, 1, 2]
    assert all(m.state == MemberState.ALIVE and m.last_heartbeat == clock.now for m in members)
    assert len({m.secret for m in members}) == 3


def test_world_size_disagreement_names_both_sizes(make_job: MakeJob) -> None:
    job = make_job()
    join(job, 4)
    with pytest.raises(RendezvousError, match=r"world_size 4 .* world_size 5"):
        join(job, 5, host="other")


def test_duplicate_requested_rank_names_rank_and_host(make_job: MakeJob) -> None:
    job = make_job()
    join(job, 4, host="alpha", requested_rank=2)
    with pytest.raises(RendezvousError, match=r"rank 2 .*'alpha'"):
        join(job, 4, host="beta", requested_rank=2)


def test_full_job_rejects_more_members(make_job: MakeJob) -> None:
    job = make_job()
    _complete(job, 2)
    with pytest.raises(RendezvousError, match="full"):
        join(job, 2)


def test_bad_sizes_and_ranks(make_job: MakeJob) -> None:
    job = make_job(limits=Limits(max_world_size=8))
    with pytest.raises(ResourceLimitError):
        join(job, 9)
    with pytest.raises(ValueError):
        join(job, 0)
    with pytest.raises(ValueError):
        join(job, 4, requested_rank=4)


def test_cancelled_join_frees_its_rank_and_the_world_size(make_job: MakeJob) -> None:
    job = make_job()
    member = join(job, 4, requested_rank=1)
    assert job.cancel_join(member)
    assert job.world_size is None
    join(job, 2, requested_rank=1)  # a new world size and the same rank are fine now


def test_authenticate_checks_rank_and_secret(make_job: MakeJob) -> None:
    job = make_job()
    members = _complete(job, 2)
    assert job.authenticate(members[0].rank, members[0].secret) is members[0]
    with pytest.raises(AuthenticationError) as wrong:
        job.authenticate(members[0].rank, members[1].secret)
    with pytest.raises(AuthenticationError) as unknown:
        job.authenticate(7, members[0].secret)
    assert str(wrong.value) == str(unknown.value)


def test_heartbeat_expiry_with_fake_clock(make_job: MakeJob, clock: FakeClock) -> None:
    job = make_job()
    a, b = _complete(job, 2)
    clock.advance(4.0)
    job.heartbeat(a, [("world", 3, 2, "all_reduce")])
    assert job.expired(5.0) == []
    clock.advance(1.5)
    assert job.expired(5.0) == [b]
    assert job.fail([b.rank], "missed heartbeats") == [b]
    assert job.fail([b.rank], "again") == []
    assert job.state == "failed"
    assert job.expired(5.0) == []
    assert a.progress["world"].finished_seq == 2


def test_barrier_after_failure_or_leave_or_abort(make_job: MakeJob) -> None:
    job = make_job()
    members = _complete(job, 3, hosts=3)
    job.new_group("pair", [0, 1])
    assert not job.barrier_arrive("world", 1, 0)
    job.leave(job.members[2])
    assert not job.barrier_arrive("pair", 1, 0)  # rank 2 is not in "pair"
    with pytest.raises(RankFailedError) as left:
        job.barrier_arrive("world", 1, 1)
    assert left.value.ranks == [2] and left.value.hosts == [job.members[2].host]
    job.fail([1], "boom")
    with pytest.raises(RankFailedError, match="boom"):
        job.check_healthy("pair")
    job.abort("stop it", members[0].rank)
    with pytest.raises(AbortedError) as aborted:
        job.check_healthy("world")
    assert aborted.value.reason == "stop it"
    with pytest.raises(AbortedError):
        join(job, 3)


def test_mismatch_reports_merge(make_job: MakeJob) -> None:
    job = make_job()
    _complete(job, 2)
    job.merge_mismatch({"0": {"op": "all_reduce"}}, "rank 0 saw a mismatch")
    merged = job.merge_mismatch({"1": {"op": "broadcast"}}, "rank 1 too")
    assert merged == {"0": {"op": "all_reduce"}, "1": {"op": "broadcast"}}
    with pytest.raises(CollectiveMismatchError) as err:
        job.check_healthy("world")
    assert err.value.details == {0: {"op": "all_reduce"}, 1: {"op": "broadcast"}}


def test_groups(make_job: MakeJob) -> None:
    job = make_job()
    _complete(job, 4)
    job.new_group("even", [0, 2])
    job.new_group("even", [0, 2])  # idempotent
    with pytest.raises(ValueError):
        job.new_group("even", [0, 1])
    with pytest.raises(ValueError):
        job.new_group("bad", [0, 9])
    with pytest.raises(ValueError):
        job.new_group("world", [0])
    assert job.find_group("even") == (0, 2)
    assert job.find_group("nope") is None
    assert job.find_group("world") == (0, 1, 2, 3)
    with pytest.raises(NotFoundError):
        job.barrier_arrive("nope", 1, 0)
    with pytest.raises(ValueError):
        job.barrier_arrive("even", 1, 1)


def test_waiting_on_and_progress_report_last_ops(make_job: MakeJob) -> None:
    job = make_job()
    _complete(job, 3)
    job.heartbeat(job.members[1], [("world", 5, 4, "all_gather(float32[4])")])
    job.heartbeat(job.members[2], [("world", 6, 6, "broadcast")])
    job.barrier_arrive("world", 1, 0)
    waiting = job.barrier_waiting_on("world", 1)
    assert [(w.rank, w.last_op, w.finished_seq) for w in waiting] == [
        (1, "all_gather(float32[4])", 4),
        (2, "broadcast", 6),
    ]
    assert [w.rank for w in job.not_started("world", 6)] == [0, 1]


def test_registry_creates_and_drops_jobs(clock: FakeClock) -> None:
    registry = Registry(clock=clock, limits=Limits(max_jobs=2), incarnation=lambda: 7)
    job = registry.get_or_create("a")
    assert registry.get_or_create("a") is job and job.incarnation == 7
    registry.get_or_create("b")
    with pytest.raises(ResourceLimitError):
        registry.get_or_create("c")
    with pytest.raises(NotFoundError):
        registry.get("zzz")
    members = _complete(job, 2)
    job.leave(members[0])
    assert not registry.drop_if_finished(job)
    job.fail([members[1].rank], "gone")
    assert registry.drop_if_finished(job)
    assert registry.find("a") is None
    assert registry.get_or_create("a") is not job  # the id can run again
