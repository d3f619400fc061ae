"""The first failure of a job in this process (a dead peer, an abort, a mismatch, a lost coordinator).

Setting it wakes every waiter through its listeners, so pending collectives fail at once and later
ones fail fast.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class FailureState:
    """The first failure of a job in this process; listeners are told once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: The recorded failure, None until there is one (set once; read it without a lock, as the
        #: Communicator's fast path does before each call).
        self.recorded: BaseException | None = None
        self._listeners: list[Callable[[BaseException], None]] = []

    def error(self) -> BaseException | None:
        return self.recorded

    def add_listener(self, listener: Callable[[BaseException], None]) -> None:
        with self._lock:
            self._listeners.append(listener)
            error = self.recorded
        if error is not None:
            listener(error)

    def set(self, error: BaseException) -> bool:
        """Records ``error`` unless a failure is already recorded; returns whether it was the first."""
        with self._lock:
            if self.recorded is not None:
                return False
            self.recorded = error
            listeners = list(self._listeners)
        for listener in listeners:
            listener(error)
        return True

    def check(self) -> None:
        """Raises the recorded failure, if any (fail fast on every call after a failure)."""
        if self.recorded is not None:
            raise self.recorded
