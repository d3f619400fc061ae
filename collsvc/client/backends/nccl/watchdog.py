"""Bounded NCCL work that does not block the host: a watchdog thread per backend watches what was enqueued.

NCCL kernels never time out on their own: a peer that died or never arrived leaves them spinning on the
GPU forever, and ``ncclCommAbort`` is the only way out. So every enqueued operation is tracked as a
:class:`Pending` with its completion event and the call's deadline, and the caller returns at once
(as on torch's NCCL backend). The backend's :class:`Watchdog` thread checks, every few milliseconds,
the oldest unfinished operation of each communicator (operations of one communicator finish in the
order they were enqueued, on its one stream): whether it finished, NCCL's asynchronous error, the job's
recorded failure and the deadline. On a failure it fails the operation once: the backend then aborts
every communicator, which releases the kernels queued behind it, and raises the error from the next
call, ``Work.wait()`` or ``synchronize()``.

In blocking mode (``COLLSVC_NCCL_BLOCKING_WAIT=1``) the caller itself waits in :func:`wait_for`, polling
the same conditions; the watchdog is then the backstop for a caller stuck *inside* an NCCL call (a
blocking group end, say) and acts a grace period past the deadline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from collsvc.errors import CollectiveTimeoutError, CollsvcError

log = logging.getLogger(__name__)


class FailureSource(Protocol):
    """The communicator's record of the job's first failure (RankFailedError, AbortedError, ...)."""

    def error(self) -> BaseException | None: ...


def as_collsvc_error(error: BaseException, description: str) -> CollsvcError:
    """``error`` itself when it is a collsvc error, else a CollsvcError naming the operation."""
    if isinstance(error, CollsvcError):
        return error
    wrapped = CollsvcError(f"nccl {description} failed: {error}")
    wrapped.__cause__ = error
    return wrapped


def _no_async_error() -> None:
    return None


class Pending:
    """One enqueued NCCL operation: its completion, deadline and, once failed, the error it raises.

    Args:
        description: the operation as errors name it (a string, or a callable making it on demand: the
            fast path builds no string per call).
        deadline: ``time.monotonic()`` by which it must finish. timeout: the seconds that stands for.
        on_fail: ``on_fail(error, pending)`` runs exactly once, on whichever thread fails the operation
            first; the backend passes a function that aborts its communicators and marks itself broken.
        event: its completion event (CuPy's ``Event``), set once it was recorded behind the operation;
            until then the operation is not done.
        check_async: raises NCCL's asynchronous error of its communicator.
        call: the backend's ``Call`` (what a deferred timeout is reported with).
        grace: seconds past the deadline before the watchdog acts (a waiting caller acts at the deadline).
    """

    __slots__ = (
        "_description", "deadline", "timeout", "on_fail", "_lock", "error", "event", "check_async", "call", "act_at",
    )  # fmt: skip

    def __init__(
        self,
        description: str | Callable[[], str],
        deadline: float,
        timeout: float,
        on_fail: Callable[[CollsvcError, Pending], None],
        *,
        event: Any = None,
        check_async: Callable[[], None] = _no_async_error,
        call: Any = None,
        grace: float = 0.0,
    ) -> None:
        self._description = description
        self.deadline = deadline
        self.timeout = timeout
        self.on_fail = on_fail
        self._lock = threading.Lock()
        self.error: CollsvcError | None = None
        self.event = event
        self.check_async = check_async
        self.call = call
        self.act_at = deadline + grace

    def done(self) -> bool:
        """Whether the GPU finished the operation (its completion event fired)."""
        event = self.event
        return event is not None and bool(event.done)

    @property
    def description(self) -> str:
        d = self._description
        return d if isinstance(d, str) else d()

    def made_call(self) -> Any:
        """The operation's ``Call`` (None when not known), for the report of a deferred failure."""
        return self.call

    def fail(self, error: CollsvcError) -> CollsvcError:
        """Records ``error`` unless one is recorded, runs ``on_fail`` once, and returns the recorded one."""
        with self._lock:
            first = self.error is None
            if first:
                self.error = error
        recorded = self.error
        assert recorded is not None  # set above under the lock, never cleared
        if first:
            try:
                self.on_fail(recorded, self)
            except Exception:  # abort must not hide the error the caller is about to raise
                log.exception("aborting NCCL after %s failed", self.description)
        return recorded

    def timeout_error(self) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(
            f"nccl {self.description} did not complete within {self.timeout:.3g}s; the NCCL communicator was aborted",
            waiting_on=[],
        )

    def check(self, recorded: BaseException | None, now: float) -> None:
        """Fails this operation if ``recorded`` (the job's failure) is set, NCCL reports an error, or
        ``now`` is past the time to act; returns otherwise."""
        if recorded is not None:
            self.fail(as_collsvc_error(recorded, self.description))
            return
        try:
            self.check_async()
        except Exception as exc:
            error = CollsvcError(f"nccl {self.description} failed: {exc}")
            error.__cause__ = exc
            self.fail(error)
            return
        if now >= self.act_at:
            log.error("nccl %s is past its deadline; aborting the communicator", self.description)
            self.fail(self.timeout_error())


def wait_for(
    done: Callable[[], bool],
    pending: Pending,
    *,
    failure: FailureSource,
    broken: Callable[[], BaseException | None],
    check_async: Callable[[], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    spin: float = 200e-6,
    max_sleep: float = 200e-6,
) -> None:
    """Returns when ``done()`` is true; raises once the operation failed, timed out or was aborted.

    Args:
        done: whether the operation's completion event has fired.
        pending: the operation; failing it aborts the backend's communicators.
        failure: the job's recorded failure, polled every iteration.
        broken: the backend's own abort error, if ``abort`` was called.
        check_async: raises when NCCL reports an asynchronous error on the communicator.
        spin: seconds to poll without sleeping first: a small operation finishes within a few tens of
            microseconds, and the shortest sleep lasts longer than that (timer slack and the wake-up).
        max_sleep: the longest sleep between polls after that (how late a long operation may be seen
            done).

    Raises:
        CollectiveTimeoutError: the deadline passed first (``waiting_on`` is empty: NCCL cannot say
            which peer is missing; the communicator asks the coordinator).
        RankFailedError / AbortedError: the job's recorded failure, or the backend was aborted.
        CollsvcError: NCCL reported an error.
    """
    delay = 20e-6
    spin_until = clock() + spin
    while True:
        if pending.error is not None:
            raise pending.error
        if done():
            return
        recorded = failure.error() or broken()
        if recorded is not None:
            raise pending.fail(as_collsvc_error(recorded, pending.description))
        try:
            check_async()
        except Exception as exc:
            error = CollsvcError(f"nccl {pending.description} failed: {exc}")
            error.__cause__ = exc
            raise pending.fail(error) from exc
        now = clock()
        if now >= pending.deadline:
            raise pending.fail(pending.timeout_error())
        if now < spin_until:
            os.sched_yield()  # lets this process's other threads (heartbeats, the coordinator) take the GIL
            continue
        sleep(delay)
        delay = min(delay * 2, max_sleep)


# Beyond this many operations queued on one communicator, the issuing thread drops the finished ones
# itself (the watchdog does every round), so a fast loop never grows the queue without bound.
_PRUNE_AT = 256


class Watchdog:
    """A daemon thread watching the operations enqueued on a backend's communicators.

    Operations are kept in one queue per communicator (``lane``), oldest first: they finish in that
    order, so each round looks at the oldest unfinished one of each queue only.

    Args:
        failure: the job's recorded failure; a recorded failure fails every tracked operation at once.
        interval: seconds between rounds.
    """

    def __init__(self, failure: FailureSource, *, interval: float = 0.005) -> None:
        self._failure = failure
        self._interval = interval
        self._lock = threading.Lock()
        self._lanes: dict[int, deque[Pending]] = {}
        self._stop = threading.Event()
        self._work = threading.Event()  # set when an operation is watched while none was: the thread wakes
        self._thread: threading.Thread | None = None

    def watch(self, pending: Pending, lane: int = 0) -> None:
        """Tracks ``pending`` behind the earlier operations of ``lane`` (a communicator's id)."""
        queue = self._lanes.get(lane)
        if queue is None or self._thread is None:
            with self._lock:
                queue = self._lanes.setdefault(lane, deque())
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(target=self._run, name="collsvc-nccl-watchdog", daemon=True)
                    self._thread.start()
        idle = not queue
        queue.append(pending)  # one bytecode: atomic against the watchdog's popleft
        if idle:
            self._work.set()
        if len(queue) > _PRUNE_AT:
            with self._lock:  # never beside the watchdog's own pruning: both pop the front
                _drop_finished(queue)

    def forget(self, pending: Pending, lane: int = 0) -> None:
        with self._lock:
            queue = self._lanes.get(lane)
            if queue is not None and pending in queue:
                queue.remove(pending)

    def unfinished(self) -> list[Pending]:
        """The operations not seen finished yet, oldest first per communicator."""
        with self._lock:
            queues = list(self._lanes.values())
        return [p for q in queues for p in list(q)]

    def fail_all(self, error: CollsvcError) -> None:
        """Fails every tracked operation with ``error`` (used by ``abort``)."""
        for p in self.unfinished():
            p.fail(error)

    def stop(self) -> None:
        self._stop.set()
        self._work.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    def check_once(self, now: float) -> None:
        """One round of checks (the thread's body; called directly by tests)."""
        with self._lock:
            queues = list(self._lanes.values())
        recorded = self._failure.error()
        for queue in queues:
            with self._lock:
                _drop_finished(queue)
            if not queue:
                continue
            if recorded is not None:
                for p in list(queue):
                    p.fail(as_collsvc_error(recorded, p.description))
                continue
            try:
                oldest = queue[0]
            except IndexError:
                continue
            oldest.check(None, now)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if not any(list(self._lanes.values())):  # nothing in flight: sleep until something is
                self._work.clear()
                if not any(list(self._lanes.values())):
                    self._work.wait()
                continue
            try:
                self.check_once(time.monotonic())
            except Exception:  # the watchdog must outlive any one bad round
                log.exception("the NCCL watchdog's check failed")


def _drop_finished(queue: deque[Pending]) -> None:
    """Pops the finished (or failed) operations at the front of ``queue`` (under the watchdog's lock)."""
    while queue:
        front = queue[0]
        if front.error is None and not front.done():
            return
        queue.popleft()
