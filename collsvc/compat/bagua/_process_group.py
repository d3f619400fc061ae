"""Bagua's ``ReduceOp``, its process group and the communicator handles ``comm=`` takes."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

from collsvc import Communicator
from collsvc import ReduceOp as _Op


class ReduceOp(enum.IntEnum):
    """Bagua's reduction operations, with Bagua's integer values."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_OPS = {
    ReduceOp.SUM: _Op.SUM,
    ReduceOp.PRODUCT: _Op.PRODUCT,
    ReduceOp.MIN: _Op.MIN,
    ReduceOp.MAX: _Op.MAX,
    ReduceOp.BOR: _Op.BOR,
    ReduceOp.BAND: _Op.BAND,
    ReduceOp.BXOR: _Op.BXOR,
    ReduceOp.AVG: _Op.AVG,
}


def _op(op: Any) -> _Op:
    if isinstance(op, _Op):
        return op
    try:
        return _OPS[ReduceOp(int(op))]
    except (ValueError, TypeError):
        raise ValueError(
            f"op must be one of Bagua's ReduceOp values {[int(o) for o in ReduceOp]}, got {op!r}"
        ) from None


class BaguaSingleCommunicator:
    """The handle ``comm=`` takes (Bagua's ``BaguaSingleCommunicatorPy``): ``rank()`` and ``nranks()``."""

    def __init__(self, comm: Communicator) -> None:
        self.communicator = comm

    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self.communicator.rank

    def nranks(self) -> int:
        """The number of ranks in the communicator."""
        return self.communicator.size

    def __repr__(self) -> str:
        return f"BaguaSingleCommunicator({self.communicator.name!r}, rank={self.rank()}, nranks={self.nranks()})"


class BaguaProcessGroup:
    """Bagua's process group: its ranks and its global, intra-node and inter-node communicators.

    On a rank outside the group every communicator is None; the inter-node one exists on each host's
    first member of the group only (as in Bagua).
    """

    def __init__(self, ranks: Sequence[int], stream: Any, group_name: str, comm: Communicator | None = None) -> None:
        self.ranks = list(ranks)
        self.stream = stream
        self.group_name = group_name
        self._comm = comm
        self._intra: BaguaSingleCommunicator | None = None
        self._inter: BaguaSingleCommunicator | None = None

    def get_global_communicator(self) -> BaguaSingleCommunicator | None:
        """The communicator of every rank of the group."""
        return None if self._comm is None else BaguaSingleCommunicator(self._comm)

    def get_intra_node_communicator(self) -> BaguaSingleCommunicator | None:
        """The communicator of the group's ranks on this host."""
        if self._comm is not None and self._intra is None:
            self._intra = BaguaSingleCommunicator(self._comm.intra_node)
        return self._intra

    def get_inter_node_communicator(self) -> BaguaSingleCommunicator | None:
        """The communicator of one rank per host (None on the others)."""
        if self._comm is None or self._comm.local_rank != 0:
            return None
        if self._inter is None:
            self._inter = BaguaSingleCommunicator(self._comm.inter_node)
        return self._inter
