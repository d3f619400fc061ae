"""A one-shot signal for many waiters, each with its own deadline, woken in one pass.

Thousands of Join or Barrier calls wait for the same moment (the last member joining, the last one
arriving). ``asyncio.wait_for(event.wait(), timeout)`` costs a task and a timer per waiter;
:class:`Broadcast` costs one future per waiter and one timer in all: the deadlines wait in a heap
and a single timer handle fires at the earliest. :meth:`Broadcast.set` resolves every waiting
future in one loop over them and cancels that one timer.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

# Rebuild the deadline heap once this many of its entries belong to waiters that went away
# (cancelled calls), so a burst of abandoned waits does not hold memory until their deadlines.
_COMPACT_AT = 1024


class Broadcast:
    """Set once; every :meth:`wait` before or after learns it.

    Must be used from one event loop (the coordinator's); no locks are taken.
    """

    def __init__(self) -> None:
        self._set = False
        # (deadline, tie-breaker, future): the earliest deadline first.
        self._deadlines: list[tuple[float, int, asyncio.Future[bool]]] = []
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._abandoned = 0

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._set

    def __len__(self) -> int:
        """Waiters that may still be woken (cancelled ones count until they are cleared out)."""
        return len(self._deadlines)

    async def wait(self, seconds: float) -> bool:
        """Waits until :meth:`set` or for ``seconds``; returns whether it was set.

        Raises:
            asyncio.CancelledError: the waiting call was cancelled (its entry is cleared out later).
        """
        if self._set:
            return True
        if seconds <= 0:
            return False
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        deadline = loop.time() + seconds
        heapq.heappush(self._deadlines, (deadline, next(self._order), future))
        if self._timer is None or deadline < self._timer.when():
            self._arm(loop, deadline)
        try:
            woken = await future
        except asyncio.CancelledError:
            self._abandoned += 1
            if self._abandoned >= _COMPACT_AT and self._abandoned * 2 >= len(self._deadlines):
                self._compact()
            raise
        return woken or self._set

    def set(self) -> None:
        """Wakes every waiter (each with True) and every later :meth:`wait` returns True at once."""
        if self._set:
            return
        self._set = True
        waiting, self._deadlines = self._deadlines, []
        self._abandoned = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _, _, future in waiting:
            if not future.done():
                future.set_result(True)

    def _arm(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(deadline, self._expire, loop)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Answers False to every waiter whose deadline passed, then re-arms for the next one."""
        self._timer = None
        now = loop.time()
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            future = heapq.heappop(deadlines)[2]
            if future.done():
                self._abandoned = max(self._abandoned - 1, 0)
            else:
                future.set_result(False)
        if deadlines:
            self._arm(loop, deadlines[0][0])

    def _compact(self) -> None:
        self._deadlines = [entry for entry in self._deadlines if not entry[2].done()]
        heapq.heapify(self._deadlines)
        self._abandoned = 0
