"""Binding, security defaults, serving, and the error mapping through errors.error_from_rpc."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collsvc.errors import RankFailedError, RendezvousError, error_from_rpc
from collsvc.options import CoordinatorOptions
from collsvc.proto.v1 import coordinator_pb2 as pb
from collsvc.server.app import CoordinatorThread, build_server, check_security, serve


def test_second_coordinator_on_a_used_port_fails_fast(start_coordinator: Callable[..., Any]) -> None:
    first, _ = start_coordinator()
    start = time.monotonic()
    second = CoordinatorThread(CoordinatorOptions(host="127.0.0.1", port=first.port or 0))
    with pytest.raises(OSError, match="already in use"):
        second.start()
    assert time.monotonic() - start < 5.0


def test_non_loopback_needs_token_tls_or_insecure() -> None:
    with pytest.raises(ValueError, match="--token-file"):
        check_security(CoordinatorOptions(host="0.0.0.0"))
    check_security(CoordinatorOptions(host="0.0.0.0", token="t"))
    check_security(CoordinatorOptions(host="0.0.0.0", insecure=True))
    check_security(CoordinatorOptions(host="::1"))
    check_security(CoordinatorOptions(host="localhost"))
    with pytest.raises(ValueError):
        CoordinatorThread(CoordinatorOptions(host="0.0.0.0", port=0)).start()


def test_serve_runs_until_stopped() -> None:
    async def main() -> None:
        stop = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(CoordinatorOptions(port=0), ready=ready.set_result, stop=stop))
        port = await asyncio.wait_for(ready, 10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        stop.set()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_build_server_binds_port_zero() -> None:
    async def main() -> None:
        server, port = await build_server(CoordinatorOptions(port=0))
        assert port > 0
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(
                "/collsvc.proto.v1.Coordinator/GetMembers",
                request_serializer=pb.GetMembersRequest.SerializeToString,
                response_deserializer=pb.GetMembersResponse.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(pb.GetMembersRequest(job_id="nope"), timeout=5)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
        await server.stop(None)

    asyncio.run(main())


def test_rank_failure_maps_back_with_ranks_and_hosts(start_coordinator: Callable[..., Any]) -> None:
    _, client = start_coordinator()
    replies = client.join_all("j", 2, lambda i: {"host": f"node{i}", "requested_rank": i})
    report = pb.ReportFailureRequest(
        job_id="j",
        rank=1,
        member_secret=replies[1].member_secret,
        kind=pb.EVENT_KIND_MEMBER_FAILED,
        reason="segv",
    )
    client("ReportFailure", report)
    barrier = client.barrier_request("j", 0, 1, 5)
    with pytest.raises(grpc.RpcError) as info:
        client.stub.Barrier(barrier, metadata=client.metadata, timeout=5)
    error = error_from_rpc(info.value, "barrier")
    assert isinstance(error, RankFailedError)
    assert error.ranks == [1] and error.hosts == ["node1"] and "segv" in str(error)

    with pytest.raises(grpc.RpcError) as info:
        client.stub.Join(pb.JoinRequest(job_id="j", world_size=5, timeout_s=1), metadata=client.metadata, timeout=5)
    assert isinstance(error_from_rpc(info.value, "join"), RendezvousError)
