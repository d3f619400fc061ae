"""What code built on a Communicator may know of, and do to, the job behind it.

The torch backend, elastic training and the module-level API need a few facts about the job (the
options it joined with, its incarnation, its first failure, the members that left) and its key/value
store. :class:`JobHandle` gives exactly those, so that they never reach into the job's parts (its
coordinator client, failure state, executor), which may change without notice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from collsvc.errors import RankFailedError

if TYPE_CHECKING:
    from collsvc.client.calls import CallRunner
    from collsvc.client.coordinator_access import CoordinatorAccess
    from collsvc.options import InitOptions


class KeyValueStore(Protocol):
    """The job's key/value store on the coordinator (keys are private to the job)."""

    def set(self, key: str, value: bytes) -> None:
        """Sets ``key``; raises RendezvousError when the coordinator cannot be reached in time."""

    def get(self, key: str, timeout: float) -> bytes:
        """Waits up to ``timeout`` seconds for ``key``; raises CollectiveTimeoutError when it stays unset."""

    def lookup(self, key: str, timeout: float) -> bytes | None:
        """``key``'s value now, or None (no waiting for it to be set)."""

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the integer at ``key`` (0 when unset) and returns the sum."""


class JobHandle:
    """The job of one or more Communicators, seen from code built on them (``comm.job``).

    Built once per joined job (``client/job.py``) from the parts it shows: the options, the incarnation,
    the member table's hosts, the coordinator's access and the call runner (first failure, departures,
    closed).
    """

    __slots__ = ("_options", "_incarnation", "_hosts", "_coordinator", "_calls")

    def __init__(
        self,
        options: InitOptions,
        incarnation: int,
        hosts: Mapping[int, str],
        coordinator: CoordinatorAccess,
        calls: CallRunner,
    ) -> None:
        self._options = options
        self._incarnation = incarnation
        self._hosts = hosts
        self._coordinator = coordinator
        self._calls = calls

    @property
    def options(self) -> InitOptions:
        """The resolved options this process joined the job with."""
        return self._options

    @property
    def timeout(self) -> float:
        """The job's timeout in seconds (``options.timeout``): what a call may take unless told otherwise."""
        return self._options.timeout

    @property
    def incarnation(self) -> int:
        """A number the coordinator gave this run of the job (a restarted job id gets another)."""
        return self._incarnation

    @property
    def store(self) -> KeyValueStore:
        """The job's key/value store on the coordinator."""
        return self._coordinator.client

    @property
    def closed(self) -> bool:
        """Whether this process left the job."""
        return self._calls.closed

    @property
    def failure(self) -> BaseException | None:
        """The first failure this process saw in the job (None while there is none)."""
        return self._calls.failure.error()

    def check(self) -> None:
        """Raises the job's first failure, if there is one.

        Raises:
            CollsvcError: the failure (RankFailedError, AbortedError, CollectiveMismatchError, ...).
        """
        self._calls.failure.check()

    @property
    def departed(self) -> Mapping[int, RankFailedError]:
        """Members that left the job cleanly, in the order they left, each with the error a call that
        needed it raises (a copy)."""
        return self._calls.departed.as_dict()

    @property
    def hosts(self) -> Mapping[int, str]:
        """Global rank -> host name of every member."""
        return self._hosts

    @property
    def coordinator_lost(self) -> bool:
        """Whether this member's heartbeat stream to the coordinator is broken (and not yet restored)."""
        return not self._coordinator.link_up

    def fail(self, error: BaseException) -> None:
        """Records ``error`` as the job's failure (unless one is recorded already): pending and later
        calls raise it, coordinator calls waiting for a lost coordinator included."""
        self._calls.fail(error)
        self._coordinator.give_up(self._calls.failure.error() or error)

    def leave_now(self) -> None:
        """Tells the coordinator this member leaves, and nothing else (safe in a signal handler: it takes
        none of the job's locks). :meth:`Communicator.close` is the full, clean way out."""
        self._coordinator.leave()
