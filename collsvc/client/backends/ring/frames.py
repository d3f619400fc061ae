"""The data-plane frame: a fixed little-endian header, the sender's call signature, then raw payload.

Layout (``HEADER``, 56 bytes): magic ``b"CSV1"``, version (u8), flags (u8), signature length (u16),
source global rank (i32), key hash (u64), sequence (u64), step (u32), reserved (u32), signature digest
(u64), payload length (u64), reserved (u32). The signature JSON (a few dozen bytes) follows so that a
receiver that finds a different digest can say exactly how the sender's call differed.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

HEADER = struct.Struct("<4sBBHiQQIIQQI")
MAGIC = b"CSV1"
VERSION = 1
MAX_SIGNATURE_BYTES = 4096


class FrameError(ValueError):
    """A frame is malformed (bad magic, version or lengths)."""


@dataclass(frozen=True)
class FrameHeader:
    src: int
    key_hash: int
    seq: int
    step: int
    digest: int
    signature: bytes


def key_hash(key: str) -> int:
    """A stable 64-bit hash of a call-stream key (group name or point-to-point stream)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def encode_header(src: int, key: int, seq: int, step: int, digest: int, signature: bytes, nbytes: int) -> bytes:
    """The header plus signature bytes for a payload of ``nbytes``.

    The signature is padded with JSON-neutral spaces so the payload starts 64-byte aligned within the
    frame (numpy's fast reduction loops want aligned data).
    """
    padding = -(HEADER.size + len(signature)) % 64
    signature = signature + b" " * padding
    return HEADER.pack(MAGIC, VERSION, 0, len(signature), src, key, seq, step, 0, digest, nbytes, 0) + signature


@dataclass(frozen=True)
class FrameLayout:
    """What a frame's fixed header says: its fields and how many signature and payload bytes follow."""

    src: int
    key_hash: int
    seq: int
    step: int
    digest: int
    signature_bytes: int
    payload_bytes: int

    def header(self, signature: bytes) -> FrameHeader:
        return FrameHeader(self.src, self.key_hash, self.seq, self.step, self.digest, signature)


def read_layout(head: bytes | bytearray | memoryview, max_payload: int) -> FrameLayout:
    """Reads the fixed header at the start of ``head`` (at least ``HEADER.size`` bytes).

    Raises:
        FrameError: ``head`` is shorter than the header, has the wrong magic or version, or advertises
            a payload above ``max_payload``.
    """
    if len(head) < HEADER.size:
        raise FrameError(f"frame of {len(head)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, _flags, sig_len, src, key, seq, step, _r, digest, nbytes, _r2 = HEADER.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise FrameError("not a collsvc frame (bad magic or version)")
    if sig_len > MAX_SIGNATURE_BYTES or nbytes > max_payload:
        raise FrameError(f"frame advertises {nbytes} payload bytes, over the limit of {max_payload}")
    return FrameLayout(src, key, seq, step, digest, sig_len, nbytes)


def decode(frame: bytes, max_payload: int) -> tuple[FrameHeader, memoryview]:
    """Splits a received frame into its header and a zero-copy payload view.

    Raises:
        FrameError: see :func:`read_layout`; or the frame's length differs from what its header says.
    """
    layout = read_layout(frame, max_payload)
    start = HEADER.size + layout.signature_bytes
    if len(frame) != start + layout.payload_bytes:
        raise FrameError(f"frame length {len(frame)} does not match its header ({start + layout.payload_bytes})")
    view = memoryview(frame)
    return layout.header(bytes(view[HEADER.size : start])), view[start:]
