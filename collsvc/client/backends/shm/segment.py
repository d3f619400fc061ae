"""Shared-memory segments for the ranks of one host: anonymous ``memfd`` files passed over Unix sockets.

Each local rank owns one segment and is its only writer; its peers map it read-only. A segment is a
``memfd_create`` file, not a file in /dev/shm: it has no name in any file system, so nothing can leak
whatever way a process exits (SIGKILL included) and the size of the /dev/shm mount (64 MiB in a default
Docker container) does not limit it. The kernel frees it once the last mapping and descriptor are gone.

Layout: a control block of :data:`CONTROL_BYTES` (word 0: the last barrier generation the owner
reached; word 1: the generation it sleeps waiting for, 0 while awake; then per parity a slot for the
descriptor of the owner's call, see ``board.py``), then for each of two parities (double buffering,
see ``group.py``)::

    [ input slot: slot_bytes ][ result slot: ceil(slot_bytes / local_size) + 64 ]
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from collsvc.errors import RendezvousError

_ALIGN = 64
#: The control block: two words, then a descriptor slot per parity (a 4-byte length and the bytes).
CONTROL_BYTES = 3 * _ALIGN
DESCRIPTOR_BYTES = _ALIGN - 4
#: Where the descriptor slot of each parity starts in a segment.
DESCRIPTOR_OFFSETS = (_ALIGN, 2 * _ALIGN)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Layout:
    """Byte offsets inside every segment of one group; equal on every local rank.

    Attributes:
        slot_bytes: bytes of one input slot (a chunk of a collective's input).
        result_bytes: bytes of one result slot (the slice of a chunk one rank reduces).
    """

    slot_bytes: int
    result_bytes: int

    @classmethod
    def for_group(cls, slot_bytes: int, local_size: int) -> Layout:
        """The layout for ``local_size`` ranks exchanging chunks of up to ``slot_bytes``.

        Raises:
            ValueError: ``slot_bytes`` is below 1024 or 16 per rank, or ``local_size`` below 1.
        """
        if slot_bytes < 1024:
            raise ValueError(f"slot_bytes must be at least 1024, got {slot_bytes}")
        if local_size < 1:
            raise ValueError(f"local_size must be at least 1, got {local_size}")
        if slot_bytes < 16 * local_size:
            raise ValueError(f"slot_bytes must be at least 16 * local_size, got {slot_bytes}")
        slot = _round_up(slot_bytes, _ALIGN)
        # A rank's slice of a chunk has at most ceil(elements / size) elements: +64 covers any itemsize.
        result = _round_up(-(-slot // local_size) + _ALIGN, _ALIGN)
        return cls(slot, result)

    @property
    def size(self) -> int:
        """Total bytes of one segment."""
        return CONTROL_BYTES + 2 * (self.slot_bytes + self.result_bytes)

    def input_offset(self, parity: int) -> int:
        return CONTROL_BYTES + parity * (self.slot_bytes + self.result_bytes)

    def result_offset(self, parity: int) -> int:
        return self.input_offset(parity) + self.slot_bytes


@dataclass
class SegmentViews:
    """Typed views of one segment's slots, indexed by parity."""

    inputs: tuple[np.ndarray, np.ndarray]
    results: tuple[np.ndarray, np.ndarray]


@dataclass
class Segment:
    """One rank's mapped segment (writable for its owner, read-only for peers)."""

    layout: Layout
    #: the mapping itself (slicing it gives bytes: the cheapest way to read a peer's descriptor)
    mapping: mmap.mmap
    _bytes: np.ndarray
    #: word 0 of the control block: the last barrier generation the owner reached (a one-item view of
    #: unsigned 64-bit words: reading ``reached[0]`` gives an int at half the cost of a numpy item)
    reached: memoryview
    #: word 1: the barrier generation the owner sleeps waiting for (0: awake, it needs no wake-up)
    sleeping: memoryview
    #: per parity, the owner's descriptor slot: a little-endian uint32 length, then the bytes
    descriptors: tuple[np.ndarray, np.ndarray]
    _typed: dict[np.dtype, SegmentViews] = field(default_factory=dict)

    @classmethod
    def create(cls, layout: Layout) -> tuple[Segment, int]:
        """Creates and maps a fresh anonymous segment; returns it and its descriptor (caller closes).

        Raises:
            OSError: the kernel refused the memory.
        """
        fd = os.memfd_create("collsvc-shm", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, layout.size)
            return cls._map_fd(fd, layout, writable=True), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, layout: Layout) -> Segment:
        """Maps a peer's segment read-only from a received descriptor (the caller still closes ``fd``).

        Raises:
            RendezvousError: the descriptor is not a segment of ``layout``'s size.
        """
        size = os.fstat(fd).st_size
        if size != layout.size:
            raise RendezvousError(f"a local peer's shared-memory segment has {size} bytes, not {layout.size}")
        return cls._map_fd(fd, layout, writable=False)

    @classmethod
    def _map_fd(cls, fd: int, layout: Layout, *, writable: bool) -> Segment:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # MAP_POPULATE faults every page in now, so the first collective does not pay for it.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(fd, layout.size, flags=flags, prot=prot)
        raw = np.frombuffer(mapped, dtype=np.uint8)
        even, odd = DESCRIPTOR_OFFSETS
        slots = (raw[even : even + _ALIGN], raw[odd : odd + _ALIGN])
        words = memoryview(mapped)[:16].cast("Q")
        return cls(layout, mapped, raw, words[0:1], words[1:2], slots)

    def views(self, dtype: np.dtype) -> SegmentViews:
        """The input and result slots as arrays of ``dtype`` (cached per dtype)."""
        typed = self._typed.get(dtype)
        if typed is None:
            lay, item = self.layout, dtype.itemsize
            slot = (lay.slot_bytes // item) * item
            res = (lay.result_bytes // item) * item

            def at(offset: int, nbytes: int) -> np.ndarray:
                return self._bytes[offset : offset + nbytes].view(dtype)

            typed = SegmentViews(
                inputs=(at(lay.input_offset(0), slot), at(lay.input_offset(1), slot)),
                results=(at(lay.result_offset(0), res), at(lay.result_offset(1), res)),
            )
            self._typed[dtype] = typed
        return typed

    def close(self) -> bool:
        """Unmaps the segment; returns False when a view is still referenced (the GC unmaps it later)."""
        self._typed.clear()
        del self._bytes, self.reached, self.sleeping, self.descriptors
        try:
            self.mapping.close()
        except BufferError:  # someone still holds a view; the mapping goes with it
            return False
        return True
