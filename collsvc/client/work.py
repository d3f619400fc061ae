"""Async handles and the per-process executor that runs collectives in the order they were issued."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from collsvc.errors import CollectiveTimeoutError, describe_waiting

T = TypeVar("T")


def wait_gave_up(description: str, seconds: float, waiting: list[dict[str, Any]]) -> CollectiveTimeoutError:
    """The error for a wait that gave up after ``seconds``, naming the ranks in ``waiting`` if any."""
    told = f"; waiting on {describe_waiting(waiting)}" if waiting else ""
    return CollectiveTimeoutError(f"{description} did not complete within {seconds:g}s{told}", waiting)


class Work(Generic[T]):
    """The handle ``async_op=True`` returns.

    Args:
        future: the operation's result.
        description: the operation as errors name it.
        late: the ranks the operation still waits for (``CollectiveTimeoutError.waiting_on`` entries),
            asked when a wait gives up; None: not known.
        settle: run by ``wait()`` and ``result()`` once the operation returned: a GPU operation on NCCL
            returns once enqueued, and this raises what the backend's watchdog found since (in
            blocking mode it first waits for the GPU).
    """

    def __init__(
        self,
        future: concurrent.futures.Future[T],
        description: str,
        late: Callable[[], list[dict[str, Any]]] | None = None,
        settle: Callable[[], None] | None = None,
    ) -> None:
        self._future = future
        self._description = description
        self._late = late
        self._settle = settle

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the operation finished (a GPU operation: until it is enqueued and ordered on the
        caller's stream, as torch's NCCL ``Work.wait()``); returns True.

        Raises:
            CollectiveTimeoutError: ``timeout`` seconds passed first (the operation keeps running and
                is still bounded by the communicator's own timeout); ``waiting_on`` names the ranks it
                still waits for, where they are known.
            CollsvcError: the operation failed (the same error every rank sees); for a GPU operation,
                also a failure found on the GPU since it was enqueued (this or an earlier one).
        """
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise self.gave_up(self._description, timeout or 0.0) from None
        if self._settle is not None:
            self._settle()
        return True

    def waiting_on(self) -> list[dict[str, Any]]:
        """The ranks the operation still waits for, as a timed-out collective names them; [] when it
        finished or they are not known. Never raises."""
        return [] if self._late is None or self._future.done() else self._late()

    def gave_up(self, description: str, seconds: float) -> CollectiveTimeoutError:
        """The error for a wait on this operation that gave up after ``seconds`` (``description``: how
        the waiter names it), naming the ranks it still waits for where they are known."""
        return wait_gave_up(description, seconds, self.waiting_on())

    def is_completed(self) -> bool:
        """Whether the operation finished (successfully or not)."""
        return self._future.done()

    def result(self) -> T:
        """The operation's result, waiting for it.

        Raises:
            CollsvcError: the operation failed (a GPU one: as :meth:`wait`).
        """
        result = self._future.result()
        if self._settle is not None:
            self._settle()
        return result

    def exception(self) -> BaseException | None:
        """The operation's error once it finished, else None (waits for it)."""
        return self._future.exception()

    @property
    def future(self) -> concurrent.futures.Future[T]:
        """The operation as a ``concurrent.futures.Future``, for done-callbacks and ``wait``/``as_completed``
        over many calls. Cancelling it does not stop a collective that started."""
        return self._future


class OrderedExecutor:
    """Runs submitted operations one at a time, in submission order, on one worker thread.

    Synchronous calls run inline when nothing is queued, and behind the queue otherwise, so every rank
    executes its collectives in the order it issued them.
    """

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._lock = threading.Lock()
        #: Operations submitted and not finished yet (changed under the lock; read without it: 0 means
        #: a synchronous call may run inline now, see :attr:`idle`).
        self.queued = 0

    def _wrap(self, fn: Callable[[], T]) -> Callable[[], T]:
        def run() -> T:
            try:
                return fn()
            finally:
                with self._lock:
                    self.queued -= 1

        return run

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        with self._lock:
            self.queued += 1
        return self._pool.submit(self._wrap(fn))

    @property
    def idle(self) -> bool:
        """Whether nothing is queued or running here: a synchronous call may run inline now."""
        return self.queued == 0

    def run(self, fn: Callable[[], T]) -> T:
        with self._lock:
            idle = self.queued == 0
        if idle:
            return fn()
        return self.submit(fn).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GroupExecutors:
    """One :class:`OrderedExecutor` per group (communicator name) of a job, made on first use.

    Calls on one group run in the order they were issued, as every rank must run them; calls on
    different groups do not wait for each other, as on torch's own backends (each process group has
    its own threads or streams). With one executor for the whole job, two threads issuing asynchronous
    calls on two groups, interleaved differently on different ranks, each ran the other group's call
    first and waited for each other until the timeout.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._by_group: dict[str, OrderedExecutor] = {}

    def of(self, group: str) -> OrderedExecutor:
        """The executor of ``group`` (the same one for every Communicator of that name)."""
        with self._lock:
            executor = self._by_group.get(group)
            if executor is None:
                executor = self._by_group[group] = OrderedExecutor(f"{self._prefix}-{group}")
            return executor

    def shutdown(self) -> None:
        with self._lock:
            executors = list(self._by_group.values())
        for executor in executors:
            executor.shutdown()


def done_work(value: Any, description: str) -> Work[Any]:
    """A completed Work (for async calls that had nothing to do)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return Work(future, description)
