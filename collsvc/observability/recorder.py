"""The one hook the communicator calls around every collective: statistics always, the timeline on request.

``CallRecorder.start`` runs when a call begins on this rank (its arrival) and ``finish`` when it
returns or raises. Both only read clocks and append to memory; the timeline part is written once,
when the job is closed or the process exits.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from collsvc.observability.stats import CollectiveStats, RepeatedCallCounter, bus_bytes, call_bytes
from collsvc.observability.timeline import MAX_CALLS, CallEntry, part_path, write_part

log = logging.getLogger(__name__)

# What start() hands to finish(): the backend call, this rank's arrival (wall clock, ns) and the
# thread's reduction-kernel clock then.
Span = tuple[Any, int, int]


class CallRecorder:
    """Per-call statistics and (optionally) the timeline of one rank in one job.

    Args:
        job_id: the job's name. rank: this rank (job-wide). host: this rank's host name.
        timeline: the merged timeline file ``COLLSVC_TIMELINE`` names, or None for no timeline.
    """

    def __init__(
        self,
        job_id: str,
        rank: int,
        host: str,
        timeline: str | None = None,
        *,
        reduce_clock: Callable[[], int] | None = None,
    ) -> None:
        """``reduce_clock``: nanoseconds the calling thread has spent in reduction kernels so far."""
        self._reduce_clock = reduce_clock or (lambda: 0)
        self.job_id = job_id
        self.rank = rank
        self.host = host
        self.stats = CollectiveStats()
        self.timeline = timeline
        self._calls: list[tuple[Any, ...]] = []  # (stream, group, seq, signature, bytes, start, end, outcome, reducing)
        self._dropped = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()  # the rank's process (see close)
        # (signature, group size) -> (input bytes, bus bytes): a training loop repeats a few calls.
        self._sizes: dict[tuple[Any, int], tuple[int, float]] = {}
        if timeline:
            atexit.register(self.close)  # a script that exits without collsvc.destroy() still writes its part

    def start(self, call: Any) -> Span:
        """Marks this rank's arrival at ``call`` (a backend ``Call``); returns what :meth:`finish` needs."""
        return (call, time.time_ns(), 0 if self.timeline is None else self._reduce_clock())

    def finish(self, span: Span, outcome: str = "ok") -> None:
        """Records the call ``span`` came from as finished now, with ``outcome`` ("ok" or the error's name)."""
        end = time.time_ns()
        call, start, reduce_start = span
        signature, group = call.signature, call.group
        nbytes = self.count(signature, group, start, end, outcome == "ok")
        if self.timeline is None:
            return
        # The call's text is made once per distinct call when the part is written, not here.
        entry = (
            call.key,
            group.name,
            call.seq,
            signature,
            nbytes,
            start,
            end,
            outcome,
            self._reduce_clock() - reduce_start,
        )
        with self._lock:
            if len(self._calls) < MAX_CALLS:
                self._calls.append(entry)
            else:
                self._dropped += 1

    def count(
        self, signature: Any, group: Any, start: int, end: int, ok: bool, sizes: tuple[int, float] | None = None
    ) -> int:
        """Counts a call of ``signature`` in ``group`` (a ``GroupSpec``) that ran from ``start`` to ``end``
        (``time.time_ns()``) in the statistics, without a timeline entry; returns its input bytes.
        ``sizes``: what :meth:`sizes` returns for it, where the caller kept that."""
        nbytes, bus = sizes if sizes is not None else self.sizes(signature, group.size)
        self.stats.record(signature.op, group.name, nbytes, (end - start) / 1e9, bus, ok)
        return nbytes

    def counter(self, signature: Any, group: Any) -> RepeatedCallCounter | None:
        """A counter for many calls of ``signature`` in ``group`` (a ``GroupSpec``) by one thread, which
        :meth:`count` would count alike (None when the statistics keep no more (op, group) pairs)."""
        nbytes, bus = self.sizes(signature, group.size)
        return self.stats.counter(signature.op, group.name, nbytes, bus)

    def sizes(self, signature: Any, group_size: int) -> tuple[int, float]:
        """The (input bytes, bus bytes) the statistics count for a call of ``signature`` in a group of
        ``group_size`` (see :func:`~collsvc.observability.stats.bus_bytes`)."""
        sizes = self._sizes.get((signature, group_size))
        if sizes is None:
            nbytes = call_bytes(signature.dtype, signature.shape)
            sizes = (nbytes, bus_bytes(signature.op, nbytes, group_size))
            if len(self._sizes) >= 1024:
                self._sizes.clear()
            self._sizes[(signature, group_size)] = sizes
        return sizes

    def close(self) -> None:
        """Writes the timeline part, once (a failure to write is logged, never raised).

        A process that joins several jobs in turn (elastic restarts) writes one part per job to the same
        file: the last job's calls are the ones that remain. A child forked from the rank writes
        nothing: the part is the rank's (and the lock may have been held by another thread at the fork).
        """
        if os.getpid() != self._pid:
            return
        with self._lock:
            target = self.timeline
            if target is None:
                return
            self.timeline = None  # calls that finish after this are counted in the statistics only
            recorded, dropped = self._calls, self._dropped
            self._calls = []
        texts: dict[tuple[Any, ...], str] = {}
        calls: list[CallEntry] = []
        for stream, group, seq, signature, nbytes, start, end, outcome, reducing in recorded:
            key = (signature.op, signature.dtype, signature.shape, signature.reduce_op, signature.root)
            text = texts.get(key)
            if text is None:
                text = texts[key] = signature.text  # the Signature's own wording
            calls.append((stream, group, seq, signature.op, text, nbytes, start, end, outcome, reducing))
        atexit.unregister(self.close)
        path = part_path(target, self.rank)
        try:
            write_part(path, job=self.job_id, rank=self.rank, host=self.host, calls=calls, dropped=dropped)
        except OSError as exc:
            log.warning("job %s rank %d: could not write the timeline part %s: %s", self.job_id, self.rank, path, exc)
            return
        log.info("job %s rank %d: timeline part with %d calls in %s", self.job_id, self.rank, len(calls), path)
