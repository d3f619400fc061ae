"""A MEMBER_LEFT event that carries the ranks which had failed the departed member's job names them,
with the departed member's error when it told it."""

from __future__ import annotations

import json

from collsvc.client.heartbeat import event_error, left_cause, left_progress
from collsvc.errors import RankFailedError
from collsvc.proto.v1 import coordinator_pb2

Events = coordinator_pb2.EventKind


def left(details: dict[str, object]) -> coordinator_pb2.WatchEvent:
    return coordinator_pb2.WatchEvent(
        kind=Events.EVENT_KIND_MEMBER_LEFT, ranks=[0], hosts=["host0"], details_json=json.dumps(details)
    )


def test_a_plain_leave_names_the_member_that_left() -> None:
    error = event_error(left({"finished": {"0": {"world": 3}}}))
    assert isinstance(error, RankFailedError) and error.ranks == [0]
    assert str(error) == "rank 0 (host0) left the job"


def test_a_leave_after_a_failure_names_the_cause() -> None:
    event = left({"finished": {"0": {"world": 0}}, "cause": [1]})
    assert left_cause(event) == ([1], "")
    assert left_progress(event) == {0: {"world": 0}}
    error = event_error(event)
    assert isinstance(error, RankFailedError) and error.ranks == [1]
    assert "rank 1 failed" in str(error) and "rank 0 (host0) left the job" in str(error)


def test_a_leave_after_a_timeout_names_the_late_ranks_with_the_error() -> None:
    reason = "barrier #1 in group 'world' timed out after 1s on rank 0; waiting on rank 2"
    event = left({"finished": {"0": {"world": 0}}, "cause": [2], "cause_reason": reason})
    assert left_cause(event) == ([2], reason)
    error = event_error(event)
    assert isinstance(error, RankFailedError) and error.ranks == [2]
    assert str(error) == f"rank 0 (host0) left the job after its collective failed: {reason}"


def test_an_unreadable_cause_is_ignored() -> None:
    assert left_cause(left({"cause": "x"})) == ([], "")
    assert left_cause(coordinator_pb2.WatchEvent(kind=Events.EVENT_KIND_MEMBER_LEFT, details_json="{")) == ([], "")


def test_a_leave_blaming_the_rank_that_hears_it_names_the_member_that_left() -> None:
    """A cut link between ranks 0 and 1: rank 0's call failed on rank 1, it left naming rank 1. Rank 1
    is running, so its error names rank 0, the other end, never itself; a bystander's view keeps rank 1."""
    reason = "all_reduce #7 in group 'world' timed out after 5s on rank 0; waiting on rank 1"
    event = left({"finished": {"0": {"world": 6}}, "cause": [1], "cause_reason": reason})
    heard = event_error(event, own_rank=1)
    assert isinstance(heard, RankFailedError) and heard.ranks == [0]
    assert "rank 0 (host0) left the job after its collective failed waiting on this rank (1)" in str(heard)
    assert str(heard).endswith(f"its error: {reason}")
    bystander = event_error(event, own_rank=2)
    assert isinstance(bystander, RankFailedError) and bystander.ranks == [1]


def test_a_leave_blaming_this_rank_and_another_names_the_other_and_the_member_that_left() -> None:
    error = event_error(left({"cause": [1, 3]}), own_rank=1)
    assert isinstance(error, RankFailedError) and error.ranks == [0, 3]
    assert "its error: not told" in str(error)
