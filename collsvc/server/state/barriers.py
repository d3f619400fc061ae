"""Generation-counted barriers.

Barrier ``(group, generation)`` completes when every member of the group arrived with that
generation. Each member counts its own barriers in a group from 1, so arrivals for generation N+1
never mix with a late generation N: back-to-back barriers cannot race, and nobody resets anything.

Generations come in series (``generation >> SERIES_SHIFT``): user barriers count from 1, while named
internal barriers (NCCL set-up) use high generations of their own series. Completion is tracked per
series, so the completion of a high internal generation never answers a user barrier.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

BarrierKey = tuple[str, int]
SERIES_SHIFT = 20


def series(group: str, generation: int) -> BarrierKey:
    """The series ``(group, generation >> SERIES_SHIFT)`` a barrier generation belongs to."""
    return group, generation >> SERIES_SHIFT


class BarrierBook:
    """The open barriers of one job. Each arrival is O(1); nothing scans the group."""

    def __init__(self) -> None:
        self._arrived: dict[BarrierKey, set[int]] = {}
        # Within a series, generation N+1 can only complete after N did for every member, so the
        # highest completed generation is enough to answer retries of completed barriers.
        self._last_completed: dict[BarrierKey, int] = {}

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
        key = series(group, generation)
        self._last_completed[key] = max(self._last_completed.get(key, 0), generation)
        return True

    def mark_completed(self, group: str, generation: int) -> None:
        """Records that barrier ``(group, generation)``, and so every earlier one of its series, completed.

        A member re-registering with a restarted coordinator reports the barriers it saw complete,
        so that a member whose reply was lost in the restart is answered at once when it retries.
        """
        key = series(group, generation)
        if generation > self._last_completed.get(key, 0):
            self._last_completed[key] = generation
        # Arrivals re-sent to the new coordinator for a barrier another member saw complete.
        for pending in [k for k in self._arrived if k[0] == group and series(*k) == key and k[1] <= generation]:
            del self._arrived[pending]

    def is_complete(self, group: str, generation: int) -> bool:
        """Whether barrier ``(group, generation)`` completed."""
        return (group, generation) not in self._arrived and generation <= self._last_completed.get(
            series(group, generation), 0
        )

    def missing(self, group: str, generation: int, ranks: Collection[int]) -> list[int]:
        """The ranks of ``ranks`` (the group) that have not arrived at ``(group, generation)``."""
        if self.is_complete(group, generation):
            return []
        arrived = self._arrived.get((group, generation), set())
        return [r for r in ranks if r not in arrived]

    def arrivals(self, group: str, generation: int) -> int:
        """How many members are recorded at the open barrier ``(group, generation)`` (0 once complete)."""
        arrived = self._arrived.get((group, generation))
        return 0 if arrived is None else len(arrived)

    def arrived_among(self, group: str, generation: int, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` that arrived at ``(group, generation)`` (all of them once it completed).

        O(len(ranks)): callers pass a few ranks (those that left), never the whole group.
        """
        if self.is_complete(group, generation):
            return list(ranks)
        arrived = self._arrived.get((group, generation), set())
        return [r for r in ranks if r in arrived]

    def pending(self) -> list[BarrierKey]:
        """The barriers someone is waiting in."""
        return list(self._arrived)
