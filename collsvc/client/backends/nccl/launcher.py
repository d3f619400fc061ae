"""Enqueuing NCCL operations in stream order, watching them, and failing them: the half of the NCCL
backend (``backend.py``) that is not about any one collective.

:meth:`Launcher.launch` orders an operation on the group's stream after the caller's current stream and
the caller's stream after it, hands it to the :class:`~collsvc.client.backends.nccl.watchdog.Watchdog`
and returns (in blocking mode it waits on the host first). A failure the watchdog finds aborts every
communicator at once, is reported through the backend's ``report`` (the call runner names the late ranks and
records the job's failure) and is raised from then on: by the next call, ``settle`` (``Work.wait()``)
and ``synchronize``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from collsvc.client.backends.base import Call
from collsvc.client.backends.nccl.group_comm import Barrier, GroupComm, KeyValueLike, create_group_comm
from collsvc.client.backends.nccl.watchdog import FailureSource, Pending, Watchdog, as_collsvc_error, wait_for
from collsvc.errors import AbortedError, CollsvcError, RankFailedError

log = logging.getLogger(__name__)

Report = Callable[[Any, CollsvcError], CollsvcError]
# How long a call that finds the backend broken waits for the failure's report (who is late) before
# raising the error as found.
_REPORT_WAIT_S = 10.0


class Launcher:
    """Communicators, the watchdog and the backend's broken state; ``NcclBackend`` sets the attributes."""

    rank: int
    _cp: Any
    _nccl: Any
    _kv: KeyValueLike
    _barrier: Barrier
    _timeout: float
    _failure: FailureSource
    _grace: float
    _device: int | None
    _comms: dict[str, GroupComm]
    _init_lock: threading.Lock
    _state_lock: threading.Lock
    _broken: CollsvcError | None
    _closed: bool
    _watchdog: Watchdog
    _blocking: bool
    _report: Report | None
    _reported: threading.Event

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
            broken = self._broken is not None or any(not p.done() for p in self._watchdog.unfinished())
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

    def existing_comm(self, group: Any, device: int) -> GroupComm | None:
        """The communicator of ``group`` (a ``GroupSpec``) on ``device`` if a call created it and this
        backend is usable; None otherwise."""
        if self._broken is not None or self._closed or (self._device is not None and device != self._device):
            return None
        gc = self._comms.get(group.name)
        return gc if gc is not None and gc.group.ranks == group.ranks and gc.device == device else None
