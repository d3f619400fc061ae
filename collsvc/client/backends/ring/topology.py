"""Where a group's members live, and the plan that follows from it.

- All members on one host: collectives run through shared memory (``backends/shm``).
- Members on several hosts, some host with more than one: hierarchical all_reduce, which reduces
  within each host, all-reduces across hosts (by slices among ``counterparts`` where every host
  holds as many members, else among one leader per host), and shares the result within each host;
  only 2(h-1)/h of the bytes cross the (slow) links between h hosts.
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
        counterparts: the members at ``local_index`` on every host (global ranks, hosts in the order of
            ``leaders``) where every host holds as many members as this one; None otherwise.
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
    counterparts: tuple[int, ...] | None = None

    @property
    def hierarchical_pays(self) -> bool:
        """Several hosts, and at least one of them holds more than one member."""
        return self.hosts > 1 and self.any_shared


def plan(group: GroupSpec, hosts: Mapping[int, str]) -> Topology:
    """The topology of ``group`` as seen by its member ``group.index``."""
    me = group.ranks[group.index]
    my_host = hosts.get(me, "")
    local = tuple(r for r in group.ranks if hosts.get(r, "") == my_host)
    members: dict[str, list[int]] = {}  # host -> its members in group order; hosts in order of first member
    for rank in group.ranks:
        members.setdefault(hosts.get(rank, ""), []).append(rank)
    leaders = tuple(ranks[0] for ranks in members.values())
    local_index = local.index(me)
    even = all(len(ranks) == len(local) for ranks in members.values())
    return Topology(
        local=local,
        local_index=local_index,
        leaders=leaders,
        leader_index=leaders.index(me) if me in leaders else None,
        hosts=len(leaders),
        any_shared=any(len(ranks) > 1 for ranks in members.values()),
        counterparts=tuple(ranks[local_index] for ranks in members.values()) if even else None,
    )
