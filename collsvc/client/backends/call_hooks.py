"""The seam of repeated calls: what a backend prepares for them, and what it records them through.

A training loop repeats a few calls (same collective, dtype, shape, op or root) over and over. Once one
took the general path, the Communicator's fast path (``client/fast_path.py``) asks the backend to
prepare later calls like it (``Backend.prepare``). A backend with a faster road for them (the ring
backend's shared-memory groups, ``backends/shm/repeated.py``) returns a :class:`PreparedCall`; one
without returns None, and such calls keep the general path.

A prepared call does the bookkeeping of the general path itself (``client/calls.py``), through the
:class:`CallHooks` the call runner gives it: progress and statistics through objects held per stream,
bound once when the call is prepared, and a failure recorded and mapped exactly as the general path
does it.
"""

from __future__ import annotations

from typing import Any, Protocol

from collsvc.client.backends.base import Call, GroupSpec, Signature
from collsvc.errors import CollsvcError


class StreamRecorder(Protocol):
    """Records the progress of one stream's calls, run in order by one thread (``progress.StreamProgress``)."""

    def start(self, seq: int, op: str, now: float) -> Any:
        """Call ``seq``, doing ``op``, started at ``now`` (``time.time()``): its record."""
        ...

    def finish(self, record: Any, now: float) -> None:
        """``record``'s call ended well at ``now``."""
        ...


class CallCounter(Protocol):
    """Counts calls of one signature in one group (``stats.RepeatedCallCounter``)."""

    def add(self, seconds: float) -> None:
        """One call that ended well after ``seconds``."""
        ...


class CallHooks(Protocol):
    """What a prepared call of one stream records through, given by the call runner.

    Attributes:
        stream: the stream the calls are numbered in (the Communicator's group name).
        limit: seconds a call may take unless told otherwise (the job's timeout).
    """

    stream: str
    limit: float

    @property
    def recording_timeline(self) -> bool:
        """Whether the job records a timeline now (per-call phases only the general path measures)."""
        ...

    def progress(self) -> StreamRecorder:
        """The stream's progress recorder (bind it once, when the call is prepared)."""
        ...

    def counter(self, signature: Signature, group: GroupSpec) -> CallCounter | None:
        """The statistics' counter of ``signature`` in ``group`` (None when they keep no more)."""
        ...

    def failed(self, call: Call, record: Any, span: Any, error: CollsvcError) -> CollsvcError:
        """Records the failed ``call`` (its progress ``record`` and ``(call, started_ns, 0)`` span) as
        the general path does, and returns the error its caller raises."""
        ...


class PreparedCall(Protocol):
    """Later calls of one (collective, dtype, shape, op or root) of one Communicator, worked out once."""

    def accepts(self, x: Any, out: Any) -> bool:
        """Whether a call of C-contiguous ``x`` with ``out`` may take this road."""
        ...

    def run(self, seq: int, x: Any, out: Any, limit: float | None = None) -> Any:
        """Runs call ``seq`` of the stream with ``x`` and ``out`` (which it :meth:`accepts`); ``limit``:
        seconds it may take (default: the hooks' limit).

        Returns:
            The result, written into ``out`` when given, else a new array (a barrier: None).

        Raises:
            CollectiveMismatchError / CollectiveTimeoutError / RankFailedError / AbortedError: as the
                general path raises them, recorded and reported the same way.
        """
        ...
