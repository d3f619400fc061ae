"""The gRPC data-plane transport: each rank serves a peer endpoint and sends raw frames to the others.

Payloads are never copied into protobuf messages: ``Deliver`` is a raw-bytes unary method (identity
serializers) whose request is one frame (``frames.py``). A send is an asynchronous call (``future``),
so a rank sends its next chunk while the previous one is in flight; frames are deposited in the
receiver's :class:`Mailbox` on arrival, whether or not the receiver already asked for them.

Where both ends allow it (no TLS, ``COLLSVC_TCP_LANE`` not ``0``), frames take a bulk lane instead: a
plain TCP connection per peer that the peers negotiate over this endpoint (``Lane``, see
``lane_wire.py``); gRPC itself moves at most about half of what the link carries (docs/performance.md).
A lane's sends complete and fail like gRPC calls, so the ring does not know which road a frame took.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, NoReturn, TypeAlias

import grpc

from collsvc.client.backends.base import Call
from collsvc.client.backends.base import mismatch_error as calls_mismatch
from collsvc.client.backends.grpc_options import (
    PEER_DEAD_AFTER,
    PEER_PING_EVERY,
    channel_credentials,
    keepalive_options,
    message_options,
)
from collsvc.client.backends.ring import frames
from collsvc.client.backends.ring.lane_sender import DELIVERED
from collsvc.client.backends.ring.lane_wire import LaneError
from collsvc.client.backends.ring.lanes import Lanes
from collsvc.client.backends.ring.local_frames import LocalFrames
from collsvc.client.backends.ring.mailbox import FrameKey, Mailbox
from collsvc.client.backends.ring.peer_server import SERVICE
from collsvc.errors import (
    AuthenticationError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CollsvcError,
    RankFailedError,
)
from collsvc.options import TlsFiles

log = logging.getLogger(__name__)

DELIVER = f"/{SERVICE}/Deliver"
LANE = f"/{SERVICE}/Lane"


# How long a rank whose delivery was refused waits for the coordinator's news of that peer (a clean
# departure names what had failed its job) before the refusal itself becomes the failure.
DEPARTURE_NEWS_GRACE = 2.0


def _send_error(code: grpc.StatusCode, details: str, rank: int, host: str, address: str) -> CollsvcError:
    what = f"sending to rank {rank} at {address} failed ({code.name}): {details}"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(what)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CollectiveTimeoutError(what, [{"rank": rank, "host": host}])
    return RankFailedError(what, [rank], [host], unreachable=True)


# A send in flight: a gRPC call's future, or a lane send's (failing with a LaneError that carries the
# gRPC status the same failure has on gRPC).
Delivery: TypeAlias = "grpc.Future[bytes] | Future[bytes]"


def refused(future: Delivery) -> bool:
    """Whether a finished send failed because nothing answered at the peer's address (its process or
    endpoint is gone), rather than an error the peer returned."""
    if not future.done() or future.cancelled():
        return False
    exc = future.exception()
    return exc is not None and hasattr(exc, "code") and exc.code() == grpc.StatusCode.UNAVAILABLE


class GrpcTransport:
    """Outgoing channels to every peer (opened lazily) plus the local mailbox."""

    def __init__(
        self,
        rank: int,
        addresses: Mapping[int, str],
        hosts: Mapping[int, str],
        mailbox: Mailbox,
        *,
        token: str | None,
        tls: TlsFiles | None,
        max_message_bytes: int,
        local_frames: LocalFrames | None = None,
        lane: bool = False,
    ) -> None:
        self.rank = rank
        self.mailbox = mailbox
        #: frames to ranks of this host through shared memory (those it takes); closed with the transport
        self.local_frames = local_frames
        self._addresses = dict(addresses)
        self._hosts = dict(hosts)
        self._tls = tls
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._max_payload = max_message_bytes
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}
        self._senders: dict[int, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self._lane_askers: dict[int, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        #: bulk lanes to peers that offer one (None: every frame goes over gRPC)
        self.lanes = Lanes(rank, self._addresses, self._ask_lane, self._lane_broken) if lane and tls is None else None

    def _lane_broken(self, rank: int, error: LaneError) -> None:
        """A lane to global ``rank`` ended while no send was on it: read as a refused delivery (the
        departure of a peer that left cleanly explains it, see :meth:`Mailbox.unreachable`)."""
        if not self.mailbox.has_departed(rank):
            failure = _send_error(error.code(), error.details(), rank, self._hosts.get(rank, ""), self._addresses[rank])
            self.mailbox.unreachable(rank, failure, DEPARTURE_NEWS_GRACE)

    def _ask_lane(self, rank: int, request: bytes, timeout: float) -> bytes:
        self._sender(rank)
        answer: bytes = self._lane_askers[rank](request, timeout=timeout, metadata=self._metadata)
        return answer

    def _sender(self, rank: int) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
        sender = self._senders.get(rank)
        if sender is not None:
            return sender
        with self._lock:
            if rank not in self._senders:
                address = self._addresses[rank]
                options = [
                    *message_options(self._max_payload + 8192),
                    *keepalive_options(PEER_PING_EVERY, PEER_DEAD_AFTER, idle=False),
                ]
                if self._tls is not None:
                    channel = grpc.secure_channel(address, channel_credentials(self._tls), options=options)
                else:
                    channel = grpc.insecure_channel(address, options=options)
                self._channels[rank] = channel
                self._senders[rank] = channel.unary_unary(DELIVER, request_serializer=None, response_deserializer=None)
                self._lane_askers[rank] = channel.unary_unary(LANE, request_serializer=None, response_deserializer=None)
            return self._senders[rank]

    def channel(self, call: Call) -> GrpcChannel:
        """A :class:`~collsvc.client.backends.base.Channel` for one call."""
        return GrpcChannel(self, call)

    def send_frame(
        self,
        dst: int,
        header: bytes,
        payload: memoryview,
        deadline: float,
        on_error: Callable[[CollsvcError, bool], None],
    ) -> Delivery:
        """Starts delivering a frame to global rank ``dst`` (over its lane if it has one); returns the
        send's future.

        Raises:
            BaseException: the failure recorded in the mailbox while a lane write waited on the peer.
        """
        lane = self.lanes.to(dst, deadline) if self.lanes is not None else None
        future: Delivery
        if lane is not None:
            future = lane.send(header, payload, deadline, self.mailbox.recorded_failure)
            if future is DELIVERED:
                return future  # the kernel took it: nothing can fail it any more
        else:
            timeout = max(deadline - time.monotonic(), 0.001)
            data = b"".join((header, payload))
            future = self._sender(dst).future(data, timeout=timeout, metadata=self._metadata)

        def done(fut: Delivery) -> None:
            error = self.delivery_error(dst, fut)
            if error is not None:
                on_error(error, refused(fut))

        future.add_done_callback(done)
        return future

    def delivery_error(self, dst: int, future: Delivery) -> CollsvcError | None:
        """The error a finished send to global rank ``dst`` ended with; None if delivered or cancelled."""
        if not future.done() or future.cancelled():
            return None
        exc = future.exception()
        if exc is None:
            return None
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return _send_error(code, details or "", dst, self._hosts.get(dst, ""), self._addresses[dst])

    def drain(self, timeout: float) -> None:
        """Before a clean leave: waits (at most ``timeout`` s) until the frames sent over lanes are in
        their receivers' mailboxes, as a gRPC send is once it completed; a peer told that this member
        left then finds every frame it sent. A peer that does not confirm in time is not waited for."""
        if self.lanes is not None and not self.lanes.drain(timeout):
            log.info("rank %d: not every bulk lane confirmed its frames within %.0f s", self.rank, timeout)

    def close(self) -> None:
        if self.local_frames is not None:
            self.local_frames.close()
        if self.lanes is not None:
            self.lanes.close()
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._senders.clear()


class GrpcChannel:
    """Frames of one call over the gRPC transport (ranks are group indices)."""

    def __init__(self, transport: GrpcTransport, call: Call) -> None:
        self._transport = transport
        self._call = call
        self._ranks = call.group.ranks
        self._key = frames.key_hash(call.key)
        self._signature = call.signature.encode()
        self._digest = call.signature.digest
        self._pending: list[tuple[int, Delivery]] = []  # (global rank, send in flight)
        self._error: CollsvcError | None = None
        self._refused_by: int | None = None  # the peer whose refusal is self._error, until explained
        self._landing: list[FrameKey] = []  # frames declared by land(), withdrawn by close()

    @property
    def rank(self) -> int:
        return self._call.group.index

    @property
    def size(self) -> int:
        return self._call.group.size

    def _record(self, error: CollsvcError, refused: bool = False) -> None:
        failed = error.ranks if isinstance(error, RankFailedError) else []
        peer = failed[0] if failed else None
        if self._error is None:
            self._error = error
            if refused:
                self._refused_by = peer
        mailbox = self._transport.mailbox
        if failed and all(map(mailbox.has_departed, failed)):
            return  # the peer left cleanly: only this call fails (flush raises), other groups go on
        if refused and peer is not None:
            # The peer's process is gone. If it left the job, the coordinator knew before its endpoint
            # closed, and that news names the cause: wait for it a little before failing every waiter.
            mailbox.unreachable(peer, error, DEPARTURE_NEWS_GRACE)
            return
        # A failed delivery means the peer is unreachable: wake this rank's waiters now.
        mailbox.fail(error)

    def _raise_recorded(self) -> NoReturn:
        """Raises this call's recorded delivery error, or what the coordinator said it stands for."""
        error = self._error
        assert error is not None
        if self._refused_by is not None:
            waiter = (self._call.progress_stream, self._call.seq, self._call.all_members)
            explained = self._transport.mailbox.explain(self._refused_by, waiter)
            if explained is not None:
                raise explained
        raise error

    def send(self, dst: int, step: int, payload: memoryview | bytes) -> None:
        if self._error is not None:
            self._raise_recorded()
        view = memoryview(payload).cast("B")
        header = frames.encode_header(
            self._transport.rank, self._key, self._call.seq, step, self._digest, self._signature, view.nbytes
        )
        target = self._ranks[dst]
        local = self._transport.local_frames
        if local is not None and local.send(target, (header, view), len(header) + view.nbytes):
            return  # in the receiver's ring: delivered, nothing to wait for in flush()
        future = self._transport.send_frame(target, header, view, self._call.deadline, self._record)
        if future is not DELIVERED:  # a lane send that succeeded has nothing left for flush() to check
            self._pending.append((target, future))

    def recv(self, src: int, step: int) -> memoryview:
        src_rank = self._ranks[src]
        key = (self._key, self._call.seq, step, src_rank)
        waiter = (self._call.progress_stream, self._call.seq, self._call.all_members)
        taken = self._transport.mailbox.take(key, self._call.deadline, self._digest, waiter)
        if taken is None:
            raise CollectiveTimeoutError(
                f"{self._call.signature.op} #{self._call.seq} in group '{self._call.group.name}': "
                f"no data from rank {src_rank} before the timeout",
                [{"rank": src_rank}],
            )
        header, payload = taken
        if header.digest != self._digest:  # header.src: the mailbox may hand over another peer's frame
            raise mismatch_error(self._call, self._transport.rank, header.src, header.signature)
        return payload

    def land(self, src: int, step: int, into: memoryview) -> None:
        """Lets the frame be read straight into ``into`` where it comes over a lane (see
        ``landings.py``); frames over gRPC or shared memory arrive in their own buffers."""
        if self._transport.lanes is None:
            return
        key = (self._key, self._call.seq, step, self._ranks[src])
        self._landing.append(key)
        self._transport.mailbox.landings.expect(key, into, self._digest)

    def close(self) -> None:
        if self._landing:
            landing, self._landing = self._landing, []
            self._transport.mailbox.landings.withdraw(landing)

    def flush(self) -> None:
        """Waits until every frame this call sent was delivered.

        The wait ends early when this process records a failure (a coordinator event, a lost
        coordinator): a send to a peer on a dead path would otherwise hold this rank until the
        call's deadline. Sends still in flight then are cancelled.

        Raises:
            CollsvcError: a delivery failed, a failure was recorded meanwhile, or the deadline passed
                (:class:`~collsvc.errors.CollectiveTimeoutError`).
        """
        pending, self._pending = self._pending, []
        in_flight = [future for _, future in pending if not future.done()]
        if in_flight:  # usually every send was delivered already and there is nothing to wait for
            self._await_delivery(in_flight)
        # The send callbacks record failures, but a future can be done before its callbacks ran.
        for dst, future in pending:
            error = self._transport.delivery_error(dst, future)
            if error is not None:
                self._record(error, refused(future))
        if self._error is not None:
            self._raise_recorded()

    def _await_delivery(self, in_flight: list[Delivery]) -> None:
        """Waits for sends in flight; a failure recorded meanwhile ends the wait and cancels them.

        Raises:
            BaseException: the failure recorded in the mailbox meanwhile.
            CollectiveTimeoutError: the call's deadline passed first.
        """
        mailbox = self._transport.mailbox
        landed: list[Delivery] = []

        def on_landed(future: Delivery) -> None:
            landed.append(future)  # list.append is atomic; the waiter reads len() after wake() locked
            mailbox.wake()

        for future in in_flight:
            future.add_done_callback(on_landed)  # runs at once for a send delivered meanwhile
        try:
            delivered = mailbox.wait_until(lambda: len(landed) == len(in_flight), self._call.deadline)
        except BaseException:
            for future in in_flight:
                future.cancel()
            raise
        if not delivered:
            for future in in_flight:
                future.cancel()
            raise CollectiveTimeoutError(
                f"{self._call.signature.op} #{self._call.seq}: a send was not delivered before the timeout"
            )


def mismatch_error(call: Call, my_rank: int, other_rank: int, other_signature: bytes) -> CollectiveMismatchError:
    """The error for a frame whose sender called something else at the same sequence number."""
    import json

    try:
        theirs: Any = json.loads(other_signature.decode()) if other_signature else "unknown"
    except ValueError:
        theirs = "unreadable"
    return calls_mismatch(call, {my_rank: call.signature.describe(), other_rank: theirs})
