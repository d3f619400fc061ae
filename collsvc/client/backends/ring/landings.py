"""Destinations registered for frames yet to arrive, so a receiver reads them straight into place.

A ring's copy rounds and a broadcast chain receive frames whose bytes only need to end up in the
call's own array. Copying each from a receive buffer into that array is one more pass over the data
per rank (half the bytes of an all_reduce). Instead a call declares, before its first send, where each
such frame goes (:meth:`Landings.expect`); the thread reading a lane connection asks for the
destination when the frame's header arrived (:meth:`claim`) and reads the payload into it.

The one rule: **nothing is written into a call's array after the call ended.** A call withdraws its
destinations when it ends (:meth:`withdraw`, also when it fails); a read already under way is waited
for briefly; if it does not finish, its connection is shut down and the reader (which then never
blocks) ends before ``withdraw`` returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

FrameKey = tuple[int, int, int, int]  # (key hash, sequence, step, source global rank): the mailbox's key

# How long a call that ended waits for a frame being read into its array before it cuts the
# connection carrying it (a frame is read at link speed: milliseconds; a peer that stopped mid-frame
# is what the cut is for).
READ_GRACE_SECONDS = 1.0
# After its connection was shut down a reader never blocks; this only bounds a thread that is not run.
STOPPED_READER_SECONDS = 10.0


@dataclass
class _Destination:
    view: memoryview
    digest: int


class Landings:
    """Thread-safe registry of destinations by frame key (see the module's docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: dict[FrameKey, _Destination] = {}
        self._reading: dict[FrameKey, Callable[[], None]] = {}  # key -> how to stop its reader

    def expect(self, key: FrameKey, view: memoryview, digest: int) -> None:
        """Frame ``key`` of a call whose signature digest is ``digest`` may be read into ``view``."""
        with self._cond:
            self._waiting[key] = _Destination(view, digest)

    def claim(self, key: FrameKey, nbytes: int, digest: int, stop: Callable[[], None]) -> memoryview | None:
        """The destination for an arriving frame, if one of exactly ``nbytes`` was registered for the
        same call (``digest``); the caller must read the payload into it and then call :meth:`finish`.
        ``stop`` ends the read (shuts its connection down) if the call withdraws meanwhile."""
        with self._cond:
            destination = self._waiting.get(key)
            if destination is None or destination.view.nbytes != nbytes or destination.digest != digest:
                return None
            del self._waiting[key]
            self._reading[key] = stop
            return destination.view

    def finish(self, key: FrameKey) -> None:
        """The read of a claimed frame ended (its bytes are in place, or the connection broke)."""
        with self._cond:
            self._reading.pop(key, None)
            self._cond.notify_all()

    def withdraw(self, keys: Iterable[FrameKey], grace: float = READ_GRACE_SECONDS) -> None:
        """Ends ``keys``' registrations. Returns once no reader writes into their destinations any more:
        a read under way is waited for up to ``grace`` seconds; then its connection is shut down, after
        which the reader takes at most what the kernel already queued (never blocking) and ends."""
        keys = list(keys)
        deadline = time.monotonic() + grace
        with self._cond:
            for key in keys:
                self._waiting.pop(key, None)
            busy = self._wait_for_readers(keys, deadline)
            stops = [self._reading[key] for key in busy]
        if not stops:
            return
        for stop in stops:
            stop()
        with self._cond:
            busy = self._wait_for_readers(busy, time.monotonic() + STOPPED_READER_SECONDS)
        if busy:
            log.error("a reader still fills %d frames of a call that ended (its thread does not run)", len(busy))

    def _wait_for_readers(self, keys: list[FrameKey], deadline: float) -> list[FrameKey]:
        """Waits until no key of ``keys`` is being read or ``deadline`` passed; returns those still read.
        Caller holds the lock."""
        while True:
            busy = [key for key in keys if key in self._reading]
            remaining = deadline - time.monotonic()
            if not busy or remaining <= 0:
                return busy
            self._cond.wait(remaining)

    @property
    def registered(self) -> int:
        """Destinations registered and not yet claimed or withdrawn."""
        with self._cond:
            return len(self._waiting)
