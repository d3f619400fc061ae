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
from collsvc.config import nccl_blocking_wait
from collsvc.errors import AbortedError, BackendUnavailableError, CollsvcError, RankFailedError
from collsvc.types import ReduceOp

log = logging.getLogger(__name__)

__all__ = ["Barrier", "FailureSource", "KeyValueLike", "NcclBackend"]

_Body = Callable[[GroupComm, int], None]
Report = Callable[[Any, CollsvcError], CollsvcError]
# How long a call that finds the backend broken waits for the failure's report (who is late) before
# raising the error as found.
_REPORT_WAIT_S = 10.0


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
        blocking: whether each call waits on the host until the GPU finished it; None: from
            ``COLLSVC_NCCL_BLOCKING_WAIT`` (default: no, it returns once enqueued).
        report: ``report(call, error)`` for a failure the watchdog found after the call returned (a
            timeout, NCCL's error): returns the error to raise from then on (the Job's ``on_failure``:
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
            # ncclCommDestroy may wait for operations that can never finish (a peer left): abort those.
            broken = self._broken is not None or bool(self._watchdog.unfinished())
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

    def launch(self, gc: GroupComm, pending: Pending, enqueue: Callable[..., None], args: tuple[Any, ...]) -> None:
        """Enqueues one operation on ``gc``'s stream, ordered after the caller's current stream and
        before what the caller queues next, and has the watchdog watch it as ``pending``; returns once
        enqueued (in blocking mode: once the GPU finished it).

        Args:
            pending: the operation's record (description, deadline, timeout, call); armed here.
            enqueue: ``enqueue(*args, stream pointer)`` issues the NCCL calls.

        Raises:
            CollsvcError (RankFailedError, AbortedError, CollectiveTimeoutError, ...): this backend broke
                earlier, NCCL refused the call, or (blocking mode) the operation failed.
        """
        if self._broken is not None or self._closed:
            self._check_usable()
        pending.on_fail = self._failed
        pending.check_async = gc.check_async
        if self._blocking:
            pending.act_at = pending.deadline + self._grace
        cuda = self._cp.cuda
        lane = gc.lane
        with cuda.Device(gc.device):
            caller = cuda.get_current_stream()
            watchdog = self._watchdog
            watchdog.watch(pending, lane)  # already: a call stuck inside NCCL is aborted too
            try:
                with gc.lock:
                    if gc.aborted:
                        raise pending.fail(
                            self._broken or CollsvcError(f"nccl {pending.description}: communicator aborted")
                        )
                    ready = gc.ready  # reused: a stream waits on the event's state when it is told to
                    ready.record(caller)
                    stream = gc.stream
                    stream.wait_event(ready)
                    enqueue(*args, gc.stream_ptr)
                    done = cuda.Event(disable_timing=True)
                    done.record(stream)
            except CollsvcError:
                watchdog.forget(pending, lane)
                self._raise_broken()
                raise
            except Exception as exc:
                watchdog.forget(pending, lane)
                error = CollsvcError(f"nccl {pending.description} failed: {exc}")
                error.__cause__ = exc
                raise pending.fail(error) from exc
            pending.event = done
            caller.wait_event(done)
            if self._blocking:
                self._wait(pending)

    def _wait(self, pending: Pending) -> None:
        """Waits on this thread until ``pending`` finished; raises as :func:`wait_for`."""
        wait_for(
            pending.done,
            pending,
            failure=self._failure,
            broken=lambda: self._broken,
            check_async=pending.check_async,
        )

    def synchronize(self) -> None:
        """Blocks until every operation enqueued so far finished on the GPU, each bounded by its own
        deadline.

        Raises:
            CollectiveTimeoutError / RankFailedError / AbortedError / CollsvcError: an operation failed,
                now or earlier (the same error the next call raises).
        """
        for pending in self._watchdog.unfinished():
            try:
                self._wait(pending)
            except CollsvcError:
                self._raise_broken()
                raise
        self._raise_broken()

    def settle(self) -> None:
        """What ``Work.wait()`` does after an asynchronous GPU call was enqueued: raises the error of
        a failure the watchdog found (the backend is aborted then); in blocking mode, first waits as
        :meth:`synchronize`.

        Raises:
            CollsvcError: as :meth:`synchronize`.
        """
        if self._blocking:
            self.synchronize()
        self._raise_broken()

    def _raise_broken(self) -> None:
        """Raises the error that broke this backend, once it was reported (with who is late), if any."""
        if self._broken is not None:
            self._reported.wait(_REPORT_WAIT_S)
            raise self._broken

    def _check_usable(self) -> None:
        self._raise_broken()
        if self._closed:
            raise CollsvcError("the nccl backend is closed")

    def _failed(self, error: CollsvcError, pending: Pending) -> None:
        """A watched operation failed: aborts everything at once; an error the job does not know yet
        (a timeout, NCCL's own) of an operation whose caller is gone is then reported through
        ``report`` (which asks who is late and records it as the job's failure)."""
        report = self._report
        unknown = self._failure.error() is None and not isinstance(error, (RankFailedError, AbortedError))
        if self._blocking or not unknown or pending.made_call() is None:
            report = None  # a waiting caller's Job reports it; the job knows its own failures
        if not self._break(error, reporting=report is not None) or report is None:
            return
        try:
            reported = report(pending.made_call(), error)
        except Exception:
            log.exception("rank %d: reporting %s failed", self.rank, error)
            reported = error
        with self._state_lock:
            self._broken = reported
        self._reported.set()

    def _break(self, error: CollsvcError, *, reporting: bool = False) -> bool:
        """Marks the backend broken with ``error``, aborts every communicator and fails what is still
        watched; False when it was broken already."""
        with self._state_lock:
            if self._broken is not None:
                return False
            self._broken = error
        if not reporting:
            self._reported.set()
        log.error("rank %d: NCCL backend aborted: %s", self.rank, error)
        for gc in list(self._comms.values()):
            try:
                gc.abort(self._grace)
            except Exception as exc:
                log.warning("rank %d: ncclCommAbort of group %r failed: %s", self.rank, gc.group.name, exc)
        self._watchdog.fail_all(error)
        return True

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

    # ----------------------------------------------------------------- for the fast path (repeat.py)

    @property
    def cupy(self) -> Any:
        """The ``cupy`` module this backend runs on."""
        return self._cp

    @property
    def array_type(self) -> type:
        """The type of this CuPy's arrays."""
        return type(self._cp.empty((0,), dtype="float32"))

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

    def existing_comm(self, group: Any, device: int) -> GroupComm | None:
        """The communicator of ``group`` (a ``GroupSpec``) on ``device`` if a call created it and this
        backend is usable; None otherwise."""
        if self._broken is not None or self._closed or (self._device is not None and device != self._device):
            return None
        gc = self._comms.get(group.name)
        return gc if gc is not None and gc.group.ranks == group.ranks and gc.device == device else None

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
