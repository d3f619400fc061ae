"""Repeated calls on a shared-memory group: what the ring backend's ``prepare`` gives the Communicator's
fast path (``client/fast_path.py``) for a group all on this host. One class per collective, each
holding what a call of one (collective, dtype, shape, op or root) needs, worked out once
(:func:`prepare_repeated`).

Calls that fit one shared-memory step run the group's prepared methods (``shm/prepared.py``); larger
ones (``RepeatedChunked*``) and every all_to_all (``RepeatedAllToAll``) run the group's own pipelined
method directly: the same steps and descriptors as the general path, without the general layers
around it (argument adaptation, work buffers, a ``Call``, recorder spans, the group lookup), which cost
tens of microseconds per call. Each records progress, statistics and failures through the
``CallHooks`` it was prepared with, bound once.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from collsvc.client.backends.base import Call, CallHooks, GroupSpec, Signature
from collsvc.client.backends.reduction import finish_average, reduced_as
from collsvc.client.backends.ring.global_ranks import in_global_ranks
from collsvc.client.backends.shm.group import LocalGroup
from collsvc.client.backends.shm.groups import CallWatch
from collsvc.errors import CollsvcError
from collsvc.types import ReduceOp

# The shared-memory group of a Communicator on one host, as ``RingBackend.existing_shared`` finds it: the
# group, the watch that must follow each call (its departure check and mismatch label), and the global
# ranks of its members (to name a mismatch).
Shared = tuple[LocalGroup, CallWatch, tuple[int, ...]]


def prepare_repeated(
    kind: str, signature: Signature, spec: GroupSpec, hooks: CallHooks, shared: Shared, like: np.ndarray | None
) -> RepeatedCall | None:
    """Later calls like one that just took the general path with ``signature`` on the shared-memory group
    ``shared`` (``like``: its numpy array, None for a barrier; the op of an all_reduce or reduce_scatter
    and the root of a broadcast are the signature's), or None where they cannot take a faster road (a
    dtype numpy has no reduction loop for, ...).

    Raises:
        CollsvcError: the group failed meanwhile (the caller then keeps the general path, which raises it).
        TypeError / ValueError: a bad op or root (the general path raised them first).
    """
    group = shared[0]
    digest = signature.digest
    common = (hooks, spec, signature, shared)
    if kind == "barrier":
        waiting = group.prepare_barrier(digest)
        return None if waiting is None else RepeatedBarrier(*common, waiting)
    assert like is not None  # every other kind has an array
    x = like
    op = ReduceOp[signature.reduce_op] if signature.reduce_op else None
    average_over = spec.size if op is ReduceOp.AVG else 0
    if kind == "all_reduce":
        assert op is not None
        reducing = group.prepare_all_reduce(x.dtype, x.size, reduced_as(op), digest, x.shape)
        if reducing is not None:
            return RepeatedAllReduce(*common, reducing, average_over)
        chunked = group.prepare_chunked("all_reduce", x.dtype, x.size, reduced_as(op), digest)
        return None if chunked is None else RepeatedChunkedAllReduce(*common, chunked, average_over)
    if kind == "broadcast":
        root = signature.root
        assert root is not None
        sending = group.prepare_broadcast(x.dtype, x.size, root, digest, x.shape)
        if sending is not None:
            return RepeatedBroadcast(*common, sending)
        chunked = group.prepare_chunked("broadcast", x.dtype, x.size, root, digest)
        return None if chunked is None else RepeatedChunkedBroadcast(*common, chunked)
    if kind == "all_gather":
        shape = x.shape or (1,)  # a 0-d array counts as shape (1,)
        gathered = (spec.size * shape[0], *shape[1:])
        gathering = group.prepare_all_gather(x.dtype, x.size, digest)
        if gathering is not None:
            return RepeatedAllGather(gathered, *common, gathering)
        chunked = group.prepare_chunked("all_gather", x.dtype, x.size, None, digest)
        return None if chunked is None else RepeatedChunkedAllGather(gathered, *common, chunked)
    if kind == "all_to_all":
        moving = group.prepare_chunked("all_to_all", x.dtype, x.size // spec.size, None, digest)
        return None if moving is None else RepeatedAllToAll(x.shape, *common, moving)
    assert op is not None  # a reduce_scatter
    block_shape = (x.shape[0] // spec.size, *x.shape[1:])
    count = x.size // spec.size
    scattering = group.prepare_reduce_scatter(x.dtype, count, reduced_as(op), digest)
    if scattering is not None:
        return RepeatedReduceScatter(block_shape, *common, scattering, average_over)
    chunked = group.prepare_chunked("reduce_scatter", x.dtype, count, reduced_as(op), digest)
    return None if chunked is None else RepeatedChunkedReduceScatter(block_shape, *common, chunked, average_over)


class RepeatedCall:
    """Calls of one collective, shape and argument (op or root) of one Communicator, on its shared-memory
    group: the bookkeeping every call does (numbering is the caller's), around :meth:`_move`."""

    __slots__ = (
        "_failed",
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
        hooks: CallHooks,
        spec: GroupSpec,
        signature: Signature,
        shared: Shared,
        plan: Any,
        average_over: int = 0,
    ) -> None:
        """``hooks``: what the calls record through (bound here, once); ``plan``: what the group's
        ``prepare_*`` made for these calls; ``average_over``: the group size to divide a sum by (AVG), else 0."""
        self._failed = hooks.failed
        self._spec = spec
        self._stream = hooks.stream
        self._signature, self._text = signature, signature.text
        self._group, self._watch, self._local = shared
        self._plan = plan
        self._average_over = average_over
        self._progress = hooks.progress()
        self._counter = hooks.counter(signature, spec)
        self._limit = hooks.limit

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
            error = in_global_ranks(call, self._local, exc)
            span = (call, int(started * 1e9), 0)
            raise self._failed(call, record, span, error) from error
        ended = time.time()
        self._progress.finish(record, ended)
        if self._counter is not None:
            self._counter.add(ended - started)
        return result

    def _move(self, x: Any, out: np.ndarray | None, deadline: float) -> Any:
        raise NotImplementedError


class RepeatedBarrier(RepeatedCall):
    """Barriers of one Communicator."""

    __slots__ = ()

    def _move(self, x: Any, out: Any, deadline: float) -> None:
        self._group.run_barrier(self._plan, deadline)


class RepeatedAllReduce(RepeatedCall):
    """All_reduce calls of one (dtype, shape, op)."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        result = x if out is x else np.empty_like(x)
        self._group.run_all_reduce(self._plan, x, result, deadline)
        if self._average_over:
            finish_average(result, self._average_over)
        return result


class RepeatedBroadcast(RepeatedCall):
    """Broadcasts of one (dtype, shape, root): the root's ``x`` is read, the others' written."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        if self._plan.is_root:
            self._group.run_broadcast(self._plan, x, deadline)
            return x if out is x else x.copy()
        result = x if out is x else np.empty_like(x)
        self._group.run_broadcast(self._plan, result, deadline)
        return result


class _RepeatedIntoNewShape(RepeatedCall):
    """Calls whose result has another shape than ``x`` (all_gather, reduce_scatter): into a new array or
    a given ``out`` of that shape."""

    __slots__ = ("_result_shape",)

    def __init__(self, result_shape: tuple[int, ...], *args: Any) -> None:
        """``result_shape``: every result's; ``args``: as :class:`RepeatedCall`'s."""
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


# -- calls larger than one step: the group's pipelined methods, called directly ----------------------------


class RepeatedChunkedAllReduce(RepeatedCall):
    """All_reduce calls of one (dtype, shape, op) too large for one step (``plan``: a ``ChunkedCall``
    whose ``arg`` is the op the data is combined with)."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        result = x if out is x else x.copy()
        self._group.all_reduce(result, self._plan.arg, deadline, digest=self._plan.digest)
        if self._average_over:
            finish_average(result, self._average_over)
        return result


class RepeatedChunkedBroadcast(RepeatedCall):
    """Broadcasts of one (dtype, shape, root) too large for one step (``plan.arg``: the root)."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        root = self._plan.arg
        if root == self._group.rank:
            sent = x if x.flags.writeable else x.copy()  # the group's method takes writable buffers only
            self._group.broadcast(sent, root, deadline, digest=self._plan.digest)
            if out is x:
                return x
            return sent if sent is not x else x.copy()
        result = x if out is x else np.empty_like(x)
        self._group.broadcast(result, root, deadline, digest=self._plan.digest)
        return result


class RepeatedChunkedAllGather(_RepeatedIntoNewShape):
    """All_gathers of one (dtype, shape) too large for one step."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        result = self._result(x, out)
        self._group.all_gather(x.reshape(-1), result.reshape(-1), deadline, digest=self._plan.digest)
        return result


class RepeatedChunkedReduceScatter(_RepeatedIntoNewShape):
    """Reduce_scatters of one (dtype, shape, op) too large for one step (``plan.arg``: the op the data
    is combined with)."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        result = self._result(x, out)
        plan = self._plan
        self._group.reduce_scatter(x.reshape(-1), result.reshape(-1), plan.arg, deadline, digest=plan.digest)
        if self._average_over:
            finish_average(result, self._average_over)
        return result


class RepeatedAllToAll(_RepeatedIntoNewShape):
    """All_to_all calls of one (dtype, shape), every size: the group's own method (``plan``: a
    ``ChunkedCall``)."""

    __slots__ = ()

    def _move(self, x: np.ndarray, out: np.ndarray | None, deadline: float) -> np.ndarray:
        result = self._result(x, out)
        self._group.all_to_all(x.reshape(-1), result.reshape(-1), deadline, digest=self._plan.digest)
        return result
