"""``mindspore.communication``: joining the job and its groups, on collsvc.

Group names are MindSpore's: ``GlobalComm.WORLD_COMM_GROUP`` (``"hccl_world_group"``), and
``"nccl_world_group"`` and ``"mccl_world_group"`` also mean every rank; other groups are made with
:func:`create_group`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import collsvc
from collsvc import Communicator

__all__ = [
    "GlobalComm",
    "HCCL_WORLD_COMM_GROUP",
    "MCCL_WORLD_COMM_GROUP",
    "NCCL_WORLD_COMM_GROUP",
    "create_group",
    "destroy_group",
    "get_group_rank_from_world_rank",
    "get_group_size",
    "get_local_rank",
    "get_local_rank_size",
    "get_rank",
    "get_world_rank_from_group_rank",
    "init",
    "release",
]

HCCL_WORLD_COMM_GROUP = "hccl_world_group"
NCCL_WORLD_COMM_GROUP = "nccl_world_group"
MCCL_WORLD_COMM_GROUP = "mccl_world_group"
WORLD_NAMES = frozenset({HCCL_WORLD_COMM_GROUP, NCCL_WORLD_COMM_GROUP, MCCL_WORLD_COMM_GROUP, "world"})


class GlobalComm:
    """MindSpore's global communication settings."""

    BACKEND = "collsvc"
    WORLD_COMM_GROUP = HCCL_WORLD_COMM_GROUP
    INITED = False


_groups: dict[str, Communicator | None] = {}
_group_ranks: dict[str, list[int]] = {}


def init(backend_name: str | None = None) -> None:
    """Joins the job from the launcher's environment (mpirun, ``collsvc run``, ...); ``backend_name``
    (``"nccl"``, ``"hccl"``, ``"mccl"``) is accepted: collsvc picks its own transport.

    Raises:
        The errors of :func:`collsvc.init`.
    """
    collsvc.init()
    GlobalComm.INITED = True


def release() -> None:
    """Leaves the job."""
    collsvc.destroy()
    _groups.clear()
    _group_ranks.clear()
    GlobalComm.INITED = False


def _world() -> Communicator:
    if not collsvc.is_initialized():
        raise collsvc.CollsvcError("communication is not initialized: call mindspore.communication.init() first")
    return collsvc.default_communicator()


def group_communicator(group: str) -> Communicator:
    """The collsvc communicator of the MindSpore group ``group``.

    Raises:
        ValueError: no such group, or this rank is not in it.
    """
    world = _world()
    if group in WORLD_NAMES:
        return world
    if group not in _groups:
        raise ValueError(f"no group named {group!r}: create it with create_group first")
    comm = _groups[group]
    if comm is None:
        raise ValueError(f"this rank ({world.rank}) is not a member of group {group!r} {_group_ranks[group]}")
    return comm


def create_group(group: str, rank_ids: Sequence[int], options: Any = None) -> None:
    """Creates group ``group`` of the world ranks ``rank_ids``; only its members call it (as in MindSpore).

    Raises:
        ValueError: the name is a world group's or taken, or this rank is not in ``rank_ids``.
    """
    world = _world()
    if group in WORLD_NAMES or group in _groups:
        raise ValueError(f"group {group!r} exists already")
    ranks = [int(r) for r in rank_ids]
    if world.rank not in ranks:
        raise ValueError(f"create_group: rank {world.rank} is not in rank_ids {ranks}; only members create a group")
    _groups[group] = world.subgroup(f"mindspore/{group}", sorted(ranks))
    _group_ranks[group] = sorted(ranks)


def destroy_group(group: str) -> None:
    """Forgets group ``group``.

    Raises:
        ValueError: a world group, or no such group.
    """
    if group in WORLD_NAMES or group not in _groups:
        raise ValueError(f"cannot destroy group {group!r}")
    comm = _groups.pop(group)
    _group_ranks.pop(group)
    if comm is not None:
        comm.close()


def get_rank(group: str = GlobalComm.WORLD_COMM_GROUP) -> int:
    """This process's rank in ``group``."""
    return group_communicator(group).rank


def get_group_size(group: str = GlobalComm.WORLD_COMM_GROUP) -> int:
    """The number of ranks in ``group``."""
    return group_communicator(group).size


def get_local_rank(group: str = GlobalComm.WORLD_COMM_GROUP) -> int:
    """This process's rank among ``group``'s ranks on its host."""
    return group_communicator(group).local_rank


def get_local_rank_size(group: str = GlobalComm.WORLD_COMM_GROUP) -> int:
    """The number of ``group``'s ranks on this host."""
    return group_communicator(group).local_size


def get_world_rank_from_group_rank(group: str, group_rank_num: int) -> int:
    """The world rank of rank ``group_rank_num`` of ``group``."""
    return group_communicator(group).global_ranks[group_rank_num]


def get_group_rank_from_world_rank(world_rank_num: int, group: str) -> int:
    """The rank in ``group`` of world rank ``world_rank_num``.

    Raises:
        ValueError: that rank is not in the group.
    """
    return group_communicator(group).global_ranks.index(world_rank_num)
