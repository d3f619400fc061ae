"""Frames that arrived before (or while) their receiver asked for them, keyed by call and step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from collsvc.client.backends.base import last_finished
from collsvc.client.backends.ring.frames import FrameHeader
from collsvc.client.backends.ring.landings import FrameKey, Landings

__all__ = ["FrameKey", "Mailbox"]


@dataclass
class _Arrived:
    header: FrameHeader
    payload: memoryview


class Mailbox:
    """Thread-safe store of arrived frames with bounded waits.

    A recorded failure wakes every waiter; frames already present are still handed out first, so a
    peer that finished and left does not fail a receiver whose data already arrived.
    """

    def __init__(self) -> None:
        self._frames: dict[FrameKey, _Arrived] = {}
        self._cond = threading.Condition()
        self._failure: BaseException | None = None
        self._departed: dict[int, BaseException] = {}
        self._finished: dict[int, dict[str, int]] = {}  # departed rank -> stream -> last finished seq
        self._unreachable: dict[int, tuple[BaseException, float]] = {}  # rank -> (its error, when it counts)
        #: where calls want frames yet to arrive read straight into (``landings.py``)
        self.landings = Landings()

    def deposit(self, header: FrameHeader, payload: memoryview) -> None:
        self.deposit_all([(header, payload)])

    def deposit_all(self, arrived: list[tuple[FrameHeader, memoryview]]) -> None:
        """Deposits several frames at once: a waiter sees all of them or none (frames that reached this
        rank together, e.g. from several local peers, stay together for ``recv_any``)."""
        with self._cond:
            for header, payload in arrived:
                self._frames[(header.key_hash, header.seq, header.step, header.src)] = _Arrived(header, payload)
            self._cond.notify_all()

    def take(
        self,
        key: FrameKey,
        deadline: float,
        digest: int | None = None,
        waiter: tuple[str, int, tuple[int, ...]] | None = None,
    ) -> tuple[FrameHeader, memoryview] | None:
        """Removes and returns the frame ``key``, or None when ``deadline`` passed first.

        With ``digest`` (the waiting call's signature digest), a frame of the same call and sequence
        from any peer whose digest differs is returned instead while ``key`` is missing: a peer that
        called another collective sends frames with other step ids or to other ranks, which the
        awaited key would never match, so the caller would otherwise wait out the timeout.

        With ``waiter`` (the call's progress stream, sequence number and members), the wait fails as
        soon as a member that left cleanly is known to have left before finishing this call: what it
        never sent is needed by someone this rank waits for, directly or not.

        Raises:
            BaseException: the failure recorded by :meth:`fail`, or the departure that dooms the call,
                when the frame is not there.
        """
        with self._cond:
            while True:
                arrived = self._frames.pop(key, None)
                if arrived is not None:
                    return arrived.header, arrived.payload
                if digest is not None:
                    odd = self._mismatched(key, digest)
                    if odd is not None:
                        return odd.header, odd.payload
                wake_at = self._settle_unreachable()
                if self._failure is not None:
                    raise self._failure
                departed = self._departed.get(key[3])
                if departed is not None:
                    raise self._cause(departed, waiter)
                if waiter is not None:
                    doomed = self._doomed(*waiter)
                    if doomed is not None:
                        raise doomed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(min(remaining, wake_at - time.monotonic()))

    def first_present(self, keys: list[FrameKey], deadline: float) -> FrameKey | None:
        """Waits until a frame of one of ``keys`` arrived and returns that key (the frame stays here for
        :meth:`take`), or None when ``deadline`` passed first. Keys earlier in the list win ties.

        Raises:
            BaseException: the failure recorded by :meth:`fail`; the first departure among the keys'
                senders when every one of them left.
        """
        found: list[FrameKey] = []

        def arrived() -> bool:  # runs under the lock, in wait_until
            for key in keys:
                if key in self._frames:
                    found.append(key)
                    return True
            gone = [self._departed[key[3]] for key in keys if key[3] in self._departed]
            if keys and len(gone) == len(keys) and self._failure is None:
                raise gone[0]
            return False

        return found[0] if self.wait_until(arrived, deadline) else None

    def _cause(self, departed: BaseException, waiter: tuple[str, int, tuple[int, ...]] | None) -> BaseException:
        """What a call waiting on a sender that left raises: a member that left before it without
        finishing the call is the cause (the sender may have ended because of it), else ``departed``."""
        earlier = self._doomed(*waiter) if waiter is not None else None
        return earlier if earlier is not None else departed

    def _doomed(self, stream: str, seq: int, members: tuple[int, ...]) -> BaseException | None:
        # In the order they left: the first departure is the cause, later ones may be its victims.
        for rank, error in self._departed.items():
            finished = self._finished.get(rank)
            if rank in members and finished is not None and last_finished(finished, stream) < seq:
                return error
        return None

    def _mismatched(self, key: FrameKey, digest: int) -> _Arrived | None:
        # Slow path only (the awaited frame is missing); frames in flight are few, so a scan is cheap.
        for other, arrived in self._frames.items():
            if other[0] == key[0] and other[1] == key[1] and arrived.header.digest != digest:
                return self._frames.pop(other)
        return None

    def fail(self, error: BaseException) -> None:
        """Records the first failure and wakes every waiter."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()

    def recorded_failure(self) -> BaseException | None:
        """The failure recorded by :meth:`fail`, if any (read without waiting)."""
        return self._failure

    def unreachable(self, rank: int, error: BaseException, grace: float) -> None:
        """Records that global ``rank`` refused a delivery: its process is gone.

        A member that left the job cleanly closes its endpoint only after the coordinator recorded its
        departure, so the news of it (naming what had failed its job, if anything) is on its way here.
        ``error`` becomes this process's failure only when no departure of ``rank`` and no other
        failure arrived within ``grace`` seconds; until then waits go on (see :meth:`explain`).
        """
        with self._cond:
            if rank not in self._departed and rank not in self._unreachable:
                self._unreachable[rank] = (error, time.monotonic() + grace)
            self._cond.notify_all()

    def explain(self, rank: int, waiter: tuple[str, int, tuple[int, ...]] | None = None) -> BaseException | None:
        """The error a failed delivery to global ``rank`` stands for, once the coordinator's news came.

        Waits (at most the grace given to :meth:`unreachable`) for the departure of ``rank`` or another
        failure. Returns the departure that doomed the waiting call (``waiter`` as in :meth:`take`),
        the departure of ``rank`` itself, the failure recorded meanwhile, or None when no news came: the
        caller's own delivery error stands (and is this process's failure from then on).
        """
        with self._cond:
            while True:
                departed = self._departed.get(rank)
                if departed is not None:
                    return self._cause(departed, waiter)
                self._settle_unreachable()
                pending = self._unreachable.get(rank)
                if self._failure is not None:
                    # Its own error, promoted when the grace ran out, means that no news came.
                    return None if pending is not None and self._failure is pending[0] else self._failure
                if pending is None:
                    return None
                self._cond.wait(max(pending[1] - time.monotonic(), 0.0))

    def _settle_unreachable(self) -> float:
        """Promotes an unreachable rank whose grace ran out without news to this process's failure;
        returns when the next grace ends (infinity when none is pending). Caller holds the lock."""
        wake_at = float("inf")
        if not self._unreachable:
            return wake_at
        now = time.monotonic()
        for rank, (error, until) in self._unreachable.items():
            if rank in self._departed:
                continue
            if until <= now:
                if self._failure is None:
                    self._failure = error
            else:
                wake_at = min(wake_at, until)
        return wake_at

    def depart(
        self, ranks: list[int], error: BaseException, finished: Mapping[int, Mapping[str, int]] | None = None
    ) -> None:
        """Records ranks that left the job cleanly: a wait for a frame from one of them that has not
        arrived raises ``error`` (it will never come); so does a wait in a call one of them never
        finished, when its final progress (``finished``: rank -> stream -> last finished sequence
        number) is known. Every other wait goes on."""
        with self._cond:
            for rank in ranks:
                self._departed.setdefault(rank, error)
                if finished is not None and rank in finished:
                    self._finished[rank] = dict(finished[rank])
            self._cond.notify_all()

    def has_departed(self, rank: int) -> bool:
        """Whether global ``rank`` left the job cleanly (see :meth:`depart`)."""
        with self._cond:
            return rank in self._departed

    def discard(self, key_hash: int, seq: int) -> None:
        """Drops leftover frames of one call (after it failed)."""
        with self._cond:
            for key in [k for k in self._frames if k[0] == key_hash and k[1] == seq]:
                del self._frames[key]

    # ---- other waits under the same failure rule (the gRPC transport waits here for its sends) ----------
    def wait_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Waits until ``done()`` holds (checked again at every :meth:`wake`) or ``deadline`` passes.

        A failure recorded by :meth:`fail` ends the wait too, so a sender waiting for a delivery to a
        peer on a dead path learns of a failure announced elsewhere as quickly as a receiver does.

        Returns:
            Whether ``done()`` held; False when ``deadline`` passed first.

        Raises:
            BaseException: the failure recorded by :meth:`fail`, when ``done()`` does not hold.
        """
        with self._cond:
            while not done():
                wake_at = self._settle_unreachable()
                if self._failure is not None:
                    raise self._failure
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, wake_at - time.monotonic()))
            return True

    def wake(self) -> None:
        """Wakes every waiter to check its condition again (see :meth:`wait_until`)."""
        with self._cond:
            self._cond.notify_all()
