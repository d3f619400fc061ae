"""What the Communicator adds for sub-communicators: groups made by every member (``new_group``) or by
their members only (``subgroup``), named groups, and the per-host views ``intra_node`` and
``inter_node``. Each is a Communicator of the same job; the coordinator records its members."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from collsvc.client.coordinator_access import CoordinatorAccess
from collsvc.client.job import Job
from collsvc.client.placement import same_local_rank

if TYPE_CHECKING:  # typing.Self from Python 3.11 on
    from typing_extensions import Self


class Subgroups:
    """Mixed into the Communicator (which sets these attributes and takes ``(job, name, global_ranks)``)."""

    _job: Job
    _coordinator: CoordinatorAccess
    _ranks: tuple[int, ...]
    _lock: threading.Lock
    _groups: int
    _intra: Self | None
    _inter: Self | None
    name: str
    rank: int
    node_rank: int
    local_rank: int

    def __init__(self, job: Job, name: str, global_ranks: Sequence[int]) -> None:
        raise NotImplementedError  # the Communicator's

    def _group_rank(self, rank: int, what: str) -> int:
        raise NotImplementedError  # the Communicator's

    def _check_usable(self) -> None:
        raise NotImplementedError  # the Communicator's

    def new_group(self, ranks: Sequence[int], name: str | None = None) -> Self | None:
        """A sub-communicator of ``ranks`` (ranks of this communicator). Every rank of this communicator
        calls it, in the same order; ranks outside ``ranks`` get None.

        Raises:
            ValueError: duplicate or out-of-range ranks, or ``name`` already names other ranks.
        """
        members = [self._group_rank(r, "ranks[i]") for r in ranks]
        if not members or len(set(members)) != len(members):
            raise ValueError(f"new_group needs distinct ranks, got {list(ranks)}")
        with self._lock:
            self._groups += 1
            index = self._groups
        group_name = name or f"{self.name}.{index}"
        global_ranks = [self._ranks[r] for r in members]
        self._check_usable()
        self._coordinator.new_group(group_name, global_ranks)
        if self.rank not in members:
            return None
        return type(self)(self._job, group_name, global_ranks)

    def find_group(self, name: str) -> list[int]:
        """The (job-wide) ranks of the group named ``name``, or [] if there is none."""
        return self._coordinator.find_group(name)

    def subgroup(self, name: str, global_ranks: Sequence[int]) -> Self:
        """A communicator over the job-wide ``global_ranks``, created by those members only (unlike
        :meth:`new_group`, which every rank of this communicator calls): each of them calls it with
        the same ``name`` and ranks, which this process must be one of.

        Raises:
            ValueError: this process is not in ``global_ranks``, or ``name`` already names other ranks.
            CollsvcError: the job failed, or the coordinator could not be reached in time.
        """
        ranks = [int(r) for r in global_ranks]
        if self._job.rank not in ranks:
            raise ValueError(f"rank {self._job.rank} is not among the group's ranks {ranks}")
        self._check_usable()
        self._coordinator.new_group(name, ranks)
        return type(self)(self._job, name, ranks)

    @property
    def intra_node(self) -> Self:
        """The members of this communicator on this host."""
        if self._intra is None:
            hosts = self._job.hosts
            mine = hosts[self._job.rank]
            ranks = [r for r in self._ranks if hosts[r] == mine]
            self._intra = self.subgroup(f"{self.name}/node{self.node_rank}", ranks)
        return self._intra

    @property
    def inter_node(self) -> Self:
        """One member per host: the host leaders (local_rank 0) for leaders; for the others, the members
        with the same local_rank on every host that has one (Horovod's cross communicator)."""
        if self._inter is None:
            ranks = same_local_rank(self._ranks, self._job.hosts, self.local_rank)
            self._inter = self.subgroup(f"{self.name}/cross{self.local_rank}", ranks)
        return self._inter
