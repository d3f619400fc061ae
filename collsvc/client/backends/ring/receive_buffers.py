"""Payload buffers for frames a receiver thread reads, recycled once nothing refers to them.

A frame's payload is read into memory the receiver owns and handed to the mailbox; the algorithm that
takes it reads it once (a reduction, a copy) and drops it, but a point-to-point ``recv`` may hand it to
the user as is. A fresh buffer per frame costs a page fault per 4 KiB whenever the allocator has
returned the previous one to the system (glibc trims its heap and maps large blocks anew): for a
64 MiB all_reduce that measured as thousands of faults and up to 40 % of the call's time. So a large
payload is a view of a pooled block, and the block returns to the pool only when the last reference
to that view is gone (``weakref.finalize`` on the view): memory someone can still read is never
written again.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

# Below this a fresh buffer is cheap (the allocator keeps small blocks) and a finalizer would cost
# more than it saves.
POOLED_FROM_BYTES = 64 * 1024
# Free blocks kept per pool, in bytes; blocks freed beyond it go back to the allocator.
KEEP_BYTES = 64 << 20


def _size_class(nbytes: int) -> int:
    """The block size a payload of ``nbytes`` is read into: the next power of two."""
    return 1 << (nbytes - 1).bit_length()


class ReceiveBuffers:
    """A thread-safe pool of payload blocks by size class (see the module's docstring)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0

    def take(self, nbytes: int) -> memoryview:
        """A writable buffer of exactly ``nbytes`` (contents undefined), owned by the caller until every
        reference to it is dropped."""
        if nbytes < POOLED_FROM_BYTES:
            return np.empty(nbytes, np.uint8).data
        size = _size_class(nbytes)
        with self._lock:
            blocks = self._free.get(size)
            block = blocks.pop() if blocks else None
            if block is not None:
                self._free_bytes -= size
        if block is None:
            block = np.empty(size, np.uint8)
        view = block[:nbytes]
        weakref.finalize(view, self._give_back, block)
        return view.data

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + block.nbytes > self._keep_bytes:
                return  # dropped: the allocator gets it back
            self._free.setdefault(block.nbytes, []).append(block)
            self._free_bytes += block.nbytes

    @property
    def free_bytes(self) -> int:
        """Bytes held in free blocks now."""
        with self._lock:
            return self._free_bytes
