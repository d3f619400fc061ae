"""Watch streams: events on leave, stream breaks, missed heartbeats, aborts and mismatches."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from collsvc.errors import AbortedError, AuthenticationError, RankFailedError
from collsvc.proto.v1 import coordinator_pb2 as pb

from .conftest import Client, Watch, expect_error


def _watched_job(client: Client, n: int) -> tuple[list[Any], list[Watch]]:
    replies = sorted(client.join_all("j", n, lambda i: {"host": f"h{i}", "requested_rank": i}), key=lambda r: r.rank)
    watches = [client.watch("j", r) for r in replies]
    for w in watches:
        assert w.next().kind == pb.EVENT_KIND_WATCHING
    return replies, watches


def _barrier(client: Client, rank: int, generation: int = 1, timeout_s: float = 10.0) -> Any:
    return client("Barrier", client.barrier_request("j", rank, generation, timeout_s))


def test_leave_tells_the_others_and_fails_their_barriers(client: Client) -> None:
    replies, watches = _watched_job(client, 3)
    client("Leave", pb.LeaveRequest(job_id="j", rank=2, member_secret=replies[2].member_secret))
    for w in watches[:2]:
        event = w.next()
        assert event.kind == pb.EVENT_KIND_MEMBER_LEFT and list(event.ranks) == [2] and list(event.hosts) == ["h2"]
    error = expect_error(lambda: _barrier(client, 0))
    assert isinstance(error, RankFailedError) and error.ranks == [2] and error.hosts == ["h2"]


def test_broken_stream_fails_the_member_and_a_pending_barrier(client: Client) -> None:
    replies, watches = _watched_job(client, 3)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(expect_error, lambda: _barrier(client, 0))
        watches[1].cancel()  # rank 1 disappears without leaving
        for w in (watches[0], watches[2]):
            event = w.next()
            assert event.kind == pb.EVENT_KIND_MEMBER_FAILED and list(event.ranks) == [1]
        error = pending.result(timeout=10)
    assert isinstance(error, RankFailedError) and error.ranks == [1] and error.hosts == ["h1"]


def test_missed_heartbeats_fail_a_silent_member(start_coordinator: Callable[..., Any]) -> None:
    _, client = start_coordinator(heartbeat_interval=0.05, heartbeat_timeout=0.6)
    replies = sorted(client.join_all("j", 2, lambda i: {"host": f"h{i}", "requested_rank": i}), key=lambda r: r.rank)
    watch = client.watch("j", replies[0])  # rank 1 never opens a stream and never beats
    assert watch.next().kind == pb.EVENT_KIND_WATCHING
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.05):
            watch.send()

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        event = watch.next(timeout=5)
    finally:
        stop.set()
        beater.join()
    assert event.kind == pb.EVENT_KIND_MEMBER_FAILED and list(event.ranks) == [1]
    assert "heartbeat" in event.reason
    status = client("GetStatus", pb.GetStatusRequest(job_id="j")).jobs[0]
    assert status.state == "failed" and "rank" in status.failure


def test_abort_reaches_everyone_and_blocks_later_calls(client: Client) -> None:
    replies, watches = _watched_job(client, 2)
    report = pb.ReportFailureRequest(
        job_id="j",
        rank=1,
        member_secret=replies[1].member_secret,
        kind=pb.EVENT_KIND_JOB_ABORTED,
        reason="user",
    )
    client("ReportFailure", report)
    for w in watches:
        event = w.next()
        assert event.kind == pb.EVENT_KIND_JOB_ABORTED and event.reason == "user"
    error = expect_error(lambda: _barrier(client, 0))
    assert isinstance(error, AbortedError) and error.reason == "user"
    again = expect_error(lambda: client.join("j", 2))
    assert isinstance(again, AbortedError)


def test_mismatch_reports_are_merged_and_fanned_out(client: Client) -> None:
    replies, watches = _watched_job(client, 2)
    for rank, signature in ((0, {"op": "all_reduce"}), (1, {"op": "broadcast"})):
        client(
            "ReportFailure",
            pb.ReportFailureRequest(
                job_id="j",
                rank=rank,
                member_secret=replies[rank].member_secret,
                kind=pb.EVENT_KIND_COLLECTIVE_MISMATCH,
                reason="collectives differ at seq 3",
                details_json=json.dumps({str(rank): signature}),
            ),
        )
    for w in watches:
        first, second = w.next(), w.next()
        assert first.kind == second.kind == pb.EVENT_KIND_COLLECTIVE_MISMATCH
        assert json.loads(second.details_json) == {"0": {"op": "all_reduce"}, "1": {"op": "broadcast"}}


def test_reported_local_failure_fails_that_rank(client: Client) -> None:
    replies, watches = _watched_job(client, 2)
    report = pb.ReportFailureRequest(
        job_id="j",
        rank=1,
        member_secret=replies[1].member_secret,
        kind=pb.EVENT_KIND_MEMBER_FAILED,
        reason="OOM",
    )
    client("ReportFailure", report)
    event = watches[0].next()
    assert event.kind == pb.EVENT_KIND_MEMBER_FAILED and list(event.ranks) == [1] and event.reason == "OOM"


def test_job_id_is_reusable_after_everyone_left(client: Client) -> None:
    first = client.join_all("j", 2)
    for r in first:
        client("Leave", pb.LeaveRequest(job_id="j", rank=r.rank, member_secret=r.member_secret))
    second = client.join_all("j", 3)
    assert {r.world_size for r in second} == {3}
    assert second[0].job_incarnation != first[0].job_incarnation
    # A member of the old job cannot act in the new one.
    stale = pb.LeaveRequest(job_id="j", rank=0, member_secret=first[0].member_secret)
    assert isinstance(expect_error(lambda: client("Leave", stale)), AuthenticationError)
