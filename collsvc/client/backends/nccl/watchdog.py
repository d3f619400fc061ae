"""Bounded waits for NCCL work: the caller's poll loop and a watchdog thread as its backstop.

NCCL kernels never time out on their own: a peer that died or never arrived leaves them spinning on the
GPU forever, and ``ncclCommAbort`` is the only way out. So every operation is tracked as a
:class:`Pending` with the call's deadline:

- the calling thread waits in :func:`wait_for`, polling the completion event, NCCL's asynchronous error,
  the job's recorded failure and the deadline: without sleeping for the first 200 us, then with
  sleeps that grow to 200 us;
- a :class:`Watchdog` thread checks the same conditions every few tens of milliseconds for the case the
  caller cannot: a thread stuck *inside* an NCCL call (a blocking group end, say). Past the deadline plus
  a grace period, or as soon as a failure is recorded, it aborts the communicator, which releases the
  stuck call.

Whichever side notices first fails the :class:`Pending` once; the error it chose is what the caller
raises.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

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


class Pending:
    """One enqueued NCCL operation: its deadline and, once failed, the error its caller raises.

    ``on_fail`` runs exactly once, on whichever thread fails the operation first; the backend passes a
    function that aborts its communicators and marks itself broken.
    """

    def __init__(self, description: str, deadline: float, timeout: float, on_fail: Callable[[CollsvcError], None]):
        self.description = description
        self.deadline = deadline
        self.timeout = timeout
        self._on_fail = on_fail
        self._lock = threading.Lock()
        self.error: CollsvcError | None = None

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
                self._on_fail(recorded)
            except Exception:  # abort must not hide the error the caller is about to raise
                log.exception("aborting NCCL after %s failed", self.description)
        return recorded

    def timeout_error(self) -> CollectiveTimeoutError:
        return CollectiveTimeoutError(
            f"nccl {self.description} did not complete within {self.timeout:.3g}s; the NCCL communicator was aborted",
            waiting_on=[],
        )


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


class Watchdog:
    """A daemon thread failing operations whose caller cannot: stuck in NCCL past the deadline.

    Args:
        failure: the job's recorded failure; a recorded failure fails every tracked operation at once.
        grace: seconds past an operation's deadline before the watchdog (rather than the caller's poll
            loop, which normally wins) fails it.
        interval: seconds between checks.
    """

    def __init__(self, failure: FailureSource, *, grace: float = 1.0, interval: float = 0.05) -> None:
        self._failure = failure
        self._grace = grace
        self._interval = interval
        self._lock = threading.Lock()
        self._pending: set[Pending] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, pending: Pending) -> None:
        with self._lock:
            self._pending.add(pending)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="collsvc-nccl-watchdog", daemon=True)
                self._thread.start()

    def forget(self, pending: Pending) -> None:
        with self._lock:
            self._pending.discard(pending)

    def fail_all(self, error: CollsvcError) -> None:
        """Fails every tracked operation with ``error`` (used by ``abort``)."""
        with self._lock:
            pending = list(self._pending)
        for p in pending:
            p.fail(error)

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)

    def check_once(self, now: float) -> None:
        """One round of checks (the thread's body; called directly by tests)."""
        with self._lock:
            pending = list(self._pending)
        recorded = self._failure.error()
        for p in pending:
            if recorded is not None:
                p.fail(as_collsvc_error(recorded, p.description))
            elif now >= p.deadline + self._grace:
                log.error("nccl %s is stuck past its deadline; aborting the communicator", p.description)
                p.fail(p.timeout_error())

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.check_once(time.monotonic())
