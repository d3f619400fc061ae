"""Repeated synchronous all_reduce, broadcast, all_gather and reduce_scatter calls of numpy arrays, and
barriers, within one host, without the general layers.

A training loop calls all_reduce with the same few shapes over and over. The general path (``ops.py``,
``Communicator._issue``, ``Job.execute``, the backend) adapts the array, plans a work buffer, builds a
``Call``, a progress record and a recorder span, and looks the shared-memory group up, on every call:
for a 4 KiB array that is most of the call's time. Once a call took the one-barrier shared-memory path,
the Communicator keeps what it worked out for that (collective, dtype, shape, op or root): the
signature, the group, the step's descriptor, the slot views. A later call with a contiguous numpy
array then only numbers itself, records its progress and statistics, copies into its slot, meets the
peers at the same barrier with the same descriptor (so the mismatch check stays on), and reduces or
copies out (a broadcast: the root copies in, the others copy out; an all_gather: every rank copies
every block out; a reduce_scatter: every rank reduces its own block; a barrier: only the step).
Progress and statistics go through objects held per stream and per call kind
(``StreamProgress``, ``RepeatedCallCounter``): no lookups or locks per call.

Everything the peers see is what the general path produces, so ranks may take either path for the
same call. A failure is recorded and mapped exactly as the general path does it (``Job.call_failed``).
Calls that differ in any way take the general path: ``async_op``, an ``out`` other than ``x`` (all_gather
and reduce_scatter: other than a C-contiguous array of the result's shape apart from ``x``), a non-contiguous or
read-only array, calls queued on the worker thread, or a job recording its timeline.
``COLLSVC_FAST_PATH=0`` sends every call the general way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from collsvc.client.backends.base import Call, GroupSpec, Signature
from collsvc.client.backends.reduction import finish_average, reduced_as
from collsvc.client.backends.ring.backend import global_mismatch
from collsvc.client.backends.shm.group import LocalGroup
from collsvc.client.backends.shm.groups import CallWatch
from collsvc.client.job import Job
from collsvc.config import fast_path_enabled
from collsvc.errors import CollectiveMismatchError, CollsvcError
from collsvc.types import ReduceOp

# The shared-memory group of a Communicator on one host, as ``RingBackend.existing_shared`` finds it: the
# group, the watch that must follow each call (its departure check and mismatch label), and the global
# ranks of its members (to name a mismatch).
_Shared = tuple[LocalGroup, CallWatch, tuple[int, ...]]

# Every barrier's signature: a barrier carries no data.
BARRIER = Signature.of("barrier", "", ())
# What a Communicator keeps a fast path by: (collective, dtype, shape, op or root); a barrier's: no data.
_Key = tuple[str, np.dtype | None, tuple[int, ...] | None, ReduceOp | int | None]
_BARRIER_KEY: _Key = ("barrier", None, None, None)
# What RepeatedCalls.run returns for a call it did not run (None is a result: a reduce's on other ranks).
NOT_RUN: Any = object()


class _Repeated:
    """Calls of one collective, shape and argument (op or root) of one Communicator, on its shared-memory
    group: the bookkeeping every call does (numbering is the caller's), around :meth:`_move`."""

    __slots__ = (
        "_job",
        "_spec",
        "_stream",
        "_signature",
        "_text",
        "_group",
        "_watch",
        "_local",
        "_plan",
        "_average_over",
        "_progress",
        "_counter",
        "_limit",
    )

    def __init__(
        self,
        job: Job,
        spec: GroupSpec,
        stream: str,
        signature: Signature,
        shared: _Shared,
        plan: Any,
        average_over: int = 0,
    ) -> None:
        """``plan``: what the group's ``prepare_*`` made for these calls; ``average_over``: the group size
        to divide a sum by (AVG), else 0."""
        self._job = job
        self._spec = spec
        self._stream = stream
        self._signature, self._text = signature, signature.text
        self._group, self._watch, self._local = shared
        self._plan = plan
        self._average_over = average_over
        self._progress = job.progress.stream(stream)
        self._counter = job.recorder.counter(signature, spec)
        self._limit = job.options.timeout

    def accepts(self, x: np.ndarray, out: Any) -> bool:
        """Whether a call of C-contiguous ``x`` with ``out`` may take this path: a new result, or ``x``
        itself written in place."""
        return out is None or (out is x and x.flags.writeable)

    def run(self, seq: int, x: np.ndarray | None, out: np.ndarray | None, limit: float | None = None) -> Any:
        """Call ``seq`` of the stream with ``x`` and ``out``, which :meth:`accepts`: the result, written
        into ``out`` when given, else a new array (a barrier: None). ``limit``: seconds it may take
        (default: the job's timeout).

        Raises:
            CollectiveMismatchError / CollectiveTimeoutError / RankFailedError / AbortedError: as the
                general path raises them, recorded and reported the same way.
        """
        signature = self._signature
        limit = self._limit if limit is None else limit
        deadline = time.monotonic() + limit
        started = time.time()
        record = self._progress.start(seq, self._text, started)
        self._watch.follow_numbers(self._stream, seq, signature)
        try:
            result = self._move(x, out, deadline)
        except CollsvcError as exc:
            call = Call(self._spec, self._stream, seq, signature, deadline, limit)
            error = global_mismatch(call, self._local, exc) if isinstance(exc, CollectiveMismatchError) else exc
            span = (call, int(started * 1e9), 0)
            raise self._job.call_failed(call, record, span, error) from error
        ended = time.time()
        self._progress.finish(record, ended)
        if self._counter is not None:
            self._counter.add(ended - started)
        return result

    def _move(self, x: Any, out: np.ndarray | None, deadline: float) -> Any:
        raise NotImplementedError


class RepeatedBarrier(_Repeated):
    """Barriers of one Communicator."""

    __slots__ = ()

    def _move(self, x: Any, out: Any, deadline: float) -> None:
        self._group.run_barrier(self._plan, deadline)


class RepeatedAllReduce(_Repeated):
    """All_reduce calls of one (dtype, shape, op)."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        result = x if out is x else np.empty_like(x)
        self._group.run_all_reduce(self._plan, x, result, deadline)
        if self._average_over:
            finish_average(result, self._average_over)
        return result


class RepeatedBroadcast(_Repeated):
    """Broadcasts of one (dtype, shape, root): the root's ``x`` is read, the others' written."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        if self._plan.is_root:
            self._group.run_broadcast(self._plan, x, deadline)
            return x if out is x else x.copy()
        result = x if out is x else np.empty_like(x)
        self._group.run_broadcast(self._plan, result, deadline)
        return result


class _RepeatedIntoNewShape(_Repeated):
    """Calls whose result has another shape than ``x`` (all_gather, reduce_scatter): into a new array or
    a given ``out`` of that shape."""

    __slots__ = ("_result_shape",)

    def __init__(self, result_shape: tuple[int, ...], *args: Any) -> None:
        """``result_shape``: every result's; ``args``: as :class:`_Repeated`'s."""
        super().__init__(*args)
        self._result_shape = result_shape

    def accepts(self, x: np.ndarray, out: Any) -> bool:
        """A new result, or an ``out`` of the result's dtype and shape, C-contiguous, writable and apart
        from ``x`` (anything else: the general path checks or stages it)."""
        if out is None:
            return True
        return (
            type(out) is np.ndarray
            and out.dtype == x.dtype
            and out.shape == self._result_shape
            and out.flags.c_contiguous
            and out.flags.writeable
            and not np.may_share_memory(out, x)
        )

    def _result(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        return np.empty(self._result_shape, x.dtype) if out is None else out


class RepeatedAllGather(_RepeatedIntoNewShape):
    """All_gathers of one (dtype, shape): every rank's ``x`` concatenated along axis 0."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        result = self._result(x, out)
        self._group.run_all_gather(self._plan, x.reshape(-1), result.reshape(-1), deadline)
        return result


class RepeatedReduceScatter(_RepeatedIntoNewShape):
    """Reduce_scatters of one (dtype, shape, op): block ``rank`` (along axis 0) of the reduction."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        result = self._result(x, out)
        self._group.run_reduce_scatter(self._plan, x.reshape(-1), result.reshape(-1), deadline)
        if self._average_over:
            finish_average(result, self._average_over)
        return result


def _prepare(
    kind: str,
    job: Job,
    spec: GroupSpec,
    stream: str,
    signature: Signature,
    x: np.ndarray | None,
    arg: ReduceOp | int | None,
) -> _Repeated | None:
    """The fast path for later calls like this one (``x``: a numpy array that just went through the
    general path, None for a barrier; ``arg``: the op of an all_reduce or reduce_scatter, the root of a
    broadcast, None for an all_gather or a barrier), or None where they cannot take it (the group is
    not all on this host, the array is too large for one step, ...).

    Raises:
        TypeError / ValueError: a bad op or root (the general path raised them first).
    """
    if job.recorder.timeline is not None:
        return None  # the timeline records per-call phases the general path measures
    try:
        found = job.ring.existing_shared(spec, stream)
        if found is None:
            return None
        group = found[0]
        digest = signature.digest
        common = (job, spec, stream, signature, found)
        if kind == "barrier":
            waiting = group.prepare_barrier(digest)
            return None if waiting is None else RepeatedBarrier(*common, waiting)
        assert x is not None  # every other kind has an array
        average_over = spec.size if arg is ReduceOp.AVG else 0
        if kind == "all_reduce":
            assert isinstance(arg, ReduceOp)
            reducing = group.prepare_all_reduce(x.dtype, x.size, reduced_as(arg), digest, x.shape)
            return None if reducing is None else RepeatedAllReduce(*common, reducing, average_over)
        if kind == "broadcast":
            assert isinstance(arg, int)
            sending = group.prepare_broadcast(x.dtype, x.size, arg, digest, x.shape)
            return None if sending is None else RepeatedBroadcast(*common, sending)
        if kind == "all_gather":
            gathering = group.prepare_all_gather(x.dtype, x.size, digest)
            shape = x.shape or (1,)  # a 0-d array counts as shape (1,)
            gathered = (spec.size * shape[0], *shape[1:])
            return None if gathering is None else RepeatedAllGather(gathered, *common, gathering)
        assert isinstance(arg, ReduceOp)
        block_shape = (x.shape[0] // spec.size, *x.shape[1:])
        scattering = group.prepare_reduce_scatter(x.dtype, x.size // spec.size, reduced_as(arg), digest)
        return None if scattering is None else RepeatedReduceScatter(block_shape, *common, scattering, average_over)
    except CollsvcError:
        return None  # the group failed meanwhile: the general path raises it


# How many (collective, dtype, shape, op or root) a Communicator keeps a fast path for (then it starts over).
_KEPT = 64


class RepeatedCalls:
    """The fast paths of one Communicator's calls, by (collective, dtype, shape, op or root), and of its
    barriers, learned from the general path.

    Args:
        job / spec / stream: the Communicator's job, members and sequence stream.
        check_usable: raises the job's failure or a member's departure (before a call is numbered).
        number: numbers the next call of the Communicator's stream.
    """

    def __init__(
        self,
        job: Job,
        spec: GroupSpec,
        stream: str,
        check_usable: Callable[[], None],
        number: Callable[[], int],
    ) -> None:
        self._job, self._spec, self._stream = job, spec, stream
        self._check_usable, self._number = check_usable, number
        self._failure, self._departures, self._executor = job.failure, job.departed, job.executor
        self._known: dict[_Key, _Repeated | None] = {}
        self._enabled = fast_path_enabled()

    def close(self) -> None:
        """The Communicator closed: every later call takes the general path (which raises that)."""
        self._enabled = False
        self._known = {}

    def _check(self) -> None:
        """Raises what the Communicator's usability check raises (the job's failure, a member's departure,
        a closed job); the flags first, without a call, while none is set."""
        if self._failure.recorded is not None or self._departures.anyone_left or self._job.closed:
            self._check_usable()

    def run(self, kind: str, x: Any, arg: Any, out: Any, async_op: bool) -> Any:
        """Runs a ``kind`` call ("all_reduce" or "reduce_scatter" with op ``arg``, "broadcast" from root
        ``arg``, "all_gather" with ``arg`` None) on its fast path if it has one and may take it now.

        Returns:
            The result when it ran, :data:`NOT_RUN` when the general path must run it.

        Raises:
            As :meth:`_Repeated.run`, or the job's failure.
        """
        if async_op or type(x) is not np.ndarray:
            return NOT_RUN
        try:
            # Only calls that _may_repeat are learned, so an argument of another type finds nothing.
            repeated = self._known.get((kind, x.dtype, x.shape, arg))
        except TypeError:  # an unhashable op or root: the general path says what is wrong with it
            return NOT_RUN
        if (
            repeated is None
            or not x.flags.c_contiguous
            or not repeated.accepts(x, out)
            or self._executor.queued  # earlier async calls first, in order (executor.idle, inline)
        ):
            return NOT_RUN
        self._check()
        return repeated.run(self._number(), x, out)

    def barrier(self, limit: float) -> bool:
        """Passes a barrier of at most ``limit`` seconds on its fast path if it has one and may take it
        now; False when the general path must run it.

        Raises:
            As :meth:`_Repeated.run`, or the job's failure.
        """
        repeated = self._known.get(_BARRIER_KEY)
        if repeated is None or self._executor.queued:
            return False
        self._check()
        repeated.run(self._number(), None, None, limit)
        return True

    def learn_barrier(self) -> None:
        """Prepares the barrier's fast path (once), after a barrier took the general path."""
        if _BARRIER_KEY not in self._known and self._enabled:
            self._known[_BARRIER_KEY] = _prepare("barrier", self._job, self._spec, self._stream, BARRIER, None, None)

    def has_fast_path(self, kind: str, x: np.ndarray | None = None, arg: ReduceOp | int | None = None) -> bool:
        """Whether ``kind`` calls like ``x`` with ``arg`` have a fast path now (for tests and diagnostics;
        a barrier: ``kind`` alone)."""
        key = _BARRIER_KEY if x is None else (kind, x.dtype, x.shape, arg)
        return self._known.get(key) is not None

    def learn(self, kind: str, x: Any, arg: Any, out: Any, async_op: bool, signature: Signature) -> None:
        """Prepares the fast path of ``kind`` calls like this one (which just took the general path with
        ``signature``), once per (kind, dtype, shape, arg), where such calls may take one at all.

        Raises:
            TypeError / ValueError: a bad op or root.
        """
        if not _may_repeat(x, arg, out, async_op):
            return
        key = (kind, x.dtype, x.shape, arg)
        if key in self._known:
            return
        if len(self._known) >= _KEPT:
            self._known.clear()
        prepared = _prepare(kind, self._job, self._spec, self._stream, signature, x, arg) if self._enabled else None
        self._known[key] = prepared


def _may_repeat(x: Any, arg: Any, out: Any, async_op: bool) -> bool:
    """Whether a call could ever take a fast path: synchronous, on a numpy array (not a subclass), into a
    new array or a numpy ``out``, with a ReduceOp, an int root or no argument (an all_gather); anything
    else the general path checks. Which ``out`` a fast path takes, :meth:`_Repeated.accepts` says."""
    return (
        not async_op
        and type(x) is np.ndarray
        and (arg is None or type(arg) in (ReduceOp, int))
        and (out is None or type(out) is np.ndarray)
    )
