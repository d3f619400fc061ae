"""The coordinator as a job's communicators, its call runner and the code built on them reach it.

One object per joined job, built by ``client/connect.py``, holding the job's coordinator client. In a
child forked from the rank (``fork_guard``), the Job swaps that client for a stand-in whose every call
raises the child's ``ForkedChildError``: whoever holds this object sees the swap, as nobody keeps the
client itself.
"""

from __future__ import annotations

from typing import Any

from collsvc.client import fork_guard
from collsvc.client.rendezvous import CoordinatorClient


class CoordinatorAccess:
    """The coordinator calls one process makes for a job, outside joining and heartbeats."""

    __slots__ = ("client",)

    def __init__(self, client: CoordinatorClient) -> None:
        #: The coordinator client (a refusing stand-in in a forked child, see :meth:`forked`).
        self.client = client

    def forked(self, error: BaseException) -> None:
        """In a forked child: every later call raises ``error`` and sends nothing."""
        self.client = fork_guard.ChildClient(error)  # type: ignore[assignment]

    def new_group(self, name: str, ranks: list[int]) -> None:
        """Records a group of the job's ``ranks`` under ``name``.

        Raises:
            ValueError: ``name`` already names other ranks.
            RendezvousError: the coordinator could not be reached in time.
        """
        self.client.new_group(name, ranks)

    def find_group(self, name: str) -> list[int]:
        """The job-wide ranks of the group ``name``, or [] if there is none.

        Raises:
            RendezvousError: the coordinator could not be reached in time.
        """
        return self.client.find_group(name)

    def barrier(self, group: str, rank: int, generation: int, timeout: float) -> None:
        """Passes generation ``generation`` of ``group``'s coordinator barrier as ``rank``.

        Raises:
            CollectiveTimeoutError: not every member arrived within ``timeout`` seconds.
            RankFailedError / AbortedError: a member failed or the job was aborted meanwhile.
        """
        self.client.barrier(group, rank, generation, timeout)

    def report(self, kind: int, reason: str, details: dict[str, Any] | None = None) -> None:
        """Tells the coordinator of a failure, which it fans out to every member (best effort: never raises)."""
        self.client.report(kind, reason, details)

    @property
    def link_up(self) -> bool:
        """Whether the heartbeat stream to the coordinator is up (or restored)."""
        return bool(self.client.link.up)

    def give_up(self, error: BaseException) -> None:
        """Fails every coordinator call waiting for a lost coordinator with ``error``."""
        self.client.link.give_up(error)

    def leave(self) -> None:
        """Tells the coordinator this member leaves, and nothing else (takes no lock of the job's)."""
        self.client.leave()
