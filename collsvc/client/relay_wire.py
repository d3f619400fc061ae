"""The wire between ``collsvc run``'s join relay and its ranks (see :mod:`collsvc.client.join_relay`).

Frames of a 4-byte big-endian length and that many bytes, both ways. Rank to launcher: the relay's
secret, then the serialized JoinRequest. Launcher to rank: ``ok``, the JoinResponse and the
GetMembersResponse (empty when the launcher could not fetch it); or ``error`` and a JSON object
``{"code", "details", "metadata"}`` (the gRPC status of the batch). Nothing here loads gRPC or
protobuf: the launcher starts its relay before its ranks, and loads those only after.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

RELAY_ENV = "COLLSVC_JOIN_RELAY"
# The most bytes one frame may hold (a member table of the largest job is well below).
MAX_FRAME_BYTES = 64 * 1024 * 1024
# How long a rank waits for the relay to take its request (connect and send); it answers at once.
SEND_TIMEOUT = 5.0
_LENGTH = struct.Struct(">I")
OK = b"ok"
ERROR = b"error"


class RelayClosed(Exception):
    """The other side closed the connection, or sent a frame over :data:`MAX_FRAME_BYTES`."""


def send_frames(sock: socket.socket, frames: Sequence[bytes]) -> None:
    """Sends ``frames`` (raises OSError as ``socket.sendall`` does)."""
    sock.sendall(b"".join(_LENGTH.pack(len(frame)) + frame for frame in frames))


def receive_frame(sock: socket.socket) -> bytes:
    """The next frame (blocks as the socket's timeout allows).

    Raises:
        RelayClosed: the connection closed first, or the frame is too long.
        OSError: the socket's timeout passed, or it failed.
    """
    (length,) = _LENGTH.unpack(_receive_exactly(sock, _LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise RelayClosed(f"a frame of {length} bytes is over the limit of {MAX_FRAME_BYTES}")
    return _receive_exactly(sock, length)


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    parts, missing = [], size
    while missing:
        part = sock.recv(min(missing, 1 << 20))
        if not part:
            raise RelayClosed("connection closed")
        parts.append(part)
        missing -= len(part)
    return b"".join(parts)


def parse_relay(value: str) -> tuple[str, str] | None:
    """``COLLSVC_JOIN_RELAY``'s ``NAME:SECRET`` as (abstract socket name, secret); None when malformed."""
    name, _, secret = value.partition(":")
    return (name, secret) if name and secret else None
