"""The client side of the coordinator: every control-plane RPC, each with a deadline.

All ``grpc.RpcError`` translation for coordinator calls happens in :meth:`CoordinatorClient._call`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import grpc

from collsvc.client.backends.ring.grpc_transport import channel_credentials
from collsvc.errors import AuthenticationError, CollectiveTimeoutError, error_from_rpc
from collsvc.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from collsvc.types import TlsFiles

log = logging.getLogger(__name__)

# Ranks often dial before the coordinator listens; gRPC's default 1 s reconnect backoff would dominate
# start-up, so retry quickly (measured: 1.3 s -> 0.4 s to the first barrier).
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
]

# Extra seconds the client waits beyond a server-side wait, so the server's answer wins the race.
SERVER_WAIT_MARGIN = 5.0

# The standard health service answers without a token; an empty body asks about the whole server.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# gRPC's words for a TLS refusal: this side's handshake failed, or the server accepted the TCP
# connection and closed it (it refused our certificate, our lack of one, or our plaintext).
_TLS_REFUSAL_WORDS = ("handshake", "socket closed")


def make_channel(address: str, tls: TlsFiles | None) -> grpc.Channel:
    """A channel to the coordinator (mutual TLS when ``tls`` is given)."""
    if tls is not None:
        return grpc.secure_channel(address, channel_credentials(tls), options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def waiting_from_proto(entries: Any) -> list[dict[str, Any]]:
    return [{"rank": w.rank, "host": w.host, "last_op": w.last_op, "finished_seq": w.finished_seq} for w in entries]


class CoordinatorClient:
    """Blocking calls to one coordinator for one job.

    Every method raises the collsvc error the coordinator named (see ``collsvc.errors``), or
    :class:`~collsvc.errors.RendezvousError` when the coordinator cannot be reached in time.
    """

    def __init__(self, address: str, job_id: str, *, token: str | None, tls: TlsFiles | None, timeout: float) -> None:
        self.address = address
        self.job_id = job_id
        self.timeout = timeout
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.tls = tls
        self.channel = make_channel(address, tls)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.rank: int | None = None
        self.member_secret = ""

    def _call(self, method: str, request: Any, what: str, *, timeout: float | None = None, wait: bool = False) -> Any:
        try:
            return getattr(self.stub, method)(
                request, timeout=timeout or self.timeout, metadata=self.metadata, wait_for_ready=wait
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"{what} (coordinator {self.address}, job '{self.job_id}')") from exc

    def join(
        self,
        *,
        world_size: int,
        rank: int | None,
        host: str,
        peer_address: str,
        device: common_pb2.DeviceIdentity,
        pid: int,
        local_rank_hint: int | None,
    ) -> coordinator_pb2.JoinResponse:
        """Joins the job, waiting for the coordinator to come up and for every member to join."""
        request = coordinator_pb2.JoinRequest(
            job_id=self.job_id,
            world_size=world_size,
            host=host,
            peer_address=peer_address,
            device=device,
            pid=pid,
            timeout_s=self.timeout,
        )
        if rank is not None:
            request.requested_rank = rank
        if local_rank_hint is not None:
            request.local_rank_hint = local_rank_hint
        self._check_handshake()
        reply = self._call("Join", request, "join", timeout=self.timeout + SERVER_WAIT_MARGIN, wait=True)
        self.rank = reply.rank
        self.member_secret = reply.member_secret
        return reply  # type: ignore[no-any-return]

    def _check_handshake(self, attempts: int = 3) -> None:
        """Fails fast when the coordinator is up but refuses this client's TLS (or its lack of TLS).

        Join waits for the coordinator to come up (wait_for_ready), so a refused handshake would look
        like an absent coordinator until the whole timeout passed. A few fail-fast calls to the health
        service tell them apart: "connection refused" means not up yet (Join then waits), while a
        handshake error or an accepted-then-closed connection every time means TLS is refused.

        Raises:
            AuthenticationError: every attempt failed the way a TLS refusal does.
        """
        probe = self.channel.unary_unary(HEALTH_CHECK, request_serializer=None, response_deserializer=None)
        detail = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(0.05)
            try:
                probe(b"", timeout=min(self.timeout, 5.0))
                return
            except grpc.RpcError as exc:
                detail = (exc.details() if hasattr(exc, "details") else "") or ""
                if exc.code() != grpc.StatusCode.UNAVAILABLE or not any(
                    word in detail.lower() for word in _TLS_REFUSAL_WORDS
                ):
                    return  # up (or not up yet): Join reports or waits as usual
        hint = (
            "the coordinator presumably requires mutual TLS: set COLLSVC_TLS_CERT, COLLSVC_TLS_KEY and COLLSVC_TLS_CA"
            if self.tls is None
            else "check that this rank's certificate is signed by the CA the coordinator trusts, that "
            "COLLSVC_TLS_CA verifies the coordinator's certificate, and that the coordinator serves TLS"
        )
        raise AuthenticationError(f"TLS refused by coordinator {self.address} (job '{self.job_id}'): {hint} ({detail})")

    def members(self) -> list[common_pb2.Member]:
        reply = self._call("GetMembers", coordinator_pb2.GetMembersRequest(job_id=self.job_id), "get members")
        return list(reply.members)

    def barrier(self, group: str, rank: int, generation: int, timeout: float) -> None:
        """Waits until every member of ``group`` entered barrier ``generation``.

        Raises:
            CollectiveTimeoutError: ``timeout`` passed; ``waiting_on`` names who never arrived.
        """
        request = coordinator_pb2.BarrierRequest(
            job_id=self.job_id,
            group=group,
            rank=rank,
            generation=generation,
            timeout_s=timeout,
            member_secret=self.member_secret,
        )
        reply = self._call(
            "Barrier",
            request,
            f"barrier #{generation} of group '{group}'",
            timeout=timeout + SERVER_WAIT_MARGIN,
        )
        if not reply.complete:
            waiting = waiting_from_proto(reply.waiting_on)
            ranks = [w["rank"] for w in waiting]
            raise CollectiveTimeoutError(
                f"barrier #{generation} of group '{group}' timed out after {timeout:g}s on rank {rank}; "
                f"waiting on ranks {ranks}",
                waiting,
            )

    def progress(self, group: str, seq: int) -> list[dict[str, Any]]:
        """Members of ``group`` that have not started call ``seq``, with their last completed op."""
        request = coordinator_pb2.GetProgressRequest(job_id=self.job_id, group=group, seq=seq)
        reply = self._call("GetProgress", request, "get progress", timeout=min(self.timeout, 5.0))
        return waiting_from_proto(reply.not_started)

    def set(self, key: str, value: bytes) -> None:
        self._call(
            "SetKey",
            coordinator_pb2.SetKeyRequest(job_id=self.job_id, key=key, value=value),
            f"set key {key!r}",
        )

    def get(self, key: str, timeout: float) -> bytes:
        """Waits up to ``timeout`` for ``key``.

        Raises:
            CollectiveTimeoutError: the key was not set in time.
        """
        request = coordinator_pb2.GetKeyRequest(job_id=self.job_id, key=key, wait=True, timeout_s=timeout)
        reply = self._call("GetKey", request, f"get key {key!r}", timeout=timeout + SERVER_WAIT_MARGIN)
        if not reply.found:
            raise CollectiveTimeoutError(f"key {key!r} was not set within {timeout:g}s")
        return bytes(reply.value)

    def add(self, key: str, amount: int) -> int:
        reply = self._call(
            "AddKey",
            coordinator_pb2.AddKeyRequest(job_id=self.job_id, key=key, amount=amount),
            f"add {key!r}",
        )
        return int(reply.value)

    def new_group(self, name: str, ranks: list[int]) -> None:
        self._call(
            "NewGroup",
            coordinator_pb2.NewGroupRequest(job_id=self.job_id, name=name, ranks=ranks),
            f"new group {name!r}",
        )

    def find_group(self, name: str) -> list[int]:
        reply = self._call(
            "FindGroup",
            coordinator_pb2.FindGroupRequest(job_id=self.job_id, name=name),
            f"find group {name!r}",
        )
        return list(reply.ranks) if reply.found else []

    def report(
        self, kind: int, reason: str, details: dict[str, Any] | None = None, ranks: list[int] | None = None
    ) -> None:
        """Tells the coordinator about a failure so that it reaches every member (best effort, short deadline)."""
        request = coordinator_pb2.ReportFailureRequest(
            job_id=self.job_id,
            rank=self.rank if self.rank is not None else -1,
            member_secret=self.member_secret,
            kind=kind,  # type: ignore[arg-type]
            reason=reason,
            details_json=json.dumps(details or {}),
            ranks=ranks or [],
        )
        try:
            self._call("ReportFailure", request, "report failure", timeout=min(self.timeout, 5.0))
        except Exception as exc:  # noqa: BLE001 - reporting must never mask the error being reported
            log.warning("job %s rank %s: could not report failure to the coordinator: %s", self.job_id, self.rank, exc)

    def leave(self, progress: Iterable[common_pb2.Progress] = ()) -> None:
        """Leaves the job cleanly (best effort, short deadline), telling the coordinator the final
        ``progress`` so the others fail at once whatever call this member never finished."""
        if self.rank is None:
            return
        request = coordinator_pb2.LeaveRequest(
            job_id=self.job_id, rank=self.rank, member_secret=self.member_secret, progress=list(progress)
        )
        deadline = time.monotonic() + min(self.timeout, 5.0)
        try:
            self._call("Leave", request, "leave", timeout=max(deadline - time.monotonic(), 0.1))
        except Exception as exc:  # noqa: BLE001 - leaving is best effort; the coordinator also sees the stream end
            log.info("job %s rank %s: leave was not acknowledged: %s", self.job_id, self.rank, exc)

    def close(self) -> None:
        self.channel.close()
