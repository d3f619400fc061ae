"""Token authentication, member secrets, and the unauthenticated health service."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collsvc.errors import REASON_METADATA_KEY, AuthenticationError, error_from_rpc
from collsvc.proto.v1 import coordinator_pb2 as pb

from .conftest import Client, expect_error

SERVICE = "collsvc.proto.v1.Coordinator"


def test_token_is_required_and_health_is_open(start_coordinator: Callable[..., Any]) -> None:
    thread, client = start_coordinator(token="s3cret")
    address = thread.address
    request = pb.GetKeyRequest(job_id="j", key="k")
    missing = expect_error(lambda: Client(address, None)("GetKey", request))
    wrong = expect_error(lambda: Client(address, "nope")("GetKey", request))
    assert isinstance(missing, AuthenticationError) and isinstance(wrong, AuthenticationError)
    assert str(missing) == str(wrong)
    assert not client("GetKey", request).found

    # The stream RPC is refused the same way (before any request is read).
    anonymous = Client(address, None)
    reply = pb.JoinResponse(rank=0, member_secret="x")
    event = anonymous.watch("j", reply).next()
    assert isinstance(event, grpc.RpcError) and event.code() == grpc.StatusCode.UNAUTHENTICATED
    assert isinstance(error_from_rpc(event, "watch"), AuthenticationError)
    anonymous.close()

    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_no_token_configured_means_no_token_needed(start_coordinator: Callable[..., Any]) -> None:
    _, client = start_coordinator(token=None)
    assert client.metadata == ()
    client("SetKey", pb.SetKeyRequest(job_id="j", key="k", value=b"v"))


def test_member_secret_guards_barriers(client: Client) -> None:
    """Only a member can enter a barrier as its rank: a wrong secret is refused and counts for nothing."""
    replies = {r.rank: r for r in client.join_all("j", 2)}
    as_rank_1 = pb.BarrierRequest(
        job_id="j", group="world", rank=1, generation=1, timeout_s=5, member_secret=replies[0].member_secret
    )
    assert isinstance(expect_error(lambda: client("Barrier", as_rank_1)), AuthenticationError)
    no_secret = pb.BarrierRequest(job_id="j", group="world", rank=1, generation=1, timeout_s=5)
    assert isinstance(expect_error(lambda: client("Barrier", no_secret)), AuthenticationError)
    alone = client("Barrier", client.barrier_request("j", 0, 1, 0.2))  # rank 1 never really arrived
    assert not alone.complete and [w.rank for w in alone.waiting_on] == [1]


def test_member_secret_guards_leave_watch_and_reports(client: Client) -> None:
    replies = client.join_all("j", 2)
    wrong = pb.LeaveRequest(job_id="j", rank=replies[0].rank, member_secret=replies[1].member_secret)
    unknown_job = pb.LeaveRequest(job_id="other", rank=0, member_secret=replies[0].member_secret)
    first, second = (
        expect_error(lambda: client("Leave", wrong)),
        expect_error(lambda: client("Leave", unknown_job)),
    )
    assert isinstance(first, AuthenticationError) and str(first) == str(second)
    report = pb.ReportFailureRequest(job_id="j", rank=-1, kind=pb.EVENT_KIND_JOB_ABORTED, reason="x")
    assert isinstance(expect_error(lambda: client("ReportFailure", report)), AuthenticationError)

    forged = pb.JoinResponse(rank=replies[0].rank, member_secret="forged")
    event = client.watch("j", forged).next()
    assert isinstance(event, grpc.RpcError) and event.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dict(event.trailing_metadata())[REASON_METADATA_KEY] == "ERROR_REASON_AUTHENTICATION"


@pytest.mark.parametrize("token", [None, "tok"])
def test_reason_metadata_is_attached(start_coordinator: Callable[..., Any], token: str | None) -> None:
    _, client = start_coordinator(token=token)
    client.join_all("j", 1)
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Join(pb.JoinRequest(job_id="j", world_size=1, timeout_s=1), metadata=client.metadata, timeout=5)
    meta = dict(info.value.trailing_metadata())
    assert meta[REASON_METADATA_KEY] == "ERROR_REASON_RENDEZVOUS"
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
