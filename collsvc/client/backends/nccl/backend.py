"""The NCCL backend: collectives on CuPy arrays over ``cupy.cuda.nccl``.

One NCCL communicator per group, created on the group's first call (``group_comm.py``), each with its own
CUDA stream. Every operation is stream-ordered with the caller: the NCCL stream waits on an event
recorded on the caller's current stream before the operation, and the caller's stream waits on the
operation's completion event after it. The calling thread then waits for that event with the call's
deadline (``watchdog.py``), so a dead peer becomes an error instead of a spinning kernel.

Arrays arrive flat and contiguous; the logical dtype comes from ``call.signature.dtype`` (bfloat16 comes
as a uint16 view because CuPy has no bfloat16). Data-movement collectives move raw bytes; reductions are
planned in ``dtypes.py``. Group indices (``root``, ``dst``, ``src``) are NCCL ranks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from collsvc.client.backends.base import Backend, Call
from collsvc.client.backends.nccl.blocks import Blocks, ptr
from collsvc.client.backends.nccl.dtypes import Mode, ReducePlan, describe, plan_reduction
from collsvc.client.backends.nccl.group_comm import (
    Barrier,
    GroupComm,
    KeyValueLike,
    create_group_comm,
    has_p2p,
    nccl_version,
)
from collsvc.client.backends.nccl.probe import load_cupy
from collsvc.client.backends.nccl.watchdog import (
    FailureSource,
    Pending,
    Watchdog,
    as_collsvc_error,
    wait_for,
)
from collsvc.errors import BackendUnavailableError, CollsvcError
from collsvc.types import ReduceOp

log = logging.getLogger(__name__)

__all__ = ["Barrier", "FailureSource", "KeyValueLike", "NcclBackend"]

_Body = Callable[[GroupComm, int], None]


class NcclBackend:
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
        self._watchdog = Watchdog(failure, grace=watchdog_grace)
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

    def barrier(self, call: Call, across_hosts: Callable[[Sequence[int]], None]) -> bool:
        """No data-plane barrier here: barriers are host-side calls (the ring's or the coordinator's)."""
        return False

    def abort(self, error: BaseException) -> None:
        """Aborts every communicator and fails pending and later calls with ``error``."""
        self._break(as_collsvc_error(error, "operation"))

    def close(self) -> None:
        """Destroys the communicators (aborts them if the backend is broken). Idempotent."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            broken = self._broken is not None
        self._watchdog.stop()
        with self._init_lock:
            comms = list(self._comms.values())
            self._comms.clear()
        for gc in comms:
            try:
                if broken:
                    gc.abort(self._grace)
                else:
                    gc.destroy()
            except Exception as exc:
                log.warning("rank %d: closing NCCL communicator of group %r: %s", self.rank, gc.group.name, exc)

    # ----------------------------------------------------------------- the template

    def _run(self, call: Call, nbytes: int, arrays: list[Any], body: _Body) -> None:
        """Checks, ordering, the completion wait and error mapping, written once for every op."""
        self._check_usable()
        if nbytes == 0:
            return  # every member has the same signature, so every member skips
        device = next(int(a.device.id) for a in arrays if a is not None)
        if any(a is not None and int(a.device.id) != device for a in arrays):
            raise ValueError(f"{call.signature.op}: all arrays must be on the same GPU")
        if self._device is not None and device != self._device:
            raise ValueError(
                f"rank {self.rank}: {call.signature.op} got an array on GPU {device}, but this rank reported GPU "
                f"{self._device} when it joined (from its local rank, or the current GPU at init) and the "
                f"one-GPU-per-rank check ran on that; select it before allocating: "
                f"cupy.cuda.Device({self._device}).use() or torch.cuda.set_device({self._device})"
            )
        gc = self._comm_for(call, device)
        sig = call.signature
        desc = describe(sig.op, sig.dtype, sig.shape, sig.reduce_op, call.group.name, call.seq)
        pending = Pending(desc, call.deadline, self._timeout, self._break)
        cuda = self._cp.cuda
        with cuda.Device(device):
            caller = cuda.get_current_stream()
            ready = cuda.Event(disable_timing=True)
            ready.record(caller)
            gc.stream.wait_event(ready)
            self._watchdog.watch(pending)
            try:
                try:
                    with gc.lock:
                        if gc.aborted:
                            raise pending.fail(self._broken or CollsvcError(f"nccl {desc}: communicator aborted"))
                        body(gc, int(gc.stream.ptr))
                    done = cuda.Event(disable_timing=True)
                    done.record(gc.stream)
                except CollsvcError:
                    raise
                except Exception as exc:
                    error = CollsvcError(f"nccl {desc} failed: {exc}")
                    error.__cause__ = exc
                    raise pending.fail(error) from exc
                wait_for(
                    lambda: bool(done.done),
                    pending,
                    failure=self._failure,
                    broken=lambda: self._broken,
                    check_async=gc.check_async,
                )
                caller.wait_event(done)
            finally:
                self._watchdog.forget(pending)

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise CollsvcError("the nccl backend is closed")

    def _break(self, error: CollsvcError) -> None:
        with self._state_lock:
            if self._broken is not None:
                return
            self._broken = error
        log.error("rank %d: NCCL backend aborted: %s", self.rank, error)
        for gc in list(self._comms.values()):
            try:
                gc.abort(self._grace)
            except Exception as exc:
                log.warning("rank %d: ncclCommAbort of group %r failed: %s", self.rank, gc.group.name, exc)
        self._watchdog.fail_all(error)

    def _comm_for(self, call: Call, device: int) -> GroupComm:
        group = call.group
        with self._init_lock:
            gc = self._comms.get(group.name)
            if gc is None:
                try:
                    gc = create_group_comm(
                        self._cp,
                        self._nccl,
                        group,
                        device,
                        kv=self._kv,
                        barrier=self._barrier,
                        failure=self._failure,
                        deadline=call.deadline,
                    )
                except CollsvcError as exc:
                    self._break(exc)
                    raise
                self._comms[group.name] = gc
                log.info("rank %d: NCCL communicator for group %r on GPU %d", self.rank, group.name, device)
        if gc.group.ranks != group.ranks:
            raise ValueError(f"group {group.name!r} has ranks {list(gc.group.ranks)}, not {list(group.ranks)}")
        if gc.device != device:
            raise ValueError(f"group {group.name!r} runs on GPU {gc.device}; this array is on GPU {device}")
        return gc

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
