"""A coordinator restarted on the same port takes back a running job from its members (real server)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from collsvc.errors import AuthenticationError
from collsvc.proto.v1 import coordinator_pb2 as pb
from collsvc.server.app import CoordinatorThread

from .conftest import Client

Start = Callable[..., tuple[CoordinatorThread, Client]]


def _reregister(client: Client, job: str, join: Any, member: Any, **fields: Any) -> Any:
    request = pb.ReregisterRequest(
        job_id=job,
        rank=join.rank,
        member_secret=fields.pop("secret", join.member_secret),
        job_incarnation=join.job_incarnation,
        world_size=join.world_size,
        num_nodes=join.num_nodes,
        member=member,
        **fields,
    )
    return client("Reregister", request)


def test_restarted_coordinator_rebuilds_the_job_from_its_members(start_coordinator: Start) -> None:
    first, client = start_coordinator()
    joins = sorted(client.join_all("r", 2), key=lambda j: j.rank)
    members = list(client("GetMembers", pb.GetMembersRequest(job_id="r")).members)
    assert client("Barrier", client.barrier_request("r", 0, 1, 1.0)).complete is False  # rank 1 never came
    port = int(first.address.rsplit(":", 1)[1])
    first.stop()

    other, refusing = start_coordinator(port=port, token="another-token")
    with pytest.raises(AuthenticationError):  # another token: the secrets cannot be proven
        _reregister(refusing, "r", joins[0], members[0])
    other.stop()

    _, again = start_coordinator(port=port)  # the same token
    with pytest.raises(AuthenticationError):
        _reregister(again, "r", joins[0], members[0], secret=joins[1].member_secret)
    assert _reregister(again, "r", joins[0], members[0], last_event_seq=3).recovering
    status = again("GetStatus", pb.GetStatusRequest(job_id="r")).jobs[0]
    assert status.state == "recovering"
    again("SetKey", pb.SetKeyRequest(job_id="r", key="nccl", value=b"id", restore=True))  # no wait
    assert not _reregister(again, "r", joins[1], members[1]).recovering
    assert again("GetStatus", pb.GetStatusRequest(job_id="r")).jobs[0].state == "running"
    assert again("GetKey", pb.GetKeyRequest(job_id="r", key="nccl")).value == b"id"
    # The secrets from the first coordinator work for every call, and barriers go on.
    again.secrets.update({("r", 0): joins[0].member_secret, ("r", 1): joins[1].member_secret})
    assert not again("Barrier", again.barrier_request("r", 1, 2, 0.2)).complete  # rank 0 is not there yet
    assert again("Barrier", again.barrier_request("r", 0, 2, 5.0)).complete
    watch = again.watch("r", joins[0])
    assert watch.next().kind == pb.EVENT_KIND_WATCHING
    again("Leave", pb.LeaveRequest(job_id="r", rank=1, member_secret=joins[1].member_secret))
    left = watch.next()
    assert left.kind == pb.EVENT_KIND_MEMBER_LEFT and left.seq == 4  # numbered after what the members saw
