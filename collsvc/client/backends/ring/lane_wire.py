"""The bulk lane's wire: a plain TCP connection per sending peer that carries ring frames unchanged.

gRPC stays the ring's control and fallback path; the lane only moves frames. A peer asks for a lane
over its authenticated gRPC channel (``Lane``: the request is the asking rank, the answer the lane's
port and a one-time ticket of :data:`TICKET_BYTES` random bytes, or nothing where the receiver offers
no lane). It then connects, sends its rank and the ticket (:data:`HELLO`), and reads one
:data:`ACCEPTED` byte. From then on it only writes frames (``frames.py``) and the receiver only reads
them: a send is done when the kernel took it, as in gloo or MPI's eager protocol. A dead path is found
as gRPC's keepalive finds it: TCP keepalive and ``TCP_USER_TIMEOUT`` break the connection after
:data:`DEAD_AFTER` seconds without an answer, and the sender's watch on the connection reports it.
The one exchange back is the drain before a member leaves (:data:`DRAIN_MAGIC`).

Failures are reported in gRPC's status vocabulary (:class:`LaneError`), so the ring reads a failed
send the same way whichever road carried it.
"""

from __future__ import annotations

import os
import socket
import struct
import weakref
from typing import Protocol

import grpc

TICKET_BYTES = 32
HELLO = struct.Struct("<i32s")  # the sender's global rank, the ticket its Lane call was given
OFFER = struct.Struct("<I32s")  # the lane's port, the ticket
ACCEPTED = b"\x01"
# Before a rank leaves the job it drains its lanes: a marker the size of a frame header (but not a
# frame: another magic) that the receiver answers with DRAINED once every frame before it is in its
# mailbox. A peer told of the departure must find every frame the member sent already there.
DRAIN_MAGIC = b"CSVD"
DRAINED = b"\x02"
# Seconds without an answer before a connection counts as dead (TCP keepalive: idle 2 s, then 3
# probes 1 s apart; TCP_USER_TIMEOUT for data sent and not acknowledged): gRPC's PEER_PING_EVERY +
# PEER_DEAD_AFTER on the same path.
DEAD_AFTER = 5.0
HANDSHAKE_SECONDS = 5.0


class LaneError(Exception):
    """A lane send that failed, with the gRPC status code the same failure has on the gRPC road."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def tune(sock: socket.socket) -> None:
    """No Nagle delay; keepalive and a user timeout that break a silently dead path after
    :data:`DEAD_AFTER` seconds."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive defaults hold
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(DEAD_AFTER * 1000))


def read_exact(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from ``sock``.

    Raises:
        ConnectionError: the peer closed the connection first.
        OSError: the connection broke (reset, timed out).
    """
    done = 0
    while done < len(view):
        got = sock.recv_into(view[done:])
        if got == 0:
            raise ConnectionError("the connection was closed")
        done += got


def split_address(address: str) -> str:
    """The host part of a ``host:port`` or ``[v6]:port`` peer address."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


class ForkForgettable(Protocol):
    def forget_after_fork(self) -> None: ...


_in_this_process: weakref.WeakSet[ForkForgettable] = weakref.WeakSet()


def forget_in_forked_children(owner: ForkForgettable) -> None:
    """Has a forked child close ``owner``'s sockets: a child of a rank (a DataLoader worker, a pool)
    must not hold the rank's connections open after the rank died, or its peers would find no end."""
    _in_this_process.add(owner)


def _forget_all() -> None:
    for owner in list(_in_this_process):
        owner.forget_after_fork()
    _in_this_process.clear()


os.register_at_fork(after_in_child=_forget_all)
