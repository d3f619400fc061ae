"""The shared-memory groups of one process, and how failures and departures reach their waiters."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping

from collsvc.client.backends.base import Call, Signature, last_finished
from collsvc.client.backends.shm.group import LocalGroup


class LocalGroups:
    """Shared-memory groups of this process, one per (group name, local members), created on first use.

    ``fail`` wakes every group's waiters with the job's failure (wired to the job's failure state).
    ``depart`` records members that left the job cleanly, with their final progress: a call fails
    because of a departure only when the departed member never finished it. A member that finished
    call ``k`` and left is not needed by call ``k`` (its data is already in shared memory, and local
    rank 0 releases the ranks it still has to release), only by the calls after it.
    """

    def __init__(self, job_key: str, timeout: float) -> None:
        """Args:
        job_key: unique per job instance; every local rank passes the same.
        timeout: seconds a new group waits for its other local ranks (bounded by the call's deadline).
        """
        self._job_key = job_key
        self._timeout = timeout
        self._groups: dict[tuple[str, tuple[int, ...]], LocalGroup] = {}
        self._watches: dict[tuple[str, tuple[int, ...]], CallWatch] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._departed: dict[int, BaseException] = {}
        self._finished: dict[int, dict[str, int]] = {}  # departed rank -> stream -> last finished seq

    def get(self, call: Call, local: tuple[int, ...], local_index: int) -> LocalGroup:
        """The group of ``call``'s local members, connected, and watching for departures that doom ``call``.

        Calls on one group are serialized by the caller (the Communicator's ordered executor).

        Raises:
            CollectiveTimeoutError: a new group's other local ranks did not join in time.
            RendezvousError: local ranks disagree on the group's shape.
            BaseException: the job's failure, or the departure of a member that never finished ``call``.
        """
        key = (call.key, local)
        with self._lock:
            group = self._groups.get(key)
            watch = self._watches.get(key)
        if group is not None and watch is not None:
            watch.follow(call)
            return group
        namespace = hashlib.blake2b(f"{self._job_key}|{call.key}|{local}".encode(), digest_size=12).hexdigest()
        group = LocalGroup(namespace, local_index, len(local), timeout=None)
        watch = CallWatch(self, frozenset(call.all_members))
        watch.follow(call)
        group.watch(watch.check)
        group.label(watch.label)
        # Registered before it connects, so that a failure or departure wakes a rank waiting for peers
        # that will never come (a member that exited before its first collective).
        with self._lock:
            self._groups[key] = group
            self._watches[key] = watch
            error = self._error
        if error is not None:
            group.fail(error)
        try:
            group.connect(min(call.deadline, time.monotonic() + self._timeout))
        except BaseException:
            with self._lock:
                self._groups.pop(key, None)
                self._watches.pop(key, None)
            group.close()
            raise
        return group

    def existing(self, key: str, local: tuple[int, ...]) -> tuple[LocalGroup, CallWatch] | None:
        """The group of stream ``key`` over ``local`` and its watch, if :meth:`get` made it, else None."""
        with self._lock:
            group = self._groups.get((key, local))
            watch = self._watches.get((key, local))
        return None if group is None or watch is None else (group, watch)

    def _check_departures(self, members: frozenset[int], stream: str, seq: int) -> None:
        """Raises the departure that dooms call ``seq`` of ``stream``, if a member left without finishing it."""
        if not self._departed:
            return
        # In the order they left: the first departure is the cause, later ones may be its victims.
        for rank, error in list(self._departed.items()):
            if rank not in members:
                continue
            finished = self._finished.get(rank)
            if finished is None or last_finished(finished, stream) < seq:
                raise error

    def fail(self, error: BaseException) -> None:
        """Fails every group's pending and later calls with ``error``; any thread."""
        with self._lock:
            self._error = self._error or error
            groups = list(self._groups.values())
        for group in groups:
            group.fail(error)

    def depart(
        self, ranks: list[int], error: BaseException, finished: Mapping[int, Mapping[str, int]] | None = None
    ) -> None:
        """Records members that left the job cleanly, with their final progress (``finished``: rank ->
        stream -> last finished sequence number; unknown progress counts as nothing finished).

        Waiters in groups that contain one of them wake up: those in a call the departed member never
        finished raise ``error``; the others go on.
        """
        with self._lock:
            for rank in ranks:
                self._departed.setdefault(rank, error)
                if finished is not None and rank in finished:
                    self._finished[rank] = dict(finished[rank])
            gone = set(ranks)
            groups = [group for key, group in self._groups.items() if self._watches[key].members & gone]
        for group in groups:
            group.wake()

    def close(self) -> None:
        """Closes every group (idempotent)."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
            self._watches.clear()
        for group in groups:
            group.close()


class CallWatch:
    """The call a group is running now, as its departure check and mismatch label see it.

    One per group, updated per call (:meth:`follow`), so a call costs no new closures.
    """

    __slots__ = ("_groups", "members", "stream", "seq", "signature")

    def __init__(self, groups: LocalGroups, members: frozenset[int]) -> None:
        self._groups = groups
        self.members = members
        self.stream = ""
        self.seq = 0
        self.signature: Signature | None = None

    def follow(self, call: Call) -> None:
        self.stream, self.seq, self.signature = call.progress_stream, call.seq, call.signature

    def follow_numbers(self, stream: str, seq: int, signature: Signature) -> None:
        """:meth:`follow` for a call not built as a :class:`Call` (the Communicator's fast path)."""
        self.stream, self.seq, self.signature = stream, seq, signature

    def check(self) -> None:
        """Raises the departure of a member that left without finishing the current call."""
        if self._groups._departed:  # none yet (every call asks): no call
            self._groups._check_departures(self.members, self.stream, self.seq)

    def label(self) -> bytes:
        """The current call's full signature (JSON), for mismatch errors."""
        return self.signature.encode() if self.signature is not None else b""
