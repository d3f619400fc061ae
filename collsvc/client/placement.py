"""Where a group's members run: positions among hosts, computed from the hosts of its members (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One member's position: ``local_rank`` of ``local_size`` members on its host, on host ``node_rank``
    of ``num_nodes`` (hosts numbered in order of their first member)."""

    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int


def placement_of(hosts: Sequence[str], rank: int) -> Placement:
    """The placement of group rank ``rank``, where ``hosts[i]`` is the host of group rank ``i``."""
    mine = hosts[rank]
    node_order = list(dict.fromkeys(hosts))
    return Placement(hosts[:rank].count(mine), hosts.count(mine), node_order.index(mine), len(node_order))


def same_local_rank(ranks: Sequence[int], hosts: Mapping[int, str], local_rank: int) -> list[int]:
    """The members of ``ranks`` (job-wide, in group order; ``hosts`` indexed by job-wide rank) whose
    position on their host is ``local_rank``: one per host that has that many members (Horovod's cross
    communicator)."""
    position: dict[str, int] = {}
    chosen: list[int] = []
    for r in ranks:
        here = position.get(hosts[r], 0)
        position[hosts[r]] = here + 1
        if here == local_rank:
            chosen.append(r)
    return chosen
