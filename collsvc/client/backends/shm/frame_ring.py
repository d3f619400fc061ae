"""A one-way queue of byte records in a shared ``memfd`` segment: one writer process, one reader process.

The data plane's frames between two ranks of one host go through one such ring per direction
(``ring/local_frames.py``) instead of a gRPC call. Layout::

    [ written: u64 ][ pad to 64 ][ consumed: u64 ][ pad to 64 ][ data: capacity bytes ]

``written`` and ``consumed`` count bytes since the ring was made and only grow; the writer alone stores
``written``, the reader alone ``consumed``, each after the bytes it covers. A record is an 8-byte
length and the bytes, padded to 8; a record that does not fit before the end of the data area starts
over at its beginning, after a skip marker in the rest.

Ordering: the writer stores the record, then ``written``; the reader loads ``written``, then the
record, and stores ``consumed`` only after it copied the record out. x86-64 keeps stores in program
order and loads in program order as other cores see them (total store order), which is all this needs;
:func:`supported` says where that holds (other CPUs use gRPC between local ranks).
"""

from __future__ import annotations

import mmap
import os
import struct

from collsvc.client.backends.shm.board import memory_barriers_supported

_COUNTER = struct.Struct("<Q")
_WRITTEN, _CONSUMED, _DATA = 0, 64, 128
_LENGTH = struct.Struct("<Q")
_SKIP = 2**64 - 1
_ALIGN = 8


def supported() -> bool:
    """Whether this CPU orders memory as the ring needs (see the module docstring)."""
    return memory_barriers_supported()


def _padded(nbytes: int) -> int:
    return _LENGTH.size + -(-nbytes // _ALIGN) * _ALIGN


class FrameRing:
    """One ring, mapped read-write; the writer uses :meth:`put`, the reader :meth:`take_all`.

    Each side is used by one thread at a time (the caller serializes).
    """

    def __init__(self, mapping: mmap.mmap, capacity: int) -> None:
        self._map = mapping
        self._view = memoryview(mapping)
        self.capacity = capacity

    @classmethod
    def create(cls, capacity: int) -> tuple[FrameRing, int]:
        """A fresh ring of ``capacity`` data bytes (a multiple of 8, at least 64) and its descriptor,
        which the caller sends to the reader and then closes.

        Raises:
            ValueError: a bad capacity. OSError: the kernel refused the memory.
        """
        if capacity < 64 or capacity % _ALIGN:
            raise ValueError(f"capacity must be a multiple of 8 of at least 64, got {capacity}")
        fd = os.memfd_create("collsvc-frames", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _DATA + capacity)
            return cls(mmap.mmap(fd, _DATA + capacity), capacity), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int) -> FrameRing:
        """Maps a ring received from its writer (the caller still closes ``fd``).

        Raises:
            ValueError: the segment is too small or not of a ring's shape. OSError: it cannot be mapped.
        """
        size = os.fstat(fd).st_size
        capacity = size - _DATA
        if capacity < 64 or capacity % _ALIGN:
            raise ValueError(f"a frame ring of {size} bytes is not of a ring's shape")
        return cls(mmap.mmap(fd, size), capacity)

    def _load(self, offset: int) -> int:
        value: int = _COUNTER.unpack_from(self._map, offset)[0]
        return value

    def fits(self, nbytes: int) -> bool:
        """Whether a record of ``nbytes`` could ever fit (in an empty ring)."""
        return _padded(nbytes) <= self.capacity // 2

    def put(self, parts: tuple[bytes | memoryview, ...], nbytes: int) -> bool:
        """Appends one record, the concatenation of ``parts`` (``nbytes`` in all); False when the ring
        has no room for it now (nothing is written then)."""
        need = _padded(nbytes)
        written = self._load(_WRITTEN)
        free = self.capacity - (written - self._load(_CONSUMED))
        position = written % self.capacity
        tail = self.capacity - position
        if tail < need:  # starts over at the beginning, after a skip marker in the rest
            if tail + need > free:
                return False
            _LENGTH.pack_into(self._map, _DATA + position, _SKIP)
            written += tail
            position = 0
        elif need > free:
            return False
        start = _DATA + position
        _LENGTH.pack_into(self._map, start, nbytes)
        at = start + _LENGTH.size
        for part in parts:
            size = len(part) if isinstance(part, bytes) else part.nbytes
            self._view[at : at + size] = part
            at += size
        _COUNTER.pack_into(self._map, _WRITTEN, written + need)  # after the record (total store order)
        return True

    def take_all(self) -> list[bytes]:
        """Removes and returns every complete record, oldest first (copies: the space is reused)."""
        written = self._load(_WRITTEN)
        consumed = self._load(_CONSUMED)
        records = []
        while consumed < written:
            position = consumed % self.capacity
            start = _DATA + position
            (length,) = _LENGTH.unpack_from(self._map, start)
            if length == _SKIP:
                consumed += self.capacity - position
                continue
            records.append(self._map[start + _LENGTH.size : start + _LENGTH.size + length])
            consumed += _padded(length)
        _COUNTER.pack_into(self._map, _CONSUMED, consumed)  # after the copies (total store order)
        return records

    def close(self) -> None:
        """Unmaps the ring (idempotent)."""
        self._view.release()
        if not self._map.closed:
            self._map.close()
