"""The receiving end of the bulk lane: a TCP listener beside the gRPC peer endpoint.

Each accepted connection belongs to one sending peer, proven by the one-time ticket that peer got
over the authenticated gRPC channel; a thread per connection reads its frames into their own
buffers (or straight into the array a call registered for them, ``landings.py``) and deposits
them in the mailbox (``lane_wire.py``).
"""

from __future__ import annotations

import contextlib
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
        head = bytearray(frames.HEADER.size)
        head_view = memoryview(head)
        while True:
            read_exact(conn, head_view)
            if head.startswith(DRAIN_MAGIC):  # every frame before it was deposited
                conn.sendall(DRAINED)
                continue
            layout = frames.read_layout(head, self._max_payload)
            if layout.src != src:
                raise frames.FrameError(f"rank {src}'s lane carried a frame from rank {layout.src}")
            signature = bytearray(layout.signature_bytes)
            read_exact(conn, memoryview(signature))
            header = layout.header(bytes(signature))
            key = (layout.key_hash, layout.seq, layout.step, layout.src)
            into = self._mailbox.landings.claim(key, layout.payload_bytes, layout.digest, lambda: _cut(conn))
            if into is None:
                payload = self._buffers.take(layout.payload_bytes)  # not zeroed: every byte is read into it
                read_exact(conn, payload)
                self._mailbox.deposit(header, payload)
                continue
            try:  # straight into the call's array
                read_exact(conn, into)
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
