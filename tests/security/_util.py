"""Shared helpers: raw gRPC calls, the member table of a running job, and a job held open for probing."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from collsvc.options import TlsFiles
from collsvc.proto.v1 import common_pb2
from collsvc.proto.v1 import coordinator_pb2 as pb
from tests.harness import TOKEN, JobResult, run_ranks
from tests.security import ranks

COORDINATOR = "/collsvc.proto.v1.Coordinator/"
DELIVER = "/collsvc.proto.v1.Peer/Deliver"


def credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        Path(files.ca).read_bytes(), Path(files.key).read_bytes(), Path(files.cert).read_bytes()
    )


def channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials(tls))


def raw_call(
    address: str,
    method: str,
    body: bytes,
    *,
    token: str | None = None,
    tls: TlsFiles | None = None,
    timeout: float = 5.0,
) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """One unary call with identity serializers: ``(code, details, trailing metadata)``."""
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else ()
    with channel(address, tls) as ch:
        call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            _, info = call.with_call(body, timeout=timeout, metadata=metadata)
        except grpc.RpcError as exc:
            pairs: Any = exc.trailing_metadata() or ()
            trailing = {str(k): v for k, v in pairs if isinstance(v, str)}
            return exc.code(), exc.details() or "", trailing
        return info.code(), info.details() or "", {}


def members(
    address: str, job_id: str, *, token: str | None = TOKEN, tls: TlsFiles | None = None, timeout: float = 30.0
) -> list[common_pb2.Member]:
    """The member table of ``job_id`` once its rendezvous completed (polls GetMembers)."""
    deadline = time.monotonic() + timeout
    request = pb.GetMembersRequest(job_id=job_id).SerializeToString()
    while True:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        with channel(address, tls) as ch:
            call = ch.unary_unary(COORDINATOR + "GetMembers", request_serializer=None, response_deserializer=None)
            try:
                reply = pb.GetMembersResponse.FromString(call(request, timeout=5, metadata=metadata))
                return list(reply.members)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise
        time.sleep(0.1)


def release(address: str, job_id: str, key: str, *, token: str | None = TOKEN, tls: TlsFiles | None = None) -> None:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with channel(address, tls) as ch:
        call = ch.unary_unary(COORDINATOR + "SetKey", request_serializer=None, response_deserializer=None)
        call(pb.SetKeyRequest(job_id=job_id, key=key, value=b"1").SerializeToString(), timeout=10, metadata=metadata)


@contextlib.contextmanager
def held_job(
    address: str,
    world_size: int = 2,
    *,
    token: str | None = TOKEN,
    tls: TlsFiles | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, list[common_pb2.Member], Future[JobResult]]]:
    """A job whose ranks wait (peer endpoints up) until the block ends, then run one all_reduce.

    Yields the job id, the member table and the future of :func:`run_ranks` (resolved after the block).
    """
    job_id = f"held-{threading.get_ident()}-{time.monotonic_ns()}"
    key = "release"
    pool = ThreadPoolExecutor(1)
    future = pool.submit(
        run_ranks, ranks.hold_then_all_reduce, world_size, address=address, args=(key,), env=env, job_id=job_id,
        timeout=90,
    )  # fmt: skip
    try:
        table = members(address, job_id, token=token, tls=tls)
        yield job_id, table, future
    finally:
        release(address, job_id, key, token=token, tls=tls)
        future.result(timeout=120)
        pool.shutdown()


def expected_sum(world_size: int) -> list[float]:
    return [float(i * world_size + world_size * (world_size - 1) // 2) for i in range(4)]
