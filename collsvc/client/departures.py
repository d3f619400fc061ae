"""Members that left the job cleanly, as this process learned of them.

Order matters: the first departure among a call's members is the cause, and a member that left later
may be its victim (its own call failed because of the first, and then it ended). So the record keeps
the order the coordinator announced them in, and the first one among a group's members is what a
later call of that group raises.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from collsvc.errors import RankFailedError


class DepartureListener(Protocol):
    """A place where calls wait for peers (the gRPC mailbox, the shared-memory groups)."""

    def depart(
        self, ranks: list[int], error: BaseException, finished: Mapping[int, Mapping[str, int]] | None = None
    ) -> None:
        """Fails the waits that still need one of ``ranks``; the others go on."""


class Departures:
    """The clean departures of one job, in the order they were announced.

    Args:
        listeners: told of every departure, after it is recorded here.
    """

    def __init__(self, listeners: Sequence[DepartureListener]) -> None:
        self._listeners = tuple(listeners)
        self._lock = threading.Lock()
        self._errors: dict[int, RankFailedError] = {}  # insertion order: the order they left in
        #: Whether any member left yet (read without a lock, as the Communicator's fast path does before
        #: each call; set once the departure is recorded).
        self.anyone_left = False

    def record(self, ranks: list[int], error: RankFailedError, finished: dict[int, dict[str, int]]) -> None:
        """Members ``ranks`` left; a call that needs one of them raises ``error``. ``finished``: their
        final progress (rank -> stream -> last finished sequence number)."""
        with self._lock:
            for rank in ranks:
                self._errors.setdefault(rank, error)
            self.anyone_left = bool(self._errors)
        for listener in self._listeners:
            listener.depart(ranks, error, finished)

    def __contains__(self, rank: object) -> bool:
        return rank in self._errors

    def __bool__(self) -> bool:
        return bool(self._errors)

    def all_gone(self, ranks: Collection[int]) -> bool:
        """Whether ``ranks`` is not empty and every one of them left."""
        return bool(ranks) and all(rank in self._errors for rank in ranks)

    def first_among(self, members: Collection[int]) -> RankFailedError | None:
        """The error of the first member of ``members`` that left (the cause), or None."""
        if not self._errors:
            return None
        with self._lock:
            for rank, error in self._errors.items():
                if rank in members:
                    return error
        return None

    def first_unreachable(self) -> RankFailedError | None:
        """The error of the first departure that left a path to a peer broken (``unreachable``), or None."""
        with self._lock:
            return next((error for error in self._errors.values() if error.unreachable), None)

    def as_dict(self) -> dict[int, RankFailedError]:
        """Every departure so far, in order (a copy)."""
        with self._lock:
            return dict(self._errors)
