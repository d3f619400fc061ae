"""Repeated GPU all_reduce calls on NCCL, without the general layers: the GPU side of the Communicator's
fast path (``client/fast_path.py`` hands CuPy arrays here).

The general path adapts the array, plans a work buffer, builds a ``Call``, a progress record and a
recorder span, enters the caller's device and stream, looks the group's communicator up and plans the
reduction, on every call. Once a synchronous all_reduce of a CuPy array took it, what it worked out for
(dtype, shape, op) is kept: the signature, the communicator, the NCCL element type, count and
reduction. A later call of a contiguous CuPy array of that dtype and shape, in place or into a new
array, then only numbers itself, records its progress and statistics, and enqueues the one
``ncclAllReduce`` through :meth:`NcclBackend.launch`: ordered on the caller's stream, watched by the
watchdog, returning once enqueued, as the general path does.

What the peers see is what the general path produces (the same NCCL call with the same sequence
number and progress record), so ranks may take either path for the same call; NCCL itself has no
per-call signature check on either path (docs/gpu.md). A call that differs in dtype, shape or op, or an
``out`` other than ``x``, takes the general path; so do async calls, calls queued behind async ones,
a job recording its timeline, reductions NCCL lacks (bitwise, AVG without ``NCCL_AVG``),
``COLLSVC_FAST_PATH=0``, and a broken or closed backend (which then raises from the general path).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from collsvc.client.backends.base import Backend, Call, CallHooks, GroupSpec, Signature
from collsvc.client.backends.nccl.backend import NcclBackend
from collsvc.client.backends.nccl.dtypes import describe
from collsvc.client.backends.nccl.watchdog import Pending
from collsvc.errors import CollsvcError
from collsvc.types import ReduceOp

_KEPT = 64  # (dtype, shape, op) kept per Communicator before starting over


class _RepeatedPending(Pending):
    """A fast-path operation: its description and ``Call`` are made only if it fails."""

    __slots__ = ("_owner", "_seq")

    def __init__(self, owner: RepeatedGpuAllReduce, seq: int, deadline: float, timeout: float) -> None:
        self._owner, self._seq = owner, seq
        self.deadline = self.act_at = deadline
        self.timeout = timeout
        self._lock = threading.Lock()
        self.error = None
        self.event = None
        self.call = None

    @property
    def description(self) -> str:
        sig, spec = self._owner.signature, self._owner.spec
        return describe(sig.op, sig.dtype, sig.shape, sig.reduce_op, spec.name, self._seq)

    def made_call(self) -> Call:
        return self._owner.call(self._seq, self.deadline)


class RepeatedGpuAllReduce:
    """All_reduce calls of one (dtype, shape, op) of one Communicator, on its NCCL communicator."""

    __slots__ = (
        "_failed", "_backend", "spec", "_stream", "signature", "_text", "_gc", "_args", "_progress", "_counter",
        "_limit", "_cupy", "_enqueue",
    )  # fmt: skip

    def __init__(
        self,
        hooks: CallHooks,
        backend: NcclBackend,
        spec: GroupSpec,
        signature: Signature,
        gc: Any,
        args: tuple[int, ...],
    ) -> None:
        self._failed, self._backend, self.spec, self._stream = hooks.failed, backend, spec, hooks.stream
        self.signature, self._text, self._gc, self._args = signature, signature.text, gc, args
        self._progress = hooks.progress()
        self._counter = hooks.counter(signature, spec)
        self._limit = float(hooks.limit)
        self._cupy = backend.cupy
        self._enqueue = gc.comm.allReduce

    def call(self, seq: int, deadline: float) -> Call:
        """Call ``seq`` as the general path would have made it."""
        return Call(self.spec, self._stream, seq, self.signature, deadline, self._limit)

    def run(self, seq: int, x: Any, out: Any) -> Any:
        """Call ``seq`` of the stream: ``x`` reduced in place (``out is x``) or into a new array.

        Raises:
            CollsvcError: as the general path raises it, recorded and reported the same way.
        """
        limit = self._limit
        started = time.time()
        deadline = time.monotonic() + limit
        record = self._progress.start(seq, self._text, started)
        pending = _RepeatedPending(self, seq, deadline, limit)
        try:
            result = x if out is x else self._cupy.array(x, copy=True, order="C")
            address = result.data.ptr
            count, dtype, op = self._args
            self._backend.launch(self._gc, pending, self._enqueue, (address, address, count, dtype, op))
        except CollsvcError as exc:
            made = self.call(seq, deadline)
            raise self._failed(made, record, (made, int(started * 1e9), 0), exc) from exc
        ended = time.time()
        self._progress.finish(record, ended)
        if self._counter is not None:
            self._counter.add(ended - started)
        return result


class GpuRepeatedCalls:
    """The GPU fast paths of one Communicator, by (dtype, shape, op), learned from the general path.

    Args:
        backend: the job's NCCL backend.
        spec: the Communicator's members.
        hooks: what its calls record through (``client/calls.py``), in the Communicator's stream.
    """

    def __init__(self, backend: Backend, spec: GroupSpec, hooks: CallHooks) -> None:
        assert isinstance(backend, NcclBackend)  # the Communicator's GPU backend on a job on NCCL
        self._hooks, self._spec = hooks, spec
        self._backend: NcclBackend = backend
        self._array_type: Any = self._backend.array_type
        self._known: dict[tuple[Any, ...], RepeatedGpuAllReduce | None] = {}
        self._kept: list[tuple[Any, Any]] = []

    def run(self, kind: str, x: Any, arg: Any, out: Any) -> RepeatedGpuAllReduce | None:
        """The fast path for a synchronous ``kind`` call of ``x`` with ``arg`` and ``out``, or None
        where the general path must run it (the caller checks the job and numbers the call)."""
        if kind != "all_reduce" or type(x) is not self._array_type or (out is not None and out is not x):
            return None
        # By identity: hashing a dtype or a ReduceOp costs a microsecond each; the plans keep both alive.
        repeated = self._known.get((id(x.dtype), x.shape, id(arg)))
        if repeated is None or not x.flags.c_contiguous:
            return None
        return repeated

    def learn(self, kind: str, x: Any, arg: Any, out: Any, signature: Signature) -> bool:
        """Prepares the fast path of calls like this one (which just took the general path with
        ``signature``) where they may take one; False when ``x`` is no CuPy array (not for this path)."""
        if type(x) is not self._array_type:
            return False
        if kind != "all_reduce" or type(arg) is not ReduceOp or (out is not None and out is not x):
            return True
        key = (id(x.dtype), x.shape, id(arg))
        if key in self._known:
            return True
        if len(self._known) >= _KEPT:
            self._known.clear()
            self._kept.clear()
        self._known[key] = self._prepare(x, arg, signature)
        self._kept.append((x.dtype, arg))  # the objects whose ids are in the key stay alive with it
        return True

    def _prepare(self, x: Any, op: ReduceOp, signature: Signature) -> RepeatedGpuAllReduce | None:
        backend = self._backend
        if self._hooks.recording_timeline or not x.flags.c_contiguous or x.size == 0:
            return None
        args = backend.native_all_reduce(signature, op, int(x.size))
        gc = backend.existing_comm(self._spec, int(x.device.id))
        if args is None or gc is None:
            return None
        return RepeatedGpuAllReduce(self._hooks, backend, self._spec, signature, gc, args)
