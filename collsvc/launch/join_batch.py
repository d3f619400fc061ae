"""The gRPC side of the launcher's join relay (``collsvc.launch.join_relay``): one JoinBatch, its answers.

Loaded with the relay's first batch, once the ranks run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from collsvc.client.coordinator_channel import make_channel
from collsvc.client.join_relay import error_frame
from collsvc.client.relay_wire import ERROR, OK
from collsvc.client.rendezvous import SERVER_WAIT_MARGIN
from collsvc.options import TlsFiles
from collsvc.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


class BatchSender:
    """Sends gathered JoinRequests in one JoinBatch and turns the outcome into each rank's answer.

    Args:
        coordinator: ``host:port`` of the coordinator.
        token: the job token, or None.
        tls: client TLS files, or None.
        clock: ``time.monotonic`` or a stand-in.
    """

    def __init__(
        self, coordinator: str, token: str | None, tls: TlsFiles | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = make_channel(coordinator, tls)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._clock = clock
        self._connecting = grpc.channel_ready_future(self._channel)  # dials now, not with the first batch

    def close(self) -> None:
        self._connecting.cancel()
        self._channel.close()

    def answers(self, requests: list[coordinator_pb2.JoinRequest]) -> list[list[bytes]]:
        """The frames to answer each request with, in order: ``ok`` and its JoinResponse and the member
        table; ``error`` and the batch's gRPC status; or none (the rank then joins by itself: the
        coordinator has no JoinBatch, or the relay itself failed)."""
        try:
            answers = self._join(requests)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            if code == grpc.StatusCode.UNIMPLEMENTED:  # a coordinator older than JoinBatch
                log.info("join relay: the coordinator has no JoinBatch; the ranks join by themselves")
                return [[] for _ in requests]
            details = exc.details() if hasattr(exc, "details") else str(exc)
            trailing = tuple(exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else ()
            failed = [ERROR, error_frame(code, details or "", trailing)]
            return [failed for _ in requests]
        except Exception:  # noqa: BLE001 - a fault of the relay itself: each rank joins by itself
            log.exception("join relay: a batch of %d ranks failed; they join by themselves", len(requests))
            return [[] for _ in requests]
        log.info("join relay: joined %d ranks of job %r in one call", len(requests), requests[0].job_id)
        return answers

    def _join(self, requests: list[coordinator_pb2.JoinRequest]) -> list[list[bytes]]:
        """JoinBatch (sent again while the coordinator restarts), then the member table once (an empty
        frame when that fails: each rank then asks for it).

        Raises:
            grpc.RpcError: the coordinator's answer to JoinBatch.
        """
        deadline = self._clock() + max(r.timeout_s for r in requests) + SERVER_WAIT_MARGIN
        request = coordinator_pb2.JoinBatchRequest(members=requests)
        while True:
            remaining = max(deadline - self._clock(), 0.01)
            try:
                reply = self._stub.JoinBatch(request, timeout=remaining, metadata=self._metadata, wait_for_ready=True)
                break
            except grpc.RpcError as exc:
                # Same requests, same idempotency keys: a coordinator that kept them finds the same members.
                if exc.code() != grpc.StatusCode.UNAVAILABLE or self._clock() >= deadline:
                    raise
        try:
            members = self._stub.GetMembers(
                coordinator_pb2.GetMembersRequest(job_id=requests[0].job_id), timeout=30.0, metadata=self._metadata
            ).SerializeToString()
        except grpc.RpcError as exc:  # the ranks are joined: each asks for the table itself
            log.info("join relay: could not fetch the member table (%s)", exc.code().name)
            members = b""
        return [[OK, joined.SerializeToString(), members] for joined in reply.members]
