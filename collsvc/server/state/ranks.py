"""Rank assignment: a pure function of the members of a complete job.

Requested ranks are honoured. The others fill the remaining ranks so that the ranks of one host are
contiguous where possible: hosts in name order (a host that holds requested ranks first extends them
upward), and within a host by ``local_rank_hint``, then pid, then arrival order. The same input always
gives the same ranks, whatever order the joins arrived in (arrival only breaks exact ties).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one member lands: its rank and its place on its host and among hosts."""

    rank: int
    local_rank: int
    local_size: int
    node_rank: int


@dataclass(frozen=True, slots=True)
class _Candidate:
    index: int
    host: str
    requested_rank: int | None
    local_rank_hint: int | None
    pid: int
    arrival: int


def _order_key(member: _Candidate) -> tuple[bool, int, int, int]:
    hint = member.local_rank_hint
    return (hint is None, hint if hint is not None else 0, member.pid, member.arrival)


def assign_ranks(
    members: Sequence[tuple[str, int | None, int | None, int, int]], world_size: int
) -> tuple[list[Placement], int]:
    """Assigns ranks to a complete set of members.

    Args:
        members: one ``(host, requested_rank, local_rank_hint, pid, arrival)`` per member; requested
            ranks must be distinct and in ``[0, world_size)`` (the caller checked).
        world_size: the number of members.

    Returns:
        One :class:`Placement` per member (same order as ``members``), and the number of hosts.

    Raises:
        ValueError: ``members`` does not have ``world_size`` entries.
    """
    if len(members) != world_size:
        raise ValueError(f"{len(members)} members for world size {world_size}")
    candidates = [_Candidate(i, *m) for i, m in enumerate(members)]
    ranks = [-1] * world_size
    taken = [False] * world_size
    top_requested: dict[str, int] = {}
    unrequested: dict[str, list[_Candidate]] = {}
    for c in candidates:
        if c.requested_rank is None:
            unrequested.setdefault(c.host, []).append(c)
        else:
            ranks[c.index] = c.requested_rank
            taken[c.requested_rank] = True
            top_requested[c.host] = max(top_requested.get(c.host, -1), c.requested_rank)

    leftovers: list[_Candidate] = []
    for host in sorted(unrequested):
        ordered = sorted(unrequested[host], key=_order_key)
        if host not in top_requested:
            leftovers.extend(ordered)
            continue
        # Keep this host's members next to the ranks it asked for, while those slots are free.
        nxt = top_requested[host] + 1
        for i, c in enumerate(ordered):
            if nxt >= world_size or taken[nxt]:
                leftovers.extend(ordered[i:])
                break
            ranks[c.index] = nxt
            taken[nxt] = True
            nxt += 1

    cursor = 0
    for c in leftovers:
        while taken[cursor]:
            cursor += 1
        ranks[c.index] = cursor
        taken[cursor] = True

    # Local ranks per host in rank order; node_rank orders hosts by their lowest rank.
    by_host: dict[str, list[int]] = {}
    for c in candidates:
        by_host.setdefault(c.host, []).append(ranks[c.index])
    local: dict[int, tuple[int, int, int]] = {}
    hosts_by_lowest = sorted(by_host, key=lambda h: min(by_host[h]))
    for node_rank, host in enumerate(hosts_by_lowest):
        host_ranks = sorted(by_host[host])
        for local_rank, rank in enumerate(host_ranks):
            local[rank] = (local_rank, len(host_ranks), node_rank)
    placements = [Placement(ranks[c.index], *local[ranks[c.index]]) for c in candidates]
    return placements, len(by_host)
