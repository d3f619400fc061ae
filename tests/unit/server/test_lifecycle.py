"""The job lifecycle: explicit phases, named transitions in one table, and retried joins."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from collsvc.errors import AbortedError, RendezvousError
from collsvc.server.state.common import Device
from collsvc.server.state.jobs import Job
from collsvc.server.state.lifecycle import TRANSITIONS, IllegalTransitionError, JobAction, JobPhase, Lifecycle
from collsvc.server.state.roster import JoinRequest

from .conftest import join

MakeJob = Callable[..., Job]


def _request(world_size: int, key: str = "", rank: int | None = None) -> JoinRequest:
    return JoinRequest(world_size, rank, "h", "h:1", Device(), 0, None, idempotency_key=key)


def test_every_phase_change_goes_through_the_table() -> None:
    lifecycle = Lifecycle("j")
    assert lifecycle.apply(JobAction.COMPLETE) is JobPhase.RUNNING
    assert lifecycle.apply(JobAction.FAIL) is JobPhase.FAILED
    assert lifecycle.apply(JobAction.ABORT) is JobPhase.ABORTED
    assert lifecycle.apply(JobAction.FAIL) is JobPhase.ABORTED  # an aborted job stays aborted
    with pytest.raises(IllegalTransitionError, match="cannot complete while aborted"):
        lifecycle.apply(JobAction.COMPLETE)
    assert not Lifecycle("j").allows(JobAction.RECOVERED)
    assert Lifecycle("j", JobPhase.RECOVERING).apply(JobAction.RECOVERED) is JobPhase.RUNNING
    # Every phase but the first can be reached, and nothing leads back to JOINING.
    targets = set(TRANSITIONS.values())
    assert targets == set(JobPhase) - {JobPhase.JOINING, JobPhase.RECOVERING}


def test_job_phases_follow_what_happens(make_job: MakeJob) -> None:
    job = make_job()
    assert job.phase is JobPhase.JOINING
    members = [join(job, 2) for _ in range(2)]
    assert job.phase is JobPhase.RUNNING and job.state == "running"
    job.merge_mismatch({"0": "a", "1": "b"}, "mismatch")
    assert job.phase is JobPhase.FAILED
    job.abort("stop", members[0].rank)  # type: ignore[attr-defined]
    assert job.phase is JobPhase.ABORTED
    job.fail([1], "late")
    assert job.state == "aborted"


def test_a_retried_join_finds_its_member_while_joining_and_after(make_job: MakeJob) -> None:
    job = make_job()
    first = job.join(_request(2, key="k0"))
    assert job.join(_request(2, key="k0")) is first  # the retry of a Join whose connection broke
    assert job.joined == 1
    # The first call gives up (its connection broke): the retry still holds the member.
    assert not job.cancel_join(first)
    assert job.joined == 1
    second = job.join(_request(2, key="k1"))
    assert job.complete and {first.rank, second.rank} == {0, 1}
    # A reply lost after completion: the retry gets the same member, not "job is full".
    assert job.join(_request(2, key="k1")) is second
    with pytest.raises(RendezvousError, match="is full"):
        job.join(_request(2, key="k2"))


def test_joins_without_a_key_are_never_taken_for_retries(make_job: MakeJob) -> None:
    job = make_job()
    a, b = job.join(_request(3)), job.join(_request(3))
    assert a is not b and job.joined == 2
    assert job.cancel_join(a) and job.joined == 1


def test_an_aborted_job_refuses_joins_but_answers_retries(make_job: MakeJob) -> None:
    job = make_job()
    first = job.join(_request(2, key="k0"))
    job.join(_request(2, key="k1"))
    job.abort("stop", 0)
    assert job.join(_request(2, key="k0")) is first
    with pytest.raises(AbortedError):
        job.join(_request(2, key="new"))
