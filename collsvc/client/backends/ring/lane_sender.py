"""The sending end of the bulk lane: one connection to one peer's lane, written by the calling thread.

A send writes its frame straight from the caller's buffer (header and payload in one ``sendmsg``, no
join) and returns a future that an acknowledgement thread completes once the receiver deposited the
frame; frames and acknowledgements keep their order on the connection. A connection that broke (the
peer's process is gone, the path is dead, a write passed its deadline half-way) fails every send it
still owed and is never written again; the transport opens a new one for the next send.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

import grpc

from collsvc.client.backends.ring.lane_wire import (
    ACCEPTED,
    HANDSHAKE_SECONDS,
    HELLO,
    LaneError,
    forget_in_forked_children,
    read_exact,
    tune,
)

# A write blocked on a peer that does not read looks up at least this often whether the rank recorded a
# failure meanwhile (a coordinator event names the cause better than the call's deadline would).
WRITE_CHECK_SECONDS = 0.2


def open_lane(host: str, port: int, rank: int, ticket: bytes, timeout: float) -> LaneConnection:
    """Connects to a peer's lane and presents ``ticket`` as global rank ``rank``.

    Raises:
        OSError: the connection could not be made or the peer did not accept the ticket in ``timeout``.
    """
    sock = socket.create_connection((host, port), timeout=min(timeout, HANDSHAKE_SECONDS))
    try:
        sock.sendall(HELLO.pack(rank, ticket))
        answer = bytearray(1)
        read_exact(sock, memoryview(answer))
        if bytes(answer) != ACCEPTED:
            raise ConnectionError("the peer did not accept the lane ticket")
        sock.settimeout(None)
        tune(sock)
    except BaseException:
        sock.close()
        raise
    return LaneConnection(sock, f"{host}:{port}")


def _settle(future: Future[bytes], error: LaneError | None) -> None:
    """Completes ``future`` unless the caller cancelled it meanwhile."""
    if future.done():
        return
    try:
        if error is None:
            future.set_result(b"")
        else:
            future.set_exception(error)
    except InvalidStateError:
        pass  # cancelled between the check and the completion


class LaneConnection:
    """Frames to one peer over one lane connection."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self._sock = sock
        self._address = address
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._unacked: collections.deque[Future[bytes]] = collections.deque()
        self._broken: LaneError | None = None
        forget_in_forked_children(self)
        threading.Thread(target=self._read_acks, name="collsvc-lane-acks", daemon=True).start()

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def send(
        self, header: bytes, payload: memoryview, deadline: float, failure: Callable[[], BaseException | None]
    ) -> Future[bytes]:
        """Writes one frame; returns the future its acknowledgement completes.

        Args:
            failure: the rank's recorded failure, if any; looked up while a write waits on the peer.

        Raises:
            BaseException: the failure ``failure`` returned while the write was blocked (the connection
                is then broken: half a frame went out).
        """
        future: Future[bytes] = Future()
        with self._write_lock:
            with self._state_lock:
                if self._broken is not None:
                    future.set_exception(self._broken)
                    return future
                self._unacked.append(future)
            try:
                self._write([memoryview(header), payload], deadline, failure)
            except LaneError as exc:
                self._break(exc)
            except OSError as exc:
                self._break(LaneError(grpc.StatusCode.UNAVAILABLE, f"the lane to {self._address} broke: {exc}"))
            except BaseException:
                self._break(LaneError(grpc.StatusCode.CANCELLED, "a write was abandoned half-way"))
                raise
        return future

    def _write(self, buffers: list[memoryview], deadline: float, failure: Callable[[], BaseException | None]) -> None:
        buffers = [buffer for buffer in buffers if len(buffer)]
        while buffers:
            try:
                # MSG_DONTWAIT: this write never blocks, while the acknowledgement thread's reads on the
                # same (blocking) socket do.
                sent = self._sock.sendmsg(buffers, [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            while sent:  # drop what went out; a buffer sent in part keeps its rest
                if sent >= len(buffers[0]):
                    sent -= len(buffers[0])
                    buffers.pop(0)
                else:
                    buffers[0] = buffers[0][sent:]
                    sent = 0
            if buffers:
                self._wait_writable(deadline, failure)

    def _wait_writable(self, deadline: float, failure: Callable[[], BaseException | None]) -> None:
        """Waits until the socket takes more bytes.

        Raises:
            LaneError: DEADLINE_EXCEEDED when ``deadline`` passed first.
            BaseException: the failure recorded meanwhile.
        """
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the peer at {self._address} took no data")
            _, writable, _ = select.select([], [self._sock], [], min(left, WRITE_CHECK_SECONDS))
            if writable:
                return
            recorded = failure()
            if recorded is not None:
                raise recorded

    def _read_acks(self) -> None:
        buffer = bytearray(4096)
        try:
            while True:
                got = self._sock.recv_into(buffer)
                if got == 0:
                    raise ConnectionError("the peer closed the lane")
                with self._state_lock:
                    acked = [self._unacked.popleft() for _ in range(min(got, len(self._unacked)))]
                for future in acked:
                    _settle(future, None)
        except OSError as exc:
            self._break(LaneError(grpc.StatusCode.UNAVAILABLE, f"the lane to {self._address} broke: {exc}"))

    def _break(self, error: LaneError) -> None:
        """Fails every send still owed and closes the connection; the first cause wins."""
        with self._state_lock:
            if self._broken is None:
                self._broken = error
            owed = list(self._unacked)
            self._unacked.clear()
            error = self._broken
        for future in owed:
            _settle(future, error)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._break(LaneError(grpc.StatusCode.CANCELLED, "the transport closed"))
        self._sock.close()

    def forget_after_fork(self) -> None:
        self._broken = LaneError(grpc.StatusCode.CANCELLED, "a forked child does not speak for its rank")
        self._sock.close()
