"""Barriers of one shared-memory group through words in the members' segments (x86-64).

A rank announces that it reached barrier generation ``g`` by storing ``g`` in its segment's
``reached`` word, after it wrote its data and its step's descriptor (in the descriptor slot of parity
``g % 2``). A waiter reads its peers' words. While every rank is running, a barrier costs no system
call and no wake-up; on a few shared cores those were most of a small collective's time (4 ranks on
2 cores, 4 KiB all_reduce: 212 us p50 with datagram barriers, see docs/performance.md).

Ordering: x86-64 keeps a core's stores in program order as other cores see them, and its loads in
program order (total store order), so a peer that reads ``g`` in the word also reads everything
written before it. glibc's non-temporal copies end with a store fence. Other architectures reorder
stores, so they keep the doorbell's datagram barriers (``doorbell.py``), whose socket locks order the
memory. :func:`memory_barriers_supported` tells which applies.

Sleeping: a waiter polls for ``spin`` seconds, handing its core to any runnable process between reads;
then it stores the generation it waits for in its ``sleeping`` word and blocks on its doorbell inbox.
A rank that arrives stores ``reached``, then reads its peers' ``reached`` words; if every peer is
there, it reads their ``sleeping`` words and pokes those that sleep. Between each side's store and its
loads sits a full memory barrier (:meth:`ArrivalBoard._fence`), so of two ranks that store at the
same time at least one sees the other's store: of the last two to arrive, at least one sees that
everybody arrived; and either a sleeper sees the last arrival before it blocks, or that rank sees the
sleeper and wakes it.
"""

from __future__ import annotations

import os
import platform
import struct
import threading
import time
from collections.abc import Callable

from collsvc.client.backends.shm.doorbell import Doorbell
from collsvc.client.backends.shm.segment import DESCRIPTOR_BYTES, DESCRIPTOR_OFFSETS, Segment

_LENGTH = struct.Struct("<I")
# How many framed descriptors a board keeps (then it starts over).
_KEPT_BODIES = 64


def memory_barriers_supported() -> bool:
    """Whether this CPU orders plain stores as :class:`ArrivalBoard` needs (x86-64's total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ArrivalBoard:
    """One local rank's view of its group's ``reached``/``sleeping`` words and descriptor slots.

    Used by one thread at a time (the group's caller); the doorbell's :meth:`~Doorbell.wake` may
    still interrupt a sleeping wait from any thread.
    """

    def __init__(self, segments: list[Segment], rank: int, bell: Doorbell) -> None:
        self._segments = segments
        own = segments[rank]
        self._reached, self._sleeping = own.reached, own.sleeping
        peers = [(peer, segment) for peer, segment in enumerate(segments) if peer != rank]
        self._peer_words = [segment.reached for _, segment in peers]
        self._peer_sleeping = [(peer, segment.sleeping) for peer, segment in peers]
        self._slots = tuple(slot.data for slot in own.descriptors)
        self._peer_slots = tuple([(s.mapping, offset) for _, s in peers] for offset in DESCRIPTOR_OFFSETS)
        self._bell = bell
        self._fence_lock = threading.Lock()
        self._framed: dict[bytes, bytes] = {}
        self._published = b""  # the framed descriptor of this rank's last barrier

    def barrier(self, generation: int, body: bytes, deadline: float, check: Callable[[], None], spin: float) -> bool:
        """Barrier ``generation``, publishing ``body`` (this step's descriptor, b"" for none).

        Returns:
            True once every local rank reached ``generation``; False when the deadline passed first.

        Raises:
            Whatever ``check`` raises (it runs whenever a sleeping wait wakes without the arrivals).
        """
        framed = self._published = self._framed_body(body)
        self._slots[generation % 2][: len(framed)] = framed
        self._reached[0] = generation
        fence = self._fence_lock  # self._fence(), inline: every step passes here
        fence.acquire()
        fence.release()
        if self._arrived(generation):
            # The last to arrive (or one of the last: each sees the others' words after its fence)
            # wakes the sleepers; earlier arrivals leave them asleep, so a barrier pokes each at most once
            # per rank that completes it, not once per arrival.
            for peer, sleeping in self._peer_sleeping:
                if sleeping[0]:
                    self._bell.poke(peer)
            return True
        if spin > 0:
            spin_until = time.monotonic() + spin
            while time.monotonic() < spin_until:
                os.sched_yield()
                if self._arrived(generation):
                    return True
        self._sleeping[0] = generation
        self._fence()
        try:
            return self._bell.wait(lambda: self._arrived(generation), deadline, check, 0.0)
        finally:
            self._sleeping[0] = 0

    def agree(self, generation: int) -> bool:
        """Whether every peer published the descriptor this rank published at barrier ``generation``, its
        last (no copies of the others')."""
        framed = self._published
        end = len(framed)
        for mapping, start in self._peer_slots[generation % 2]:  # noqa: SIM110 - a loop is cheaper than all()
            if mapping[start : start + end] != framed:  # bytes from the mapping: half a memoryview compare
                return False
        return True

    def bodies(self, generation: int) -> list[bytes]:
        """Every local rank's descriptor of barrier ``generation``, in local rank order (valid until
        this rank arrives at ``generation + 1``)."""
        bodies = []
        for segment in self._segments:
            slot = segment.descriptors[generation % 2]
            (length,) = _LENGTH.unpack(slot[: _LENGTH.size].tobytes())
            bodies.append(slot[_LENGTH.size : _LENGTH.size + min(length, DESCRIPTOR_BYTES)].tobytes())
        return bodies

    def _framed_body(self, body: bytes) -> bytes:
        """``body`` with its length in front, as the descriptor slots hold it (kept per body: repeated
        calls publish the same few, alternating, e.g. a barrier's and an all_reduce's)."""
        framed = self._framed.get(body)
        if framed is None:
            if len(self._framed) >= _KEPT_BODIES:
                self._framed.clear()
            framed = self._framed[body] = _LENGTH.pack(len(body)) + body
        return framed

    def _arrived(self, generation: int) -> bool:
        for reached in self._peer_words:  # noqa: SIM110 - polled: a loop is cheaper than all()
            if reached[0] < generation:
                return False
        return True

    def _fence(self) -> None:
        """A full memory barrier: acquiring and releasing a free lock are atomic read-modify-writes,
        which on x86-64 are locked instructions that no earlier store or later load crosses."""
        self._fence_lock.acquire()
        self._fence_lock.release()
