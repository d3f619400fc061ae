"""The sending end of the bulk lane: one connection to one peer's lane, written by the calling thread.

A send writes its frame straight from the caller's buffer (header and payload in one ``sendmsg``, no
join) and is complete once the kernel took all of it, as a send is in gloo or MPI's eager protocol:
the receiver sends nothing back, so a frame costs no acknowledgement and no thread wakes for it. A
thread per connection only waits for the connection to end: the peer's process gone (a reset or the
end of the stream) or a dead path (keepalive and ``TCP_USER_TIMEOUT``, ``lane_wire.py``). It then
reports the break (``on_broken``), and the rank learns it as from a refused gRPC call. A connection that
broke (also a write that passed its deadline half-way) is never written again; the transport opens a
new one for the next send.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import grpc

from collsvc.client.backends.ring.frames import HEADER
from collsvc.client.backends.ring.lane_wire import (
    ACCEPTED,
    DRAIN_MAGIC,
    DRAINED,
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


def open_lane(
    host: str, port: int, rank: int, ticket: bytes, timeout: float, on_broken: Callable[[LaneError], None]
) -> LaneConnection:
    """Connects to a peer's lane and presents ``ticket`` as global rank ``rank``; ``on_broken`` is
    called (on the connection's own thread) if the connection ends other than by :meth:`close`.

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
    return LaneConnection(sock, f"{host}:{port}", on_broken)


def _failed(error: LaneError) -> Future[bytes]:
    future: Future[bytes] = Future()
    future.set_exception(error)
    return future


#: What every successful lane send returns: one finished future, shared (a done future runs a callback
#: added to it at once and keeps none, so sharing it is safe), so a send costs no future of its own.
DELIVERED: Future[bytes] = Future()
DELIVERED.set_result(b"")


class LaneConnection:
    """Frames to one peer over one lane connection."""

    def __init__(self, sock: socket.socket, address: str, on_broken: Callable[[LaneError], None]) -> None:
        self._sock = sock
        self._address = address
        self._on_broken = on_broken
        self._write_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._broken: LaneError | None = None
        self._drained: threading.Event | None = None  # set by the watch when the peer answers a drain
        forget_in_forked_children(self)
        threading.Thread(target=self._watch, name="collsvc-lane-watch", daemon=True).start()

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def send(
        self, header: bytes, payload: memoryview, deadline: float, failure: Callable[[], BaseException | None]
    ) -> Future[bytes]:
        """Writes one frame; returns a finished future: :data:`DELIVERED` once the kernel took every
        byte, or one failing with the :class:`LaneError` that broke the connection (DEADLINE_EXCEEDED:
        the peer took no data before ``deadline``; UNAVAILABLE: the connection is gone).

        Args:
            failure: the rank's recorded failure, if any; looked up while a write waits on the peer.

        Raises:
            BaseException: the failure ``failure`` returned while the write was blocked (the connection
                is then broken: half a frame went out).
        """
        with self._write_lock:
            if self._broken is not None:
                return _failed(self._broken)
            try:
                self._write([memoryview(header), payload], deadline, failure)
            except LaneError as exc:
                return _failed(self._break(exc))
            except BaseException:
                self._break(LaneError(grpc.StatusCode.CANCELLED, "a write was abandoned half-way"))
                raise
        return DELIVERED

    def start_drain(self, deadline: float) -> threading.Event | None:
        """Asks the peer to confirm that every frame sent so far is in its mailbox; returns the event
        the answer sets, or None where the connection is broken or the marker could not go out."""
        with self._write_lock:
            if self._broken is not None:
                return None
            drained = self._drained = threading.Event()
            marker = memoryview(DRAIN_MAGIC + bytes(HEADER.size - len(DRAIN_MAGIC)))
            try:
                self._write([marker], deadline, lambda: None)
            except LaneError as exc:
                self._break(exc)
                return None
        return drained

    def _write(self, buffers: list[memoryview], deadline: float, failure: Callable[[], BaseException | None]) -> None:
        """Writes every buffer, waiting for room with :meth:`_wait_writable`.

        Raises:
            LaneError: the deadline passed (DEADLINE_EXCEEDED) or the connection broke (UNAVAILABLE).
            BaseException: the failure recorded meanwhile.
        """
        buffers = [buffer for buffer in buffers if len(buffer)]
        while buffers:
            try:
                # MSG_DONTWAIT: this write never blocks, while the watch thread's reads on the same
                # (blocking) socket do.
                sent = self._sock.sendmsg(buffers, [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise self._lost(exc) from exc
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

    def _lost(self, exc: BaseException) -> LaneError:
        return LaneError(grpc.StatusCode.UNAVAILABLE, f"the lane to {self._address} broke: {exc}")

    def _watch(self) -> None:
        """Waits for the connection to end; reports it unless this side ended it first."""
        try:
            while True:
                got = self._sock.recv(1)
                drained = self._drained
                if got != DRAINED or drained is None:
                    break
                drained.set()
            error = self._lost(ConnectionError("the peer sent data on a lane" if got else "the peer closed it"))
        except OSError as exc:
            error = self._lost(exc)
        if self._break(error) is error:
            self._on_broken(error)

    def _break(self, error: LaneError) -> LaneError:
        """Marks the connection broken and shuts it down; returns the cause, which is the first one."""
        with self._state_lock:
            if self._broken is None:
                self._broken = error
            cause = self._broken
        with contextlib.suppress(OSError):  # already shut down, or never connected
            self._sock.shutdown(socket.SHUT_RDWR)
        return cause

    def close(self) -> None:
        self._break(LaneError(grpc.StatusCode.CANCELLED, "the transport closed"))
        self._sock.close()

    def forget_after_fork(self) -> None:
        self._broken = LaneError(grpc.StatusCode.CANCELLED, "a forked child does not speak for its rank")
        self._sock.close()
