"""A MEMBER_LEFT event that carries the ranks which had failed the departed member's job names them,
with the departed member's error when it told it."""

from __future__ import annotations

import json

from collsvc.client.departures import Departures
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


def cut(cause: list[int], running: dict[str, str]) -> coordinator_pb2.WatchEvent:
    """Rank 0 on host-a left: its delivery to ``cause`` failed; the coordinator heard from ``running``."""
    details = {"cause": cause, "cause_reason": "sending to rank 2 failed (UNAVAILABLE)", "unreachable": True}
    details["running"] = running
    return coordinator_pb2.WatchEvent(
        kind=Events.EVENT_KIND_MEMBER_LEFT, ranks=[0], hosts=["host-a"], details_json=json.dumps(details)
    )


def test_a_cut_link_is_named_by_its_far_end_from_each_host() -> None:
    """Ranks 0, 1 on host-a, 2, 3 on host-b, 4 on host-c; the path between host-a and host-b broke and
    rank 0 left naming rank 2, which the coordinator still heard from. Nobody names its own host."""
    event = cut([2], {"2": "host-b"})
    same_host_as_departed = event_error(event, own_rank=1, own_host="host-a")
    assert isinstance(same_host_as_departed, RankFailedError)
    assert (same_host_as_departed.ranks, same_host_as_departed.hosts) == ([2], ["host-b"])
    same_host_as_running = event_error(event, own_rank=3, own_host="host-b")
    assert isinstance(same_host_as_running, RankFailedError)
    assert (same_host_as_running.ranks, same_host_as_running.hosts) == ([0], ["host-a"])
    third_host = event_error(event, own_rank=4, own_host="host-c")
    assert isinstance(third_host, RankFailedError) and third_host.ranks == [0, 2]
    for error in (same_host_as_departed, same_host_as_running, third_host):
        assert error.unreachable
        assert "rank 0 (host-a) left the job after its collective failed: sending to rank 2" in str(error)
        assert "still heard from rank 2 (host-b)" in str(error) and "cut link" in str(error)
    end = event_error(event, own_rank=2, own_host="host-b")  # the other end names the departed one
    assert isinstance(end, RankFailedError) and end.ranks == [0]
    assert "waiting on this rank (2), which is running" in str(end) and end.unreachable


def test_a_leave_naming_unreachable_ranks_nobody_vouched_for_names_them() -> None:
    """A peer the coordinator did not hear from (dead, stopped) is named, as before."""
    error = event_error(cut([2], {}), own_rank=3, own_host="host-b")
    assert isinstance(error, RankFailedError) and error.ranks == [2]


def test_departures_remember_the_first_that_left_a_path_broken() -> None:
    """A member whose call ended on a departure over a cut link (not a job failure) leaves naming it."""
    departures = Departures([])
    plain = RankFailedError("rank 4 left the job", [4])
    departures.record([4], plain, {})
    assert departures.first_unreachable() is None
    cut_error = RankFailedError("rank 0 left ... cut link", [0], unreachable=True)
    departures.record([0], cut_error, {})
    departures.record([5], RankFailedError("rank 5 left ... cut link", [5], unreachable=True), {})
    assert departures.first_unreachable() is cut_error
