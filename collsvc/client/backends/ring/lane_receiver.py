"""The receiving end of the bulk lane: a TCP listener beside the gRPC peer endpoint.

Each accepted connection belongs to one sending peer, proven by the one-time ticket that peer got
over the authenticated gRPC channel; a thread per connection reads its frames into their own
buffers (or straight into the array a call registered for them, ``landings.py``) and deposits
them in the mailbox (``lane_wire.py``).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import secrets
import socket
import threading

from collsvc.client.backends.ring import frames
from collsvc.client.backends.ring.lane_wire import (
    ACCEPTED,
    DRAIN_MAGIC,
    DRAINED,
    HANDSHAKE_SECONDS,
    HELLO,
    TICKET_BYTES,
    forget_in_forked_children,
    read_exact,
    tune,
)
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.client.backends.ring.receive_buffers import ReceiveBuffers

log = logging.getLogger(__name__)

# Bytes a connection's reader stages: a frame header and signature plus a small payload.
STAGE_BYTES = 64 * 1024


class StagedReader:
    """Reads one connection through a small staging buffer: a frame's header, signature and a small
    payload usually come in one ``recv`` instead of three. A large payload is read straight into its
    destination after the few bytes already staged (at most :data:`STAGE_BYTES`) were copied there."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._buffer = bytearray(STAGE_BYTES)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0  # staged bytes not yet taken: _buffer[_start:_end]

    def take(self, count: int) -> memoryview:
        """The next ``count`` bytes (at most :data:`STAGE_BYTES`), valid until the next call.

        Raises:
            ConnectionError: the peer closed the connection first.
            OSError: the connection broke.
        """
        if self._end - self._start < count:
            if self._start + count > STAGE_BYTES:  # move what is staged to the front to make room
                staged = self._end - self._start
                self._view[:staged] = self._view[self._start : self._end]
                self._start, self._end = 0, staged
            while self._end - self._start < count:
                got = self._conn.recv_into(self._view[self._end :])
                if got == 0:
                    raise ConnectionError("the connection was closed")
                self._end += got
        taken = self._view[self._start : self._start + count]
        self._start += count
        if self._start == self._end:
            self._start = self._end = 0
        return taken

    def read_into(self, destination: memoryview) -> None:
        """Fills ``destination`` with the next bytes: those staged first, the rest from the connection.

        Raises:
            ConnectionError, OSError: as :meth:`take`.
        """
        staged = min(self._end - self._start, len(destination))
        if staged:
            destination[:staged] = self._view[self._start : self._start + staged]
            self._start += staged
            if self._start == self._end:
                self._start = self._end = 0
        if staged < len(destination):
            read_exact(self._conn, destination[staged:])


def _cut(conn: socket.socket) -> None:
    """Shuts a connection down so its reader stops (a call withdrew the array it was reading into)."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


class LaneListener:
    """Accepts lane connections from peers holding a ticket and deposits their frames.

    Raises:
        OSError: the address could not be bound.
    """

    def __init__(self, bind_host: str, port: int, mailbox: Mailbox, max_payload: int) -> None:
        self._mailbox = mailbox
        self._max_payload = max_payload
        self._buffers = ReceiveBuffers()
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._socket = socket.create_server((bind_host, port), family=family, backlog=128)
        self.port: int = self._socket.getsockname()[1]
        self._lock = threading.Lock()
        self._tickets: dict[int, bytes] = {}  # sending rank -> its ticket, until used
        self._connections: list[socket.socket] = []
        self._closed = False
        forget_in_forked_children(self)
        threading.Thread(target=self._accept, name="collsvc-lane-accept", daemon=True).start()

    def ticket(self, src: int) -> bytes:
        """A fresh one-time ticket for global rank ``src`` (replacing one it did not use)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            self._tickets[src] = ticket
        return ticket

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="collsvc-lane-recv", daemon=True).start()

    def _admit(self, conn: socket.socket) -> int | None:
        """The sending rank, once its hello carried the ticket it was given; None otherwise."""
        hello = bytearray(HELLO.size)
        conn.settimeout(HANDSHAKE_SECONDS)
        read_exact(conn, memoryview(hello))
        src, ticket = HELLO.unpack(hello)
        with self._lock:
            expected = self._tickets.get(src)
            if expected is None or not hmac.compare_digest(expected, ticket):
                return None
            del self._tickets[src]
        conn.settimeout(None)
        tune(conn)
        conn.sendall(ACCEPTED)
        return int(src)

    def _serve(self, conn: socket.socket) -> None:
        try:
            src = self._admit(conn)
            if src is None:
                log.warning("lane connection refused: no valid ticket")
                return
            self._receive(conn, src)
        except (OSError, frames.FrameError) as exc:
            if not self._closed:
                log.debug("lane connection ended: %s", exc)
        finally:
            with self._lock:
                if conn in self._connections:
                    self._connections.remove(conn)
            conn.close()

    def _receive(self, conn: socket.socket, src: int) -> None:
        reader = StagedReader(conn)
        cut = functools.partial(_cut, conn)  # how a call that withdrew its array stops this reader
        while True:
            head = reader.take(frames.HEADER.size)
            if head[: len(DRAIN_MAGIC)] == DRAIN_MAGIC:  # every frame before it was deposited
                conn.sendall(DRAINED)
                continue
            layout = frames.read_layout(head, self._max_payload)
            if layout.src != src:
                raise frames.FrameError(f"rank {src}'s lane carried a frame from rank {layout.src}")
            header = layout.header(bytes(reader.take(layout.signature_bytes)))
            key = (layout.key_hash, layout.seq, layout.step, layout.src)
            into = self._mailbox.landings.claim(key, layout.payload_bytes, layout.digest, cut)
            if into is None:
                payload = self._buffers.take(layout.payload_bytes)  # not zeroed: every byte is read into it
                reader.read_into(payload)
                self._mailbox.deposit(header, payload)
                continue
            try:  # straight into the call's array
                reader.read_into(into)
                self._mailbox.deposit(header, into)
            finally:
                self._mailbox.landings.finish(key)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, []
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def forget_after_fork(self) -> None:
        self._closed = True
        self._socket.close()
        for conn in self._connections:
            conn.close()
        self._connections = []
