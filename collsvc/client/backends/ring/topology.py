"""Where a group's members live, and the plan that follows from it.

- All members on one host: collectives run through shared memory (``backends/shm``).
- Members on several hosts, some host with more than one: hierarchical all_reduce, which reduces
  within each host, all-reduces across one leader per host over gRPC, and broadcasts within each
  host; only 2(h-1)/h of the bytes cross the (slow) links between h hosts.
- Otherwise: the flat algorithms over gRPC channels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from collsvc.client.backends.base import GroupSpec


@dataclass(frozen=True)
class Topology:
    """One member's view of its group's hosts.

    Attributes:
        local: the group members on this member's host (global ranks, group order).
        local_index: this member's position in ``local``.
        leaders: the first member of each host (global ranks, group order).
        leader_index: this member's position in ``leaders`` (None unless it leads its host).
        hosts: how many hosts the group spans.
    """

    local: tuple[int, ...]
    local_index: int
    leaders: tuple[int, ...]
    leader_index: int | None
    hosts: int

    @property
    def single_host(self) -> bool:
        return self.hosts == 1

    any_shared: bool = False

    @property
    def hierarchical_pays(self) -> bool:
        """Several hosts, and at least one of them holds more than one member."""
        return self.hosts > 1 and self.any_shared


def plan(group: GroupSpec, hosts: Mapping[int, str]) -> Topology:
    """The topology of ``group`` as seen by its member ``group.index``."""
    me = group.ranks[group.index]
    my_host = hosts.get(me, "")
    local = tuple(r for r in group.ranks if hosts.get(r, "") == my_host)
    seen: dict[str, int] = {}
    counts: dict[str, int] = {}
    for rank in group.ranks:
        host = hosts.get(rank, "")
        seen.setdefault(host, rank)
        counts[host] = counts.get(host, 0) + 1
    leaders = tuple(seen.values())
    return Topology(
        local=local,
        local_index=local.index(me),
        leaders=leaders,
        leader_index=leaders.index(me) if me in leaders else None,
        hosts=len(leaders),
        any_shared=any(c > 1 for c in counts.values()),
    )
