"""Generation-counted barriers.

Barrier ``(group, generation)`` completes when every member of the group arrived with that
generation. Each member counts its own barriers in a group from 1, so arrivals for generation N+1
never mix with a late generation N: back-to-back barriers cannot race, and nobody resets anything.
"""

from __future__ import annotations

from collections.abc import Collection

BarrierKey = tuple[str, int]


class BarrierBook:
    """The open barriers of one job. Each arrival is O(1); nothing scans the group."""

    def __init__(self) -> None:
        self._arrived: dict[BarrierKey, set[int]] = {}
        # Within a group, generation N+1 can only complete after N did for every member, so the
        # highest completed generation is enough to answer retries of completed barriers.
        self._last_completed: dict[str, int] = {}

    def arrive(self, group: str, generation: int, rank: int, size: int) -> bool:
        """Records ``rank``'s arrival; returns whether barrier ``(group, generation)`` is complete.

        Arriving twice (a retried request) counts once. The caller checked that ``rank`` belongs
        to the group and that ``size`` is the group's size.

        Raises:
            ValueError: generation below 1.
        """
        if generation < 1:
            raise ValueError(f"barrier generation must be >= 1, got {generation}")
        if self.is_complete(group, generation):
            return True
        key = (group, generation)
        arrived = self._arrived.setdefault(key, set())
        arrived.add(rank)
        if len(arrived) < size:
            return False
        del self._arrived[key]
        self._last_completed[group] = max(self._last_completed.get(group, 0), generation)
        return True

    def is_complete(self, group: str, generation: int) -> bool:
        """Whether barrier ``(group, generation)`` completed."""
        return (group, generation) not in self._arrived and generation <= self._last_completed.get(group, 0)

    def missing(self, group: str, generation: int, ranks: Collection[int]) -> list[int]:
        """The ranks of ``ranks`` (the group) that have not arrived at ``(group, generation)``."""
        if self.is_complete(group, generation):
            return []
        arrived = self._arrived.get((group, generation), set())
        return [r for r in ranks if r not in arrived]

    def pending(self) -> list[BarrierKey]:
        """The barriers someone is waiting in."""
        return list(self._arrived)
