"""Joining through the host's launcher: one JoinBatch for the ranks of a host instead of a Join each.

``collsvc run`` serves a relay on an abstract Unix socket and names it, with a secret, in
``COLLSVC_JOIN_RELAY`` (``NAME:SECRET``). A rank sends its JoinRequest there; the launcher joins the
ranks of its host in one JoinBatch call, fetches the member table once, and answers each rank with
its JoinResponse and that table (or with the coordinator's error, which the rank raises as if its own
call had failed). At scale this is what the coordinator's cost hangs on: gRPC's own cost per call is
most of a Join. The launcher side is :mod:`collsvc.launch.join_relay`.

The wire is in :mod:`collsvc.client.relay_wire`.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from collsvc.client.relay_wire import (
    ERROR,
    SEND_TIMEOUT,
    RelayClosed,
    parse_relay,
    receive_frame,
    send_frames,
)
from collsvc.errors import RendezvousError
from collsvc.proto.v1 import coordinator_pb2


def error_frame(code: grpc.StatusCode, details: str, metadata: Sequence[Any]) -> bytes:
    """The JSON frame of a failed batch, from its gRPC status (``metadata``: its trailing metadata)."""
    pairs = [[str(k), v if isinstance(v, str) else bytes(v).decode("utf-8", "replace")] for k, v in metadata]
    return json.dumps({"code": code.name, "details": details, "metadata": pairs}).encode()


class RelayedRpcError(grpc.RpcError):
    """The status the coordinator answered the launcher's JoinBatch with, as this rank's own call's."""

    def __init__(self, frame: bytes) -> None:
        status = json.loads(frame)
        self._code = getattr(grpc.StatusCode, str(status.get("code")), grpc.StatusCode.UNKNOWN)
        self._details = str(status.get("details", ""))
        self._metadata = tuple((str(k), str(v)) for k, v in status.get("metadata", []))
        super().__init__(self._details)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return self._metadata


@dataclass(frozen=True)
class RelayedJoin:
    """What the launcher answered: this rank's JoinResponse and the job's member table (None when the
    launcher could not fetch it)."""

    join: coordinator_pb2.JoinResponse
    members: coordinator_pb2.GetMembersResponse | None


def join_through_relay(
    relay: str, request: coordinator_pb2.JoinRequest, deadline: float, on_wait: Callable[[], None], interval: float
) -> RelayedJoin | None:
    """Joins through the launcher's relay ``relay`` (``NAME:SECRET``).

    Args:
        relay: the value of ``COLLSVC_JOIN_RELAY``.
        request: this rank's JoinRequest.
        deadline: ``time.monotonic()`` after which to stop waiting for the answer.
        on_wait: called every ``interval`` seconds while the answer is awaited (to log who is missing).
        interval: seconds between calls of ``on_wait``.

    Returns:
        The answer; None when no relay took the request or it went away without answering (the caller
        joins by itself with the same request: its idempotency key finds a member the batch made).

    Raises:
        grpc.RpcError: the coordinator refused or failed the batch (a :class:`RelayedRpcError`).
        RendezvousError: ``deadline`` passed without an answer.
    """
    parsed = parse_relay(relay)
    if parsed is None:
        return None
    name, secret = parsed
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(SEND_TIMEOUT)
        try:
            sock.connect("\0" + name)
            send_frames(sock, [secret.encode(), request.SerializeToString()])
        except OSError:
            return None
        try:
            kind = _frame_by(sock, deadline, on_wait, interval)
            if kind == ERROR:
                raise RelayedRpcError(receive_frame(sock))
            join = coordinator_pb2.JoinResponse.FromString(receive_frame(sock))
            table = receive_frame(sock)  # empty when the launcher could not fetch it
            members = coordinator_pb2.GetMembersResponse.FromString(table) if table else None
        except (RelayClosed, OSError):
            return None
        return RelayedJoin(join, members)
    finally:
        sock.close()


def _frame_by(sock: socket.socket, deadline: float, on_wait: Callable[[], None], interval: float) -> bytes:
    """The first frame of the answer, calling ``on_wait`` every ``interval`` seconds meanwhile.

    Raises:
        RendezvousError: ``deadline`` passed first.
        RelayClosed: the relay went away.
    """
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RendezvousError("the launcher (collsvc run) did not answer this rank's join in time")
        readable, _, _ = select.select([sock], [], [], min(remaining, interval))
        if not readable:
            on_wait()
            continue
        sock.settimeout(SEND_TIMEOUT)  # the answer comes in one piece: a stall now is a broken relay
        try:
            return receive_frame(sock)
        except OSError as exc:
            raise RelayClosed(str(exc)) from exc
