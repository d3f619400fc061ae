"""Sequence numbers of one Communicator's calls, per stream.

Every rank numbers the calls of a stream (a group's collectives, the messages of one sender, receiver
and tag) 1, 2, 3, ... in the order it issues them; equal numbers on two ranks mean the same call.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator


class StreamNumbers:
    """Numbers each stream's calls from any thread with no lock per call: each stream has an
    ``itertools.count``, whose ``next`` is one indivisible step under the interpreter lock (a lock and a
    dictionary update per call cost ~1 us of every small collective)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # only to add a stream's counter
        self._counters: dict[str, Iterator[int]] = {}
        self._last: dict[str, int] = {}

    def next(self, stream: str) -> int:
        """The number of ``stream``'s next call (1 for its first)."""
        counter = self._counters.get(stream) or self._counter(stream)
        seq = self._last[stream] = next(counter)
        return seq

    def of(self, stream: str) -> Callable[[], int]:
        """:meth:`next` of ``stream`` as a function of no arguments (no lookup per call)."""
        counter, last = self._counter(stream), self._last

        def number() -> int:
            seq = last[stream] = next(counter)
            return seq

        return number

    def _counter(self, stream: str) -> Iterator[int]:
        with self._lock:
            return self._counters.setdefault(stream, itertools.count(1))

    def peek(self, stream: str) -> int:
        """The number :meth:`next` gives ``stream``'s next call, unless another thread numbers one of its
        calls first."""
        return self._last.get(stream, 0) + 1
