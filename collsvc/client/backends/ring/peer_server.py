"""This rank's peer endpoint: the gRPC server that takes frames from its peers (``Deliver``) and hands
out tickets to its bulk lane (``Lane``, see ``lane_wire.py``)."""

from __future__ import annotations

import hmac
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from collsvc.client.backends.grpc_options import message_options, ping_permit_options, server_credentials
from collsvc.client.backends.ring import frames
from collsvc.client.backends.ring.lane_receiver import LaneListener
from collsvc.client.backends.ring.lane_wire import OFFER
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.options import TlsFiles

log = logging.getLogger(__name__)

SERVICE = "collsvc.proto.v1.Peer"


class PeerServer:
    """Serves this rank's peer endpoint and deposits arriving frames into ``mailbox``.

    With a token, every call must carry ``authorization: Bearer <token>``; the check is a constant-time
    compare done before the frame is decoded. With ``lane_port`` (0: any free port), a bulk lane
    listens beside it on the same host and ``Lane`` hands its tickets to authorized peers; where that
    port cannot be bound the endpoint offers no lane (a warning says so) and its peers use gRPC.

    Raises:
        OSError: the address could not be bound.
    """

    def __init__(
        self,
        bind_host: str,
        port: int,
        mailbox: Mailbox,
        *,
        token: str | None,
        tls: TlsFiles | None,
        max_message_bytes: int,
        lane_port: int | None = None,
    ) -> None:
        self._mailbox = mailbox
        self._expected = f"Bearer {token}".encode() if token else None
        self._max_payload = max_message_bytes
        options = [("grpc.so_reuseport", 0), *message_options(max_message_bytes + 8192), *ping_permit_options()]
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=8, thread_name_prefix="collsvc-peer"), options=options
        )
        handlers = {
            "Deliver": grpc.unary_unary_rpc_method_handler(self._deliver),
            "Lane": grpc.unary_unary_rpc_method_handler(self._offer_lane),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        address = f"[{bind_host}]:{port}" if ":" in bind_host else f"{bind_host}:{port}"
        try:
            if tls is not None:
                bound = self._server.add_secure_port(address, server_credentials(tls))
            else:
                bound = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"cannot bind the peer endpoint to {address}: {exc}") from exc
        if not bound:
            raise OSError(f"cannot bind the peer endpoint to {address}: address in use or unavailable")
        self.port: int = bound
        self._lane = self._listen(bind_host, lane_port, mailbox, max_message_bytes) if lane_port is not None else None
        self._server.start()

    def _authorized(self, context: grpc.ServicerContext) -> bool:
        if self._expected is None:
            return True
        for key, value in context.invocation_metadata():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    def _deliver(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        if not self._authorized(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "peer call denied: missing or wrong job token")
        try:
            header, payload = frames.decode(request, self._max_payload)
        except frames.FrameError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._mailbox.deposit(header, payload)
        return b""

    @staticmethod
    def _listen(bind_host: str, port: int, mailbox: Mailbox, max_payload: int) -> LaneListener | None:
        try:
            return LaneListener(bind_host, port, mailbox, max_payload)
        except OSError as exc:
            log.warning("no bulk lane: cannot listen on %s port %d (%s); peers send over gRPC", bind_host, port, exc)
            return None

    def _offer_lane(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """The lane's port and a ticket for the asking rank; empty where this endpoint offers no lane."""
        if not self._authorized(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "peer call denied: missing or wrong job token")
        if len(request) != 4:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a lane request is the asking rank (4 bytes)")
        if self._lane is None:
            return b""
        return OFFER.pack(self._lane.port, self._lane.ticket(int.from_bytes(request, "little", signed=True)))

    def stop(self, grace: float = 0.5) -> None:
        if self._lane is not None:
            self._lane.close()
        self._server.stop(grace).wait(grace + 1.0)
