"""Every field of every Coordinator request has a length limit, and the refusal names both.

Each case sends one real request to a real coordinator with default limits and expects
RESOURCE_EXHAUSTED, the ``collsvc-error-reason`` metadata a client maps to ResourceLimitError, and a
message naming the field and the ``Limits`` attribute. Memory under such requests is measured in
test_limits.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from collsvc.client.rendezvous import CoordinatorClient
from collsvc.errors import ResourceLimitError
from collsvc.options import Limits
from collsvc.proto.v1 import common_pb2
from collsvc.proto.v1 import coordinator_pb2 as pb
from collsvc.server.request_limits import RequestLimits
from collsvc.server.services.coordinator import SERVICE
from collsvc.server.services.join import client_address
from tests.harness import TOKEN, coordinator
from tests.security._util import COORDINATOR, raw_call

LIMITS = Limits()
NAME = "n" * (LIMITS.max_name_bytes + 1)
RANKS = list(range(LIMITS.max_world_size + 1))

CASES = [
    ("Join", pb.JoinRequest(job_id=NAME, world_size=2), "JoinRequest.job_id", "max_name_bytes"),
    ("Join", pb.JoinRequest(job_id="j", world_size=2, host=NAME), "JoinRequest.host", "max_name_bytes"),
    ("Join", pb.JoinRequest(job_id="j", world_size=2, peer_address=NAME), "JoinRequest.peer_address", "max_name_bytes"),
    ("Join", pb.JoinRequest(job_id="j", world_size=2, device=common_pb2.DeviceIdentity(uuid=NAME)),
     "JoinRequest.device.uuid", "max_name_bytes"),
    ("Barrier", pb.BarrierRequest(job_id="j", group=NAME), "BarrierRequest.group", "max_name_bytes"),
    ("Barrier", pb.BarrierRequest(job_id="j", member_secret=NAME), "BarrierRequest.member_secret", "max_name_bytes"),
    ("SetKey", pb.SetKeyRequest(job_id="j", key="k" * (LIMITS.max_key_bytes + 1)),
     "SetKeyRequest.key", "max_key_bytes"),
    ("SetKey", pb.SetKeyRequest(job_id="j", key="k", value=b"v" * (LIMITS.max_value_bytes + 1)),
     "SetKeyRequest.value", "max_value_bytes"),
    ("CompareSetKey", pb.CompareSetKeyRequest(job_id="j", key="k", expected=b"v" * (LIMITS.max_value_bytes + 1)),
     "CompareSetKeyRequest.expected", "max_value_bytes"),
    ("GetKey", pb.GetKeyRequest(job_id=NAME, key="k"), "GetKeyRequest.job_id", "max_name_bytes"),
    ("NewGroup", pb.NewGroupRequest(job_id="j", name=NAME, ranks=[0]), "NewGroupRequest.name", "max_name_bytes"),
    ("NewGroup", pb.NewGroupRequest(job_id="j", name="g", ranks=RANKS), "NewGroupRequest.ranks", "max_world_size"),
    ("FindGroup", pb.FindGroupRequest(job_id="j", name=NAME), "FindGroupRequest.name", "max_name_bytes"),
    ("ReportFailure", pb.ReportFailureRequest(job_id="j", reason="r" * (LIMITS.max_text_bytes + 1)),
     "ReportFailureRequest.reason", "max_text_bytes"),
    ("ReportFailure", pb.ReportFailureRequest(job_id="j", details_json="d" * (LIMITS.max_text_bytes + 1)),
     "ReportFailureRequest.details_json", "max_text_bytes"),
    ("ReportFailure", pb.ReportFailureRequest(job_id="j", ranks=RANKS), "ReportFailureRequest.ranks", "max_world_size"),
    ("Leave", pb.LeaveRequest(job_id="j", progress=[common_pb2.Progress(group="world", last_op="x" * 1025)]),
     "LeaveRequest.progress.last_op", "max_op_bytes"),
    ("Leave", pb.LeaveRequest(job_id="j", progress=[common_pb2.Progress(group=NAME)]),
     "LeaveRequest.progress.group", "max_name_bytes"),
    ("GetProgress", pb.GetProgressRequest(job_id="j", group=NAME), "GetProgressRequest.group", "max_name_bytes"),
    ("GetStatus", pb.GetStatusRequest(job_id=NAME), "GetStatusRequest.job_id", "max_name_bytes"),
]  # fmt: skip


@pytest.fixture(scope="module")
def address() -> Iterator[str]:
    with coordinator() as (_, addr):
        yield addr


@pytest.mark.parametrize(("method", "request_", "field", "limit"), CASES, ids=[c[2] for c in CASES])
def test_each_field_over_its_limit_is_refused_by_name(
    address: str, method: str, request_: object, field: str, limit: str
) -> None:
    body = request_.SerializeToString()  # type: ignore[attr-defined]
    code, details, metadata = raw_call(address, COORDINATOR + method, body, token=TOKEN)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert metadata["collsvc-error-reason"] == "ERROR_REASON_RESOURCE_EXHAUSTED"
    assert details.startswith(f"{field} ") and f"(Limits.{limit})" in details, details


def test_a_heartbeat_stream_over_a_limit_is_refused_by_name(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        watch = channel.stream_stream(COORDINATOR + "Watch", request_serializer=None, response_deserializer=None)
        call = watch(
            iter([pb.WatchRequest(job_id=NAME).SerializeToString()]),
            metadata=(("authorization", f"Bearer {TOKEN}"),),
            timeout=10,
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "WatchRequest.job_id is 513 bytes, over the limit of 512 bytes (Limits.max_name_bytes)" in (
        caught.value.details() or ""
    )


def test_the_client_sees_a_resource_limit_error_naming_the_field(address: str) -> None:
    client = CoordinatorClient(address, NAME, token=TOKEN, tls=None, timeout=10.0)
    try:
        with pytest.raises(ResourceLimitError, match=r"SetKeyRequest\.job_id is 513 bytes.*Limits\.max_name_bytes"):
            client.set("k", b"v")
    finally:
        client.close()


def test_limits_at_their_maximum_are_accepted(address: str) -> None:
    """The largest legitimate values fit: a full-size value under a full-size key in a full-size job id."""
    job_id = "j" * LIMITS.max_name_bytes
    client = CoordinatorClient(address, job_id, token=TOKEN, tls=None, timeout=30.0)
    try:
        key, value = "k" * LIMITS.max_key_bytes, b"v" * LIMITS.max_value_bytes
        client.set(key, value)
        assert client.get(key, 5.0) == value
        request = pb.CompareSetKeyRequest(job_id=job_id, key=key, expected=value, desired=value[::-1])
        assert client._call("CompareSetKey", request, "compare-set").swapped
    finally:
        client.close()


def test_the_receive_limit_is_what_the_protocol_needs() -> None:
    """The biggest request is a compare-and-set of two full values; every other method needs less."""
    limits = RequestLimits(LIMITS)
    largest = limits.max_receive_bytes(SERVICE)
    assert 2 * LIMITS.max_value_bytes < largest < 2 * LIMITS.max_value_bytes + 64 * 1024
    assert largest == limits.budget(pb.CompareSetKeyRequest.DESCRIPTOR)


@pytest.mark.parametrize(
    ("peer", "client"),
    [
        ("ipv4:10.0.0.5:41234", "10.0.0.5"),
        ("ipv6:[::1]:41234", "::1"),
        ("ipv6:[::ffff:127.0.0.1]:5", "127.0.0.1"),
        ("unix:/tmp/socket", "unix:/tmp/socket"),
    ],
)
def test_client_address(peer: str, client: str) -> None:
    assert client_address(peer) == client
