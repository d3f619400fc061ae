"""A member whose job the coordinator dropped learns why it ended and who caused it (JobEndedError)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from collsvc.errors import JobBrokenError, JobEndedError
from collsvc.proto.v1 import coordinator_pb2 as pb

from .conftest import expect_error


def test_a_call_on_a_dropped_job_names_why_it_ended(start_coordinator: Callable[..., Any]) -> None:
    _, client = start_coordinator(heartbeat_interval=0.05, heartbeat_timeout=0.6)
    replies = sorted(client.join_all("j", 3, lambda i: {"host": f"h{i}", "requested_rank": i}), key=lambda r: r.rank)
    watch = client.watch("j", replies[2])  # ranks 0 and 1 never beat
    assert watch.next().kind == pb.EVENT_KIND_WATCHING
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.05):
            watch.send()

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    failed: set[int] = set()
    try:
        while failed != {0, 1}:  # one event, or one each when a busy machine splits them across rounds
            event = watch.next(timeout=10)
            assert event.kind == pb.EVENT_KIND_MEMBER_FAILED, event
            failed.update(event.ranks)
    finally:
        stop.set()
        beater.join()
    client("Leave", pb.LeaveRequest(job_id="j", rank=2, member_secret=replies[2].member_secret))  # the job ends
    error = expect_error(lambda: client("NewGroup", pb.NewGroupRequest(job_id="j", name="g1", ranks=[0, 1, 2])))
    assert isinstance(error, JobEndedError) and isinstance(error, JobBrokenError), repr(error)
    assert sorted(error.ranks) == [0, 1] and "missed heartbeats" in error.reason, (error.ranks, error.reason)
    assert "failed: missed heartbeats" in str(error)
    # A job that never existed is still a plain argument error, and the id can name a new job again.
    assert isinstance(expect_error(lambda: client("GetStatus", pb.GetStatusRequest(job_id="nope"))), ValueError)
    again = client.join_all("j", 1, lambda i: {"host": "h0"})
    assert len(again) == 1


def test_a_job_everyone_left_says_so(start_coordinator: Callable[..., Any]) -> None:
    _, client = start_coordinator()
    (reply,) = client.join_all("k", 1, lambda i: {"host": "h0"})
    client("Leave", pb.LeaveRequest(job_id="k", rank=0, member_secret=reply.member_secret))
    error = expect_error(lambda: client("GetStatus", pb.GetStatusRequest(job_id="k")))
    assert isinstance(error, JobEndedError) and error.reason == "every member left" and error.ranks == []
