"""Repeated synchronous all_reduce, broadcast, all_gather, reduce_scatter and all_to_all calls of numpy
arrays (and of CPU torch tensors, through numpy views of them kept per tensor), and barriers, within one
host, without the general layers.

A training loop calls all_reduce with the same few shapes over and over. The general path (``ops.py``,
``Communicator._issue``, ``CallRunner.execute``, the backend) adapts the array, plans a work buffer, builds a
``Call``, a progress record and a recorder span, and looks the shared-memory group up, on every call:
for a 4 KiB array that is most of the call's time. Once a call took the one-barrier shared-memory path,
the Communicator keeps what it worked out for that (collective, dtype, shape, op or root): the
signature, the group, the step's descriptor, the slot views. A later call with a contiguous numpy
array then only numbers itself, records its progress and statistics, copies into its slot, meets the
peers at the same barrier with the same descriptor (so the mismatch check stays on), and reduces or
copies out (a broadcast: the root copies in, the others copy out; an all_gather: every rank copies
every block out; a reduce_scatter: every rank reduces its own block; a barrier: only the step).
Progress and statistics go through objects held per stream and per call kind
(``StreamProgress``, ``RepeatedCallCounter``): no lookups or locks per call. Calls too large for one
step (all_reduce, all_gather and reduce_scatter above 64 KiB, a broadcast above 256 KiB) and every
all_to_all run the group's own pipelined method directly, skipping the same general layers. What the
calls run on is the backend's: the fast path asks ``Backend.prepare`` for a prepared call (the ring
backend's shared-memory groups: ``backends/shm/repeated.py``) and knows no backend's internals.

Everything the peers see is what the general path produces, so ranks may take either path for the
same call. A failure is recorded and mapped exactly as the general path does it (``CallRunner.call_failed``).
Calls that differ in any way take the general path: ``async_op``, an ``out`` other than ``x`` (all_gather
and reduce_scatter: other than a C-contiguous array of the result's shape apart from ``x``), a non-contiguous or
read-only array, a tensor numpy cannot view (CUDA, bfloat16, one that requires grad), calls queued on the
worker thread, or a job recording its timeline. A tensor's result comes back as the general path gives
it: ``out`` itself, or a new CPU tensor sharing the result's memory.
``COLLSVC_FAST_PATH=0`` sends every call the general way. Repeated all_reduce calls of CuPy arrays on a
job on NCCL have their own fast path (``backends/nccl/repeat.py``), which :meth:`RepeatedCalls.run` and
:meth:`RepeatedCalls.learn` hand them to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from collsvc.arrays import as_torch_like, kept_torch_view
from collsvc.client.backends.base import Backend, CallHooks, GroupSpec, PreparedCall, Signature
from collsvc.client.calls import CallRunner
from collsvc.config import fast_path_enabled
from collsvc.types import ReduceOp

# Every barrier's signature: a barrier carries no data.
BARRIER = Signature.of("barrier", "", ())
# What a Communicator keeps a fast path by: (collective, dtype, shape, op or root); a barrier's: no data.
_Key = tuple[str, np.dtype | None, tuple[int, ...] | None, ReduceOp | int | None]
_BARRIER_KEY: _Key = ("barrier", None, None, None)
# What RepeatedCalls.run returns for a call it did not run (None is a result: a reduce's on other ranks).
NOT_RUN: Any = object()


# How many (collective, dtype, shape, op or root) a Communicator keeps a fast path for (then it starts over).
_KEPT = 64


class RepeatedCalls:
    """The fast paths of one Communicator's calls, by (collective, dtype, shape, op or root), and of its
    barriers, learned from the general path.

    Args:
        calls: the job's call runner (what the calls record through, the job's failure flags).
        cpu / gpu: the backends of the Communicator's numpy arrays and, on a job on NCCL, CuPy arrays.
        spec: the Communicator's members; its calls are numbered in the stream of its name.
        check_usable: raises the job's failure or a member's departure (before a call is numbered).
        number: numbers the next call of the Communicator's stream.
    """

    def __init__(
        self,
        calls: CallRunner,
        cpu: Backend,
        gpu: Backend | None,
        spec: GroupSpec,
        check_usable: Callable[[], None],
        number: Callable[[], int],
    ) -> None:
        self._calls, self._cpu, self._spec = calls, cpu, spec
        self._hooks = calls.hooks(spec.name)
        self._check_usable, self._number = check_usable, number
        self._failure, self._departures, self._executor = calls.failure, calls.departed, calls.executor_of(spec.name)
        self._known: dict[_Key, PreparedCall | None] = {}
        self._enabled = fast_path_enabled()
        self._gpu = gpu_calls(gpu, spec, self._hooks) if self._enabled else None  # CuPy arrays on NCCL

    def close(self) -> None:
        """The Communicator closed: every later call takes the general path (which raises that)."""
        self._enabled = False
        self._known = {}
        self._gpu = None

    def _check(self) -> None:
        """Raises what the Communicator's usability check raises (the job's failure, a member's departure,
        a closed job); the flags first, without a call, while none is set."""
        if self._failure.recorded is not None or self._departures.anyone_left or self._calls.closed:
            self._check_usable()

    def run(self, kind: str, x: Any, arg: Any, out: Any, async_op: bool) -> Any:
        """Runs a ``kind`` call ("all_reduce" or "reduce_scatter" with op ``arg``, "broadcast" from root
        ``arg``, "all_gather" or "all_to_all" with ``arg`` None) on its fast path if it has one and may
        take it now.

        Returns:
            The result when it ran, :data:`NOT_RUN` when the general path must run it.

        Raises:
            As ``PreparedCall.run`` (``backends/base.py``), or the job's failure.
        """
        if async_op:
            return NOT_RUN
        if type(x) is not np.ndarray:
            gpu = None if self._gpu is None else self._gpu.run(kind, x, arg, out)
            if gpu is None:
                return self._run_tensor(kind, x, arg, out)
            if self._executor.queued:
                return NOT_RUN
            self._check()
            return gpu.run(self._number(), x, out)
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

    def _run_tensor(self, kind: str, x: Any, arg: Any, out: Any) -> Any:
        """:meth:`run` for a CPU torch tensor ``x``: the same fast path on its kept numpy view
        (:func:`~collsvc.arrays.kept_torch_view`; the caller holds ``x`` through this synchronous call),
        the result given back as the general path gives it (``out`` itself, or a new tensor)."""
        views = _tensor_views(x, out)
        if views is None:
            return NOT_RUN
        result = self.run(kind, views[0], arg, views[1], False)
        if result is NOT_RUN:
            return NOT_RUN
        return as_torch_like(result, x) if out is None else out

    def barrier(self, limit: float) -> bool:
        """Passes a barrier of at most ``limit`` seconds on its fast path if it has one and may take it
        now; False when the general path must run it.

        Raises:
            As ``PreparedCall.run`` (``backends/base.py``), or the job's failure.
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
            self._known[_BARRIER_KEY] = self._prepare("barrier", BARRIER, None)

    def has_fast_path(
        self, kind: str, x: np.ndarray | None = None, arg: ReduceOp | int | None = None, out: Any = None
    ) -> bool:
        """Whether ``kind`` calls like ``x`` with ``arg`` and ``out`` (None: a new result) would take a fast
        path now (for tests and diagnostics; a barrier: ``kind`` alone)."""
        if x is None:
            return self._known.get(_BARRIER_KEY) is not None
        repeated = self._known.get((kind, x.dtype, x.shape, arg))
        return repeated is not None and bool(x.flags.c_contiguous) and repeated.accepts(x, out)

    def learn(self, kind: str, x: Any, arg: Any, out: Any, async_op: bool, signature: Signature) -> None:
        """Prepares the fast path of ``kind`` calls like this one (which just took the general path with
        ``signature``), once per (kind, dtype, shape, arg), where such calls may take one at all.

        Raises:
            TypeError / ValueError: a bad op or root.
        """
        if self._gpu is not None and not async_op and self._gpu.learn(kind, x, arg, out, signature):
            return
        if type(x) is not np.ndarray and not async_op:  # a CPU torch tensor: the path of its view
            views = _tensor_views(x, out)
            if views is None:
                return
            x, out = views
        if not _may_repeat(x, arg, out, async_op):
            return
        key = (kind, x.dtype, x.shape, arg)
        if key in self._known:
            return
        if len(self._known) >= _KEPT:
            self._known.clear()
        prepared = self._prepare(kind, signature, x) if self._enabled else None
        self._known[key] = prepared

    def _prepare(self, kind: str, signature: Signature, x: np.ndarray | None) -> PreparedCall | None:
        """The backend's faster road for later ``kind`` calls like this one (``x``: its numpy array, None
        for a barrier), or None (the group is not all on this host, a dtype numpy has no reduction
        loop for, a job recording its timeline, ...).

        Raises:
            TypeError / ValueError: a bad op or root (the general path raised them first).
        """
        if self._hooks.recording_timeline:
            return None  # the timeline records per-call phases the general path measures
        return self._cpu.prepare(kind, signature, self._spec, self._hooks, x)


def gpu_calls(gpu: Backend | None, spec: GroupSpec, hooks: CallHooks) -> Any:
    """The GPU fast path's calls of a Communicator (``backends/nccl/repeat.py``) on a job on NCCL, else None."""
    if gpu is None:
        return None
    from collsvc.client.backends.nccl.repeat import GpuRepeatedCalls

    return GpuRepeatedCalls(gpu, spec, hooks)


def _tensor_views(x: Any, out: Any) -> tuple[np.ndarray, np.ndarray | None] | None:
    """``x`` (a CPU torch tensor) and ``out`` (None, ``x`` itself, or another tensor) as their kept numpy
    views (:func:`~collsvc.arrays.kept_torch_view`), ``out is x`` kept as the same view; None where
    numpy cannot view one of them."""
    view = kept_torch_view(x)
    if view is None:
        return None
    if out is None or out is x:
        return view, (None if out is None else view)
    out_view = kept_torch_view(out)
    return None if out_view is None else (view, out_view)


def _may_repeat(x: Any, arg: Any, out: Any, async_op: bool) -> bool:
    """Whether a call could ever take a fast path: synchronous, on a numpy array (not a subclass), into a
    new array or a numpy ``out``, with a ReduceOp, an int root or no argument (an all_gather); anything
    else the general path checks. Which ``out`` a fast path takes, ``PreparedCall.accepts`` says."""
    return (
        not async_op
        and type(x) is np.ndarray
        and (arg is None or type(arg) in (ReduceOp, int))
        and (out is None or type(out) is np.ndarray)
    )
