"""Readable accounts of a joining job: which ranks have not joined yet (pure, no gRPC).

Used by a member waiting in rendezvous (its periodic log line and its timeout error) and by
``collsvc status``.
"""

from __future__ import annotations

from collections.abc import Iterable


def not_joined(world_size: int, ranks: Iterable[int]) -> list[int] | None:
    """The ranks of a joining job that no member holds, or None when some member has no rank yet.

    Args:
        world_size: the job's world size.
        ranks: the ranks the waiting members asked for; -1 for a member the coordinator will assign.
    """
    taken = set(ranks)
    if world_size <= 0 or any(rank < 0 for rank in taken):
        return None
    return [rank for rank in range(world_size) if rank not in taken]


def ranks_text(ranks: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"`` (``""`` for no ranks)."""
    if not ranks:
        return ""
    spans: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return ", ".join(spans)


def describe_not_joined(world_size: int, ranks: list[int]) -> str:
    """``"not joined: rank 1 (1 of 2 joined)"`` for the members ``ranks`` of a joining job.

    When some members let the coordinator assign ranks, only the number still missing is known.
    """
    missing = not_joined(world_size, ranks)
    if missing is None:
        return f"not joined: {world_size - len(ranks)} of {world_size} members (ranks are assigned once all joined)"
    if not missing:
        return f"all {world_size} members joined"
    plural = "s" if len(missing) != 1 else ""
    return f"not joined: rank{plural} {ranks_text(missing)} ({len(ranks)} of {world_size} joined)"
