"""The NCCL backend: collectives on CuPy arrays over ``cupy.cuda.nccl``.

One NCCL communicator per group, created on the group's first call (``group_comm.py``), each with its own
CUDA stream. Every operation is stream-ordered with the caller: the NCCL stream waits on an event
recorded on the caller's current stream before the operation, and the caller's stream waits on the
operation's completion event after it. The call then returns, as on torch's NCCL backend: the backend's
watchdog thread watches that event against the call's deadline and the job's failure (``watchdog.py``);
on a failure it aborts every communicator, so a dead peer becomes an error instead of a spinning
kernel, and the next call, ``Work.wait()`` or :meth:`NcclBackend.synchronize` raises it. With
``COLLSVC_NCCL_BLOCKING_WAIT=1`` every call waits for its operation on the host instead. Repeated calls
of one signature reuse their plan (``repeat.py``).

Arrays arrive flat and contiguous; the logical dtype comes from ``call.signature.dtype`` (bfloat16 comes
as a uint16 view because CuPy has no bfloat16). Data-movement collectives move raw bytes; reductions are
planned in ``dtypes.py``. Group indices (``root``, ``dst``, ``src``) are NCCL ranks.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from collsvc.client.backends.base import Backend, Call, CallHooks, GroupSpec, PreparedCall, Signature
from collsvc.client.backends.nccl.blocks import Blocks, ptr
from collsvc.client.backends.nccl.dtypes import Mode, ReducePlan, describe, plan_reduction
from collsvc.client.backends.nccl.group_comm import (
    Barrier,
    GroupComm,
    KeyValueLike,
    has_p2p,
    nccl_version,
)
from collsvc.client.backends.nccl.launcher import Launcher, Report
from collsvc.client.backends.nccl.probe import load_cupy
from collsvc.client.backends.nccl.watchdog import (
    FailureSource,
    Pending,
    Watchdog,
)
from collsvc.config import nccl_blocking_wait
from collsvc.errors import BackendUnavailableError, CollsvcError
from collsvc.types import ReduceOp

log = logging.getLogger(__name__)

__all__ = ["Barrier", "FailureSource", "KeyValueLike", "NcclBackend"]

_Body = Callable[[GroupComm, int], None]


class NcclBackend(Launcher):
    """Collectives on CuPy arrays through NCCL; implements the ``Backend`` protocol.

    Args:
        rank: this process's global rank (for logs).
        size: the world size.
        kv: the job's key/value store; group index 0 publishes the NCCL unique id under
            ``nccl/<group name>/uid``.
        barrier: ``barrier(name, timeout)`` over the members of the group being initialised; every
            member passes ``nccl-init/<group name>`` before NCCL is touched.
        timeout: the job's timeout in seconds (used in messages; deadlines come with each call).
        failure: the job's recorded failure, polled while waiting so a dead rank fails pending work.
        watchdog_grace: seconds past a deadline before the watchdog aborts an operation stuck inside NCCL.
        device: the CUDA ordinal this member reported when it joined (what the one-GPU-per-rank check
            ran on); arrays on another GPU are rejected. None accepts any GPU.
        blocking: whether each call waits on the host until the GPU finished it; None: from
            ``COLLSVC_NCCL_BLOCKING_WAIT`` (default: no, it returns once enqueued).
        report: ``report(call, error)`` for a failure the watchdog found after the call returned (a
            timeout, NCCL's error): returns the error to raise from then on (the call runner's ``on_failure``:
            it names the late ranks and records the job's failure). None: the error as found.

    Raises:
        BackendUnavailableError: no CuPy, no NCCL library or no GPU here (the message has the fix).
    """

    name = "nccl"

    def __init__(
        self,
        rank: int,
        size: int,
        kv: KeyValueLike,
        barrier: Barrier,
        timeout: float,
        failure: FailureSource,
        *,
        watchdog_grace: float = 1.0,
        device: int | None = None,
        blocking: bool | None = None,
        report: Report | None = None,
    ) -> None:
        self._cp, self._nccl = load_cupy()
        self.rank = rank
        self.size = size
        self._kv = kv
        self._barrier = barrier
        self._timeout = timeout
        self._failure = failure
        self._grace = watchdog_grace
        self._device = device
        self._version = nccl_version(self._nccl)
        self._has_avg = hasattr(self._nccl, "NCCL_AVG")
        self._p2p = has_p2p(self._nccl)
        self._comms: dict[str, GroupComm] = {}
        self._init_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._broken: CollsvcError | None = None
        self._closed = False
        self._watchdog = Watchdog(failure)
        self._blocking = nccl_blocking_wait() if blocking is None else blocking
        self._report = report
        self._reported = threading.Event()  # set once the error in _broken is final (reported)
        self._blocks = Blocks(self._cp, self._nccl)

    # ----------------------------------------------------------------- collectives

    def all_reduce(self, call: Call, buf: Any, op: ReduceOp) -> None:
        plan = self._plan(call, op)
        n = buf.size
        if plan.mode is Mode.FOLD:

            def fold(gc: GroupComm, stream: int) -> None:
                with gc.stream:
                    blocks = self._cp.empty((gc.group.size, n), dtype=buf.dtype)
                gc.comm.allGather(ptr(buf), ptr(blocks), buf.nbytes, self._blocks.byte_type, stream)
                self._blocks.fold(gc, blocks, buf, plan)

            self._run(call, buf.nbytes, [buf], fold)
            return

        def native(gc: GroupComm, stream: int) -> None:
            count = n * plan.factor
            gc.comm.allReduce(ptr(buf), ptr(buf), count, self._attr(plan.nccl_dtype), self._attr(plan.nccl_op), stream)
            self._blocks.maybe_divide(gc, buf, plan)

        self._run(call, buf.nbytes, [buf], native)

    def reduce(self, call: Call, buf: Any, op: ReduceOp, root: int) -> None:
        plan = self._plan(call, op)
        n = buf.size
        if plan.mode is Mode.FOLD:
            self._need_p2p(call)

            def fold(gc: GroupComm, stream: int) -> None:
                me = gc.group.index
                with gc.stream:
                    blocks = self._cp.empty((gc.group.size, n), dtype=buf.dtype) if me == root else None
                with self._blocks.grouped():
                    if blocks is None:
                        gc.comm.send(ptr(buf), buf.nbytes, self._blocks.byte_type, root, stream)
                    else:
                        self._blocks.gather_into(gc, stream, blocks, buf, buf.nbytes)
                if blocks is not None:
                    self._blocks.fold(gc, blocks, buf, plan)

            self._run(call, buf.nbytes, [buf], fold)
            return

        def native(gc: GroupComm, stream: int) -> None:
            count = n * plan.factor
            dtype, nccl_op = self._attr(plan.nccl_dtype), self._attr(plan.nccl_op)
            gc.comm.reduce(ptr(buf), ptr(buf), count, dtype, nccl_op, root, stream)
            if gc.group.index == root:
                self._blocks.maybe_divide(gc, buf, plan)

        self._run(call, buf.nbytes, [buf], native)

    def broadcast(self, call: Call, buf: Any, root: int) -> None:
        def body(gc: GroupComm, stream: int) -> None:
            gc.comm.broadcast(ptr(buf), ptr(buf), buf.nbytes, self._blocks.byte_type, root, stream)

        self._run(call, buf.nbytes, [buf], body)

    def all_gather(self, call: Call, src: Any, out: Any) -> None:
        def body(gc: GroupComm, stream: int) -> None:
            gc.comm.allGather(ptr(src), ptr(out), src.nbytes, self._blocks.byte_type, stream)

        self._run(call, src.nbytes, [src, out], body)

    def reduce_scatter(self, call: Call, src: Any, out: Any, op: ReduceOp) -> None:
        plan = self._plan(call, op)
        n = out.size
        if plan.mode is Mode.FOLD:
            self._need_p2p(call)

            def fold(gc: GroupComm, stream: int) -> None:
                with gc.stream:
                    blocks = self._cp.empty((gc.group.size, n), dtype=out.dtype)
                with self._blocks.grouped():
                    self._blocks.all_to_all(gc, stream, src, blocks, out.nbytes)
                self._blocks.fold(gc, blocks, out, plan)

            self._run(call, out.nbytes, [src, out], fold)
            return

        def native(gc: GroupComm, stream: int) -> None:
            count = n * plan.factor
            dtype, nccl_op = self._attr(plan.nccl_dtype), self._attr(plan.nccl_op)
            gc.comm.reduceScatter(ptr(src), ptr(out), count, dtype, nccl_op, stream)
            self._blocks.maybe_divide(gc, out, plan)

        self._run(call, out.nbytes, [src, out], native)

    def gather(self, call: Call, src: Any, out: Any | None, root: int) -> None:
        self._need_p2p(call)

        def body(gc: GroupComm, stream: int) -> None:
            with self._blocks.grouped():
                if gc.group.index == root:
                    self._blocks.gather_into(gc, stream, out, src, src.nbytes)
                else:
                    gc.comm.send(ptr(src), src.nbytes, self._blocks.byte_type, root, stream)

        self._run(call, src.nbytes, [src, out], body)

    def scatter(self, call: Call, src: Any | None, out: Any, root: int) -> None:
        self._need_p2p(call)
        nb = out.nbytes

        def body(gc: GroupComm, stream: int) -> None:
            me = gc.group.index
            with self._blocks.grouped():
                if me != root:
                    gc.comm.recv(ptr(out), nb, self._blocks.byte_type, root, stream)
                    return
                for r in range(gc.group.size):
                    if r == me:
                        self._blocks.copy(ptr(out), ptr(src) + r * nb, nb, stream)
                    else:
                        gc.comm.send(ptr(src) + r * nb, nb, self._blocks.byte_type, r, stream)

        self._run(call, nb, [out, src], body)

    def all_to_all(self, call: Call, src: Any, out: Any) -> None:
        self._need_p2p(call)

        def body(gc: GroupComm, stream: int) -> None:
            with self._blocks.grouped():
                self._blocks.all_to_all(gc, stream, src, out, out.nbytes // gc.group.size)

        self._run(call, out.nbytes, [src, out], body)

    def send(self, call: Call, buf: Any, dst: int) -> None:
        self._need_p2p(call)

        def body(gc: GroupComm, stream: int) -> None:
            gc.comm.send(ptr(buf), buf.nbytes, self._blocks.byte_type, dst, stream)

        self._run(call, buf.nbytes, [buf], body)

    def recv(self, call: Call, out: Any, src: int) -> None:
        self._need_p2p(call)

        def body(gc: GroupComm, stream: int) -> None:
            gc.comm.recv(ptr(out), out.nbytes, self._blocks.byte_type, src, stream)

        self._run(call, out.nbytes, [out], body)

    # ----------------------------------------------------------------- lifecycle

    def barrier(self, call: Call) -> bool:
        """No data-plane barrier here: barriers are host-side calls (the ring's or the coordinator's)."""
        return False

    def prepare(
        self, kind: str, signature: Signature, group: GroupSpec, hooks: CallHooks, like: Any = None
    ) -> PreparedCall | None:
        """No faster road through this seam: repeated all_reduce calls of CuPy arrays are learned by
        their own fast path (``nccl/repeat.py``), keyed by the arrays' identity, which the Communicator
        hands them to."""
        return None

    # ----------------------------------------------------------------- the template (launching: launcher.py)

    def _run(self, call: Call, nbytes: int, arrays: list[Any], body: _Body) -> None:
        """Checks, ordering, the completion watch and error mapping, written once for every op."""
        self._check_usable()
        if nbytes == 0:
            return  # every member has the same signature, so every member skips
        device = next(int(a.device.id) for a in arrays if a is not None)
        if any(a is not None and int(a.device.id) != device for a in arrays):
            raise ValueError(f"{call.signature.op}: all arrays must be on the same GPU")
        self._check_device(call, device)
        gc = self._comm_for(call, device)
        sig = call.signature
        description = functools.partial(
            describe, sig.op, sig.dtype, sig.shape, sig.reduce_op, call.group.name, call.seq
        )
        pending = Pending(description, call.deadline, call.timeout or self._timeout, self._failed, call=call)
        self.launch(gc, pending, body, (gc,))

    def _check_device(self, call: Call, device: int) -> None:
        if self._device is not None and device != self._device:
            raise ValueError(
                f"rank {self.rank}: {call.signature.op} got an array on GPU {device}, but this rank reported GPU "
                f"{self._device} when it joined (from its local rank, or the current GPU at init) and the "
                f"one-GPU-per-rank check ran on that; select it before allocating: "
                f"cupy.cuda.Device({self._device}).use() or torch.cuda.set_device({self._device})"
            )

    def native_all_reduce(self, signature: Any, op: ReduceOp, size: int) -> tuple[int, int, int] | None:
        """``(count, NCCL dtype, NCCL op)`` of an all_reduce of ``signature`` that is one native NCCL
        call; None where it is more (a fold, a division) or not allowed."""
        try:
            plan = plan_reduction(op, signature.dtype, self._version, self._has_avg)
        except TypeError:
            return None
        if plan.mode is not Mode.NATIVE:
            return None
        return size * plan.factor, self._attr(plan.nccl_dtype), self._attr(plan.nccl_op)

    # ----------------------------------------------------------------- helpers

    def _attr(self, name: str) -> int:
        return int(getattr(self._nccl, name))

    def _plan(self, call: Call, op: ReduceOp) -> ReducePlan:
        plan = plan_reduction(op, call.signature.dtype, self._version, self._has_avg)
        if plan.mode is Mode.SUM_THEN_DIVIDE and call.signature.dtype == "bfloat16":
            raise TypeError("AVG of bfloat16 needs NCCL_AVG (NCCL >= 2.10)")
        return plan

    def _need_p2p(self, call: Call) -> None:
        if not self._p2p:
            raise BackendUnavailableError(
                f"{call.signature.op} on the nccl backend needs NCCL >= 2.7 send/recv (version code {self._version})"
            )


_CHECKED_AGAINST_THE_PROTOCOL: type[Backend] = NcclBackend  # mypy checks every method against Backend
