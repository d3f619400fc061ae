"""Named groups of a job: a name maps to an ordered list of global ranks; "world" is every rank."""

from __future__ import annotations

from collections.abc import Sequence

from collsvc.errors import ResourceLimitError
from collsvc.server.state.common import WORLD, NotFoundError


class Groups:
    """The registered groups of one job of ``world_size`` ranks.

    Args:
        world_size: ranks in the job.
        max_groups: how many named groups may be registered.
    """

    def __init__(self, world_size: int, max_groups: int) -> None:
        self.world_size = world_size
        self._max = max_groups
        self.named: dict[str, tuple[int, ...]] = {}
        self._sets: dict[str, frozenset[int]] = {}

    def ranks(self, name: str) -> Sequence[int]:
        """The ranks of ``name``.

        Raises:
            NotFoundError: no group of that name.
        """
        if name == WORLD:
            return range(self.world_size)
        ranks = self.named.get(name)
        if ranks is None:
            raise NotFoundError(f"no group {name!r}")
        return ranks

    def contains(self, name: str, rank: int) -> bool:
        """Whether ``rank`` is in the (existing) group ``name``."""
        if name == WORLD:
            return 0 <= rank < self.world_size
        return rank in self._sets[name]

    def find(self, name: str) -> tuple[int, ...] | None:
        """The ranks of ``name``, or None."""
        return tuple(range(self.world_size)) if name == WORLD else self.named.get(name)

    def add(self, name: str, ranks: Sequence[int]) -> None:
        """Registers ``name`` (idempotent when the ranks are equal).

        Raises:
            ValueError: empty name or ranks, a rank repeated or outside the job, "world" redefined,
                or ``name`` already registered with other ranks.
            ResourceLimitError: too many groups.
        """
        size = self.world_size
        if not name:
            raise ValueError("group name must not be empty")
        wanted = tuple(ranks)
        if not wanted or len(set(wanted)) != len(wanted) or not all(0 <= r < size for r in wanted):
            raise ValueError(f"group {name!r}: ranks {list(wanted)} must be distinct and within [0, {size})")
        if name == WORLD:
            if sorted(wanted) != list(range(size)):
                raise ValueError(f"group name {WORLD!r} is reserved for all ranks")
            return
        existing = self.named.get(name)
        if existing is not None:
            if existing != wanted:
                raise ValueError(f"group {name!r} already exists with ranks {list(existing)}, not {list(wanted)}")
            return
        if len(self.named) >= self._max:
            raise ResourceLimitError(f"too many groups (limit {self._max})")
        self.named[name] = wanted
        self._sets[name] = frozenset(wanted)
