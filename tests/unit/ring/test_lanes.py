"""The bulk lane between two peer endpoints of this process, on loopback: real gRPC, real sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import grpc
import numpy as np
import pytest

from collsvc.client.backends.ring import frames
from collsvc.client.backends.ring.grpc_transport import GrpcTransport, refused
from collsvc.client.backends.ring.lane_sender import LaneConnection, open_lane
from collsvc.client.backends.ring.lane_wire import LaneError
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.client.backends.ring.peer_server import PeerServer
from collsvc.errors import AuthenticationError, CollectiveTimeoutError, RankFailedError

TOKEN = "lane-test-token"
LIMIT = 64 << 20


class Peer:
    def __init__(self, rank: int, *, lane: bool, token: str | None = TOKEN) -> None:
        self.rank = rank
        self.mailbox = Mailbox()
        self.server = PeerServer(
            "127.0.0.1", 0, self.mailbox, token=token, tls=None, max_message_bytes=LIMIT, lane_port=0 if lane else None
        )
        self.address = f"127.0.0.1:{self.server.port}"


@pytest.fixture
def pair() -> Iterator[tuple[Peer, Peer]]:
    made = (Peer(0, lane=True), Peer(1, lane=True))
    yield made
    for peer in made:
        peer.server.stop(0)


def transport_of(peer: Peer, other: Peer, *, lane: bool = True, token: str = TOKEN) -> GrpcTransport:
    return GrpcTransport(
        peer.rank,
        {other.rank: other.address},
        {other.rank: "here"},
        peer.mailbox,
        token=token,
        tls=None,
        max_message_bytes=LIMIT,
        lane=lane,
    )


def send(transport: GrpcTransport, dst: int, step: int, payload: bytes, deadline: float = 10.0):  # type: ignore[no-untyped-def]
    header = frames.encode_header(transport.rank, 7, 1, step, 99, b'{"op":"t"}', len(payload))
    errors: list[object] = []
    future = transport.send_frame(
        dst, header, memoryview(payload), time.monotonic() + deadline, lambda e, r: errors.append(e)
    )
    return future, errors


def test_frames_take_the_lane_and_land_in_the_mailbox(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    transport = transport_of(a, b)
    try:
        payloads = [np.arange(n, dtype=np.float32).tobytes() for n in (0, 1, 1000, 3 << 20)]
        futures = [send(transport, 1, step, data)[0] for step, data in enumerate(payloads)]
        for future in futures:
            assert future.result(timeout=10) == b""
        assert transport.lanes is not None and transport.lanes.to(1, time.monotonic() + 5) is not None
        for step, data in enumerate(payloads):
            taken = b.mailbox.take((7, 1, step, 0), time.monotonic() + 5)
            assert taken is not None
            header, payload = taken
            assert (header.src, header.digest, header.signature.strip()) == (0, 99, b'{"op":"t"}')
            assert bytes(payload) == data
    finally:
        transport.close()


def test_a_peer_without_a_lane_gets_its_frames_over_grpc() -> None:
    a, b = Peer(0, lane=True), Peer(1, lane=False)
    transport = transport_of(a, b)
    try:
        future, errors = send(transport, 1, 0, b"x" * 5000)
        assert future.result(timeout=10) == b"" and not errors
        assert transport.lanes is not None and transport.lanes.to(1, time.monotonic() + 5) is None
        assert b.mailbox.take((7, 1, 0, 0), time.monotonic() + 5) is not None
    finally:
        transport.close()
        a.server.stop(0)
        b.server.stop(0)


def test_a_wrong_token_gets_no_lane_and_an_authentication_error(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    transport = transport_of(a, b, token="not-the-token")
    try:
        future, errors = send(transport, 1, 0, b"secret")
        with pytest.raises(grpc.RpcError):
            future.result(timeout=10)
        assert isinstance(transport.delivery_error(1, future), AuthenticationError)
        assert b.mailbox.take((7, 1, 0, 0), time.monotonic() + 0.2) is None
    finally:
        transport.close()


def test_a_lane_connection_without_its_ticket_is_refused(pair: tuple[Peer, Peer]) -> None:
    _, b = pair
    port = b.server._lane.port  # type: ignore[union-attr]
    with pytest.raises(OSError):
        open_lane("127.0.0.1", port, 0, b"\0" * 32, 5, lambda error: None)


def connected_pair() -> tuple[LaneConnection, socket.socket]:
    mine, theirs = socket.socketpair()
    return LaneConnection(mine, "peer", lambda error: None), theirs


def test_a_peer_that_takes_no_data_fails_the_send_at_its_deadline() -> None:
    lane, theirs = connected_pair()
    try:
        started = time.monotonic()
        future = lane.send(b"h" * 64, memoryview(bytes(64 << 20)), started + 0.5, lambda: None)
        error = future.exception(timeout=5)
        assert isinstance(error, LaneError) and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 2.0
        assert lane.broken  # half a frame went out: the connection is never written again
    finally:
        lane.close()
        theirs.close()


def test_a_failure_recorded_while_a_write_waits_ends_it() -> None:
    lane, theirs = connected_pair()
    recorded: list[BaseException] = []
    threading.Timer(0.3, lambda: recorded.append(RankFailedError("rank 5 failed", [5], ["h"]))).start()
    try:
        with pytest.raises(RankFailedError):
            lane.send(
                b"h" * 64, memoryview(bytes(64 << 20)), time.monotonic() + 30, lambda: recorded[0] if recorded else None
            )
    finally:
        lane.close()
        theirs.close()


def test_a_peer_that_closes_fails_what_it_still_owed_as_refused(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    transport = transport_of(a, b)
    try:
        assert send(transport, 1, 0, b"first")[0].result(timeout=10) == b""
        b.server.stop(0)  # the peer's process is gone: its lane and endpoint close
        future, _ = send(transport, 1, 1, b"second" * 100000, deadline=10)
        future.exception(timeout=10)
        assert refused(future)
        assert isinstance(transport.delivery_error(1, future), RankFailedError)
    finally:
        transport.close()


def test_a_lane_that_ends_while_idle_counts_as_a_refused_delivery(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    transport = transport_of(a, b)
    try:
        assert send(transport, 1, 0, b"first")[0].result(timeout=10) == b""
        b.server.stop(0)  # the peer's process is gone while this rank sends nothing
        # No departure news comes: after the grace the refusal is this process's failure, naming rank 1.
        with pytest.raises(RankFailedError) as raised:
            a.mailbox.take((7, 1, 5, 1), time.monotonic() + 10)
        assert raised.value.ranks == [1]
    finally:
        transport.close()


def test_a_lane_this_side_closed_reports_nothing(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    transport = transport_of(a, b)
    assert send(transport, 1, 0, b"first")[0].result(timeout=10) == b""
    transport.close()
    assert a.mailbox.take((7, 1, 5, 1), time.monotonic() + 3) is None  # no failure: the deadline passes


def test_timeout_maps_to_collective_timeout(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    transport = transport_of(a, b)
    try:
        late: Future[bytes] = Future()
        late.set_exception(LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, "took no data"))
        assert isinstance(transport.delivery_error(1, late), CollectiveTimeoutError)
        assert not refused(late)
    finally:
        transport.close()


def test_a_drain_returns_once_every_frame_sent_is_in_the_mailbox(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    transport = transport_of(a, b)
    try:
        payload = bytes(8 << 20)
        for step in range(4):
            assert send(transport, 1, step, payload)[0].result(timeout=10) == b""
        assert transport.lanes is not None and transport.lanes.drain(10)
        for step in range(4):  # deposited before the drain answered: no waiting now
            assert b.mailbox.take((7, 1, step, 0), time.monotonic()) is not None
    finally:
        transport.close()


def test_a_drain_to_a_peer_that_reads_nothing_gives_up_at_its_timeout() -> None:
    lane, theirs = connected_pair()
    try:
        started = time.monotonic()
        drained = lane.start_drain(started + 0.5)
        assert drained is not None and not drained.wait(0.5)
        assert time.monotonic() - started < 2.0
    finally:
        lane.close()
        theirs.close()
