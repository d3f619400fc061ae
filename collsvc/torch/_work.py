"""``dist.Work`` objects over collsvc's asynchronous calls.

Every collective of the process group is issued with the Communicator's ``async_op=True``, so the
caller's thread returns at once and the transfer overlaps whatever the caller does next. The torch
``Future`` of a Work completes when the last collsvc call behind it finished and its results were
copied into the caller's output tensors; its value is the list of output tensors, as DDP's comm hooks
expect. Futures are completed (once asked for) on a thread of their own, so a ``then`` callback that runs another
collective (PowerSGD, say) never blocks the thread that moves the bytes.
"""

from __future__ import annotations

import concurrent.futures
import copy
import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from collsvc.client.work import Work as CollsvcCall
from collsvc.client.work import wait_gave_up
from collsvc.errors import CollsvcError
from collsvc.torch._errors import to_torch_error
from collsvc.torch._streams import CallerStream, run_on

Finisher = Callable[[list[Any]], None]

_Work: Any = dist.Work  # subclassed through Any: torch's stubs type its methods for C++ callers only

# Futures are completed here, and their ``then`` callbacks run here. A callback may start another
# collective and wait for its future (PowerSGD's hook does): with one thread that wait blocked the very
# thread that was to complete it, and training hung. A pool starts another thread only when every one
# it has is busy, so normally one runs, and a blocked callback never holds the others back.
_completions = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="collsvc-torch-futures")


class _FailedValue:
    """A failed operation's Future value where C++ reads it (DDP's reducer): torch extracts a value's tensors
    by pickling it, and this one refuses with the operation's error, so the Future holds that error (a
    value of no tensors made the reducer read past an empty list and crash)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __reduce__(self) -> tuple[Any, ...]:
        raise copy.copy(self.error)


def _graph_task() -> int:
    """The id of the backward pass running on this thread; -1 outside one."""
    current: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else current()


_backward_lock = threading.Lock()
_backward_works: dict[int, list[CollsvcWork]] = {}  # backward pass -> Works whose Future it asked for


def _raise_after_backward(work: CollsvcWork, task: int) -> None:
    """Makes backward pass ``task`` raise ``work``'s error intact, should it fail.

    A Future's error reaches C++ code as text in a ``RuntimeError``; the exceptions that leave an autograd
    final callback written in Python reach the caller of ``backward()`` unchanged. So the first Work
    whose Future a backward pass asks for (DDP's reducer does, for each bucket) queues a final callback
    that waits for every such Work of the pass and raises the first one's error. It is queued before
    the reducer's own, which DDP queues once the last bucket is ready."""
    with _backward_lock:
        works = _backward_works.get(task)
        first = works is None
        if works is None:
            works = _backward_works[task] = []
        works.append(work)
    if not first:
        return

    def check() -> None:
        with _backward_lock:
            pending = _backward_works.pop(task, [])
        for each in pending:
            each.wait()

    try:
        torch.autograd.Variable._execution_engine.queue_callback(check)
    except RuntimeError:  # not in a backward pass after all: nothing to raise in
        with _backward_lock:
            _backward_works.pop(task, None)


class Finished:
    """The result of a call that already ran on the caller's thread (no future, no lock, no event)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


# The done-state of every Work whose calls all finished before it was made: set once, never cleared.
_ALREADY_DONE = threading.Event()
_ALREADY_DONE.set()


def _done_future(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return future


def future_of(call: CollsvcCall[Any] | concurrent.futures.Future[Any]) -> concurrent.futures.Future[Any]:
    """The concurrent future behind a collsvc call (or ``call`` itself when it already is one)."""
    if isinstance(call, concurrent.futures.Future):
        return call
    return call.future


def _seconds(timeout: Any) -> float | None:
    """torch passes ``timedelta`` (0 = no limit, its ``kNoTimeout``); Python callers may pass seconds."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


class CollsvcWork(_Work):  # type: ignore[misc]
    """The ``dist.Work`` a collsvc process group returns.

    Args:
        calls: the collsvc calls (or futures of posted point-to-point operations) behind this operation;
            empty for one that finished locally.
        outputs: the tensors the operation writes; the Future's value.
        finish: called with the calls' results, in order, once all finished (copies results into
            ``outputs``); may be None.
        description: the operation as errors name it.
        timeout: the group's timeout in seconds; ``wait()`` never waits longer.
        stream: for CUDA tensors, the caller's stream: the finisher runs on it, and the Work is done
            once it ran (see ``collsvc.torch._streams``); None for CPU tensors.
    """

    def __init__(
        self,
        calls: Sequence[CollsvcCall[Any] | concurrent.futures.Future[Any]] | Sequence[Finished],
        outputs: list[torch.Tensor],
        finish: Finisher | None,
        description: str,
        timeout: float | None,
        stream: CallerStream | None = None,
    ) -> None:
        super().__init__()
        self._stream = stream
        self._outputs = outputs
        self._finish = finish
        self._description = description
        self._timeout = timeout
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None  # made when first asked for
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        # The Future is completed only once someone asked for it: synchronous callers never do, and
        # waking the completion thread for them would cost every small collective a thread switch.
        self._future_requested = False
        self._in_backward = False  # its Future was first asked for during a backward pass
        results = [call.value for call in calls if type(call) is Finished]
        if len(results) == len(calls):
            # Ran on the caller's thread already: finish here, with no futures or events of its own.
            self._calls: Sequence[concurrent.futures.Future[Any]] = ()
            self._pending = 0
            if finish is not None:
                self._settle(results)
            self._done = _ALREADY_DONE
            return
        self._calls = [_done_future(call.value) if isinstance(call, Finished) else future_of(call) for call in calls]
        self._collsvc_calls = [call for call in calls if isinstance(call, CollsvcCall)]  # they know who is late
        self._done = threading.Event()
        self._pending = len(self._calls)
        for call in self._calls:
            call.add_done_callback(self._one_done)

    def _one_done(self, _: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._complete()

    def _settle(self, results: list[Any] | None) -> None:
        """Runs the finisher on the calls' results; records any error.

        ``results`` are given when the calls ran on the caller's thread; None when they completed on
        another thread (read from the calls then, and for CUDA tensors the finisher runs on the caller's
        stream, which is waited for).
        """
        try:
            finish = self._finish
            if results is not None:  # on the caller's thread, on its stream: ordered like any kernel of it
                if finish is not None:
                    finish(results)
                return
            finished = [call.result() for call in self._calls]
            if finish is not None:
                run_on(self._stream, lambda: finish(finished))
            elif self._stream is not None:
                self._stream.synchronize()  # nothing to run on it: no need to enter it
        except CollsvcError as exc:
            self._error = to_torch_error(exc)
        except BaseException as exc:  # noqa: BLE001 - any failure belongs to whoever waits on this Work
            self._error = exc

    def _complete(self) -> None:
        self._settle(None)
        with self._lock:
            self._done.set()
            fulfil = self._future_requested
        if fulfil:
            _completions.submit(self._fulfil)

    def _fulfil(self) -> None:
        assert self._future is not None  # get_future made it before asking for this
        if self._error is None:
            self._future.set_result(self._outputs)
        elif self._in_backward:  # C++ reads it (see _FailedValue)
            self._future.set_result(_FailedValue(self._error))  # type: ignore[arg-type]
        else:
            self._future.set_exception(self._error)  # type: ignore[arg-type]  # torch's stub is wrong

    # ---- dist.Work -------------------------------------------------------------------------------
    def wait(self, timeout: Any = None) -> bool:
        """Blocks until the operation finished.

        Args:
            timeout: a ``timedelta`` or seconds; 0 or None waits up to the group's timeout.

        Returns:
            True.

        Raises:
            CollectiveTimeoutError: the operation did not finish within the timeout (also a
                ``DistBackendError``).
            CollsvcError: the operation failed; the same error every rank sees (also a ``DistBackendError``).
        """
        if self._done is _ALREADY_DONE:  # ran on the caller's thread: nothing to wait for
            if self._error is not None:
                raise self._error
            return True
        limits = [t for t in (_seconds(timeout), self._timeout) if t is not None]
        limit = min(limits) if limits else None
        if not self._done.wait(limit):
            late = next((call for call in self._collsvc_calls if not call.is_completed()), None)
            waiting = late.waiting_on() if late is not None else []
            raise to_torch_error(wait_gave_up(self._description, limit or 0.0, waiting))
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the operation finished, successfully or not."""
        return self._done.is_set()

    def is_success(self) -> bool:
        """Whether the operation finished without an error."""
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        """The operation's error once it finished, else None."""
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The output tensors, after waiting for the operation.

        Raises:
            CollsvcError: as :meth:`wait`.
        """
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A Future completed with the output tensors (or the error) when the operation finished.

        Asked for during a backward pass (DDP's reducer does), a failed operation's Future holds its error
        as C++ code reads it (text in a ``RuntimeError``), and the backward pass raises the error itself
        (the collsvc error, also a ``DistBackendError``) once its last node ran."""
        task = _graph_task()
        with self._lock:
            first = self._future is None
            if first:
                self._future = torch.futures.Future()
                self._in_backward = task != -1
                self._future_requested = True
            done = self._done.is_set()
            future = self._future
        if first and task != -1:
            _raise_after_backward(self, task)
        if first and done:
            self._fulfil()
        assert future is not None
        return future

    def synchronize(self) -> None:
        """Same as :meth:`wait` (CPU results are complete when the transfer is)."""
        self.wait()


class AnySourceWork(CollsvcWork):
    """The Work of a receive from any rank: ``_source_rank()``, which torch's ``recv(src=None)`` asks,
    names the rank (of the group) whose message arrived."""

    def __init__(
        self,
        call: concurrent.futures.Future[Any],
        output: torch.Tensor,
        description: str,
        timeout: float | None,
        stream: CallerStream | None = None,
    ):
        self._source: int | None = None
        super().__init__([call], [output], self._note_source, description, timeout, stream)

    def _note_source(self, results: list[Any]) -> None:
        self._source = int(results[0])

    def _source_rank(self) -> int:
        """The sender's rank in the group (waits for the receive).

        Raises:
            DistBackendError: the receive failed (collsvc's error, also a torch error).
        """
        self.wait()
        assert self._source is not None
        return self._source


class CompletedWork(CollsvcWork):
    """The Work of an operation that already finished on the caller's thread with nothing left to run
    (its outputs written): every synchronous collective on CPU tensors returns one. Its done-state is
    the class's, so making one sets only its outputs and description (a third of the general
    constructor's cost, on every small collective).

    Args:
        outputs: the tensors the operation wrote; the Future's value.
        description: the operation as errors name it.
    """

    _stream = None
    _finish = None
    _timeout = None
    _future = None  # get_future sets the instance's own
    _error = None
    _lock = threading.Lock()  # held only to make a Work's Future, at most once per Work: one serves all
    _future_requested = False
    _in_backward = False
    _calls = ()
    _pending = 0
    _done = _ALREADY_DONE

    def __init__(self, outputs: list[torch.Tensor], description: str) -> None:  # noqa: D107
        _Work.__init__(self)
        self._outputs = outputs
        self._description = description
