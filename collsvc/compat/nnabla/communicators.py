"""nnabla's ``nnabla.communicators`` (seed 000) on collsvc: ``MultiProcessDataParallelCommunicator``.

Every method and property of nnabla's ``Communicator`` is here with nnabla's signature; each turns into
one call on a :class:`collsvc.Communicator`, and results land in the callers' arrays as nnabla's do.
``inplace`` (nnabla's choice between a packed buffer and per-array transfers) is accepted and changes
nothing: a list of arrays is one fused collsvc operation either way. ``division=True`` averages (integer
arrays: sum, then floor division by the group's size). Groups are named as in nnabla; ``"world"`` is
every rank. Errors are collsvc's (``collsvc.CollsvcError`` and its subclasses, ``ValueError``/``TypeError``
for bad arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import collsvc
from collsvc import Communicator as CollsvcCommunicator
from collsvc import ReduceOp

__all__ = [
    "AllReduceCallback",
    "Communicator",
    "MultiProcessCommunicator",
    "MultiProcessDataParallelCommunicator",
    "MultiProcessDataParalellCommunicator",
]

WORLD = "world"


def _host(item: Any) -> tuple[np.ndarray[Any, Any], Any]:
    """The numpy array behind an nnabla array (``NdArray``, ``Variable`` or numpy), and the object to
    assign the result back to when its ``.data`` may be a copy (nnabla's own NdArray), else None."""
    if isinstance(item, np.ndarray):
        return item, None
    data = getattr(item, "data", None)
    if data is None:
        raise TypeError(f"expected an nnabla NdArray, Variable or numpy array, got {type(item).__name__}")
    if not isinstance(data, np.ndarray):  # a Variable: its .data is an NdArray
        return _host(data)
    from collsvc.compat.nnabla import NdArray

    return data, None if isinstance(item, NdArray) else item


def _hosts(data: Any) -> tuple[list[np.ndarray[Any, Any]], list[Any]]:
    items = list(data) if isinstance(data, (list, tuple)) else [data]
    if not items:
        raise ValueError("expected at least one array")
    pairs = [_host(item) for item in items]
    return [a for a, _ in pairs], [o for _, o in pairs]


def _by_dtype(arrays: Sequence[np.ndarray[Any, Any]]) -> list[list[np.ndarray[Any, Any]]]:
    """The arrays split by dtype: collsvc fuses a list of one dtype into one transfer."""
    groups: dict[str, list[np.ndarray[Any, Any]]] = {}
    for array in arrays:
        groups.setdefault(array.dtype.str, []).append(array)
    return list(groups.values())


def _store(arrays: Sequence[np.ndarray[Any, Any]], owners: Sequence[Any]) -> None:
    for array, owner in zip(arrays, owners, strict=True):
        if owner is not None:
            owner.data = array


class MultiProcessDataParallelCommunicator:
    """nnabla's multi-process data-parallel communicator: one process per device, on collsvc.

    Args:
        ctx: an nnabla context (``get_extension_context``); kept, not interpreted.
    """

    def __init__(self, ctx: Any = None) -> None:
        self.ctx = ctx
        self._comm: CollsvcCommunicator | None = None
        self._groups: dict[str, CollsvcCommunicator | None] = {}
        self._group_ranks: dict[str, list[int]] = {}
        self._ctx_params: list[tuple[Any, dict[str, Any]]] = []

    # ---- set-up -----------------------------------------------------------------------------------
    def init(self) -> None:
        """Joins the job (``collsvc.init()`` from the launcher's environment: ``collsvc run``, mpirun ...).

        Raises:
            The errors of :func:`collsvc.init`.
        """
        self._comm = collsvc.init()
        self._groups = {WORLD: self._comm}
        self._group_ranks = {WORLD: list(range(self._comm.size))}

    def _world(self) -> CollsvcCommunicator:
        if self._comm is None:
            raise collsvc.CollsvcError("the communicator is not initialized: call comm.init() first")
        return self._comm

    def _group(self, group: str) -> CollsvcCommunicator:
        self._world()
        if group not in self._groups:
            raise ValueError(
                f"no group named {group!r}: create it with new_group first (groups: {sorted(self._groups)})"
            )
        comm = self._groups[group]
        if comm is None:
            raise ValueError(f"this rank ({self.rank}) is not a member of group {group!r} {self._group_ranks[group]}")
        return comm

    @property
    def size(self) -> int:
        """The number of processes in the job."""
        return self._world().size

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._world().rank

    @property
    def local_rank(self) -> int:
        """This process's rank among those on its host (the device to use)."""
        return self._world().local_rank

    @property
    def name(self) -> str:
        """The communicator's name."""
        return type(self).__name__

    def add_context_and_parameters(self, ctx_param_dict: tuple[Any, dict[str, Any]]) -> None:
        """Adds a ``(context, {name: Variable})`` pair whose gradients :meth:`allreduce` reduces."""
        ctx, params = ctx_param_dict
        self._ctx_params.append((ctx, dict(params)))

    def clear_context_parameters(self) -> None:
        """Forgets every pair :meth:`add_context_and_parameters` added."""
        self._ctx_params.clear()

    # ---- groups -----------------------------------------------------------------------------------
    def new_group(self, name_ranks: tuple[str, Sequence[int]] | str, ranks: Sequence[int] | None = None) -> str:
        """Creates group ``name`` of ``ranks``; every rank calls it, in the same order. Takes nnabla's
        ``new_group((name, ranks))`` and the ``new_group(name, ranks)`` of its docs' example.

        Returns:
            The group's name.

        Raises:
            ValueError: bad ranks, or the name is taken by other ranks.
        """
        if ranks is None:
            if not isinstance(name_ranks, (tuple, list)) or len(name_ranks) != 2:
                raise ValueError(f"new_group takes (name, ranks), got {name_ranks!r}")
            name, ranks = name_ranks
        else:
            name = name_ranks  # type: ignore[assignment]
        if not isinstance(name, str):
            raise TypeError(f"a group's name is a str, got {type(name).__name__}")
        members = [int(r) for r in ranks]
        if name == WORLD:
            raise ValueError("'world' names every rank; choose another group name")
        self._groups[name] = self._world().new_group(members, name=f"nnabla/{name}")
        self._group_ranks[name] = members
        return name

    def list_groups(self) -> dict[str, list[int]]:
        """Every group's name and ranks (``"world"`` included)."""
        self._world()
        return {name: list(ranks) for name, ranks in self._group_ranks.items()}

    def find_group(self, group: str) -> list[int]:
        """The ranks of ``group``, or ``[]`` if there is none."""
        self._world()
        return list(self._group_ranks.get(group, []))

    # ---- collectives ------------------------------------------------------------------------------
    def _reduce_op(self, arrays: Sequence[np.ndarray[Any, Any]], division: bool) -> ReduceOp:
        floats = all(a.dtype.kind in "fc" for a in arrays)
        return ReduceOp.AVG if division and floats else ReduceOp.SUM

    @staticmethod
    def _divide_integers(arrays: Sequence[np.ndarray[Any, Any]], division: bool, size: int) -> None:
        if division:
            for a in arrays:
                if a.dtype.kind not in "fc":
                    np.floor_divide(a, size, out=a)

    def all_reduce(self, data: Any, division: bool = False, inplace: bool = False, group: str = WORLD) -> None:
        """Sums ``data`` (an NdArray or a list of them) over the group, in place; ``division`` averages.

        Raises:
            ValueError: unknown group, or this rank is not in it. The errors of ``Communicator.all_reduce``.
        """
        comm = self._group(group)
        arrays, owners = _hosts(data)
        op = self._reduce_op(arrays, division)
        for same in _by_dtype(arrays):
            comm.all_reduce(same, op, out=same)
        if op is not ReduceOp.AVG:
            self._divide_integers(arrays, division, comm.size)
        _store(arrays, owners)

    def allreduce(self, division: bool = False, inplace: bool = False) -> None:
        """Deprecated in nnabla: all_reduce of the gradients of the parameters added with
        :meth:`add_context_and_parameters`."""
        grads = [v.grad for _, params in self._ctx_params for v in params.values()]
        if grads:
            self.all_reduce(grads, division=division, inplace=inplace)

    def all_reduce_callback(
        self, data: Any, pack_size: int, division: bool = False, group: str = WORLD
    ) -> AllReduceCallback:
        """A callback that all-reduces ``data`` in packs of ``pack_size`` elements while the caller's
        backward pass goes on: call it with each gradient as it becomes ready, then ``wait()``.

        Raises:
            ValueError: unknown group, no arrays, ``pack_size`` < 1.
        """
        comm = self._group(group)
        arrays, owners = _hosts(data)
        if isinstance(pack_size, bool) or not isinstance(pack_size, int) or pack_size < 1:
            raise ValueError(f"pack_size must be a positive number of elements, got {pack_size!r}")
        op = self._reduce_op(arrays, division)
        itemsize = max(a.dtype.itemsize for a in arrays)
        return AllReduceCallback(
            comm,
            list(data) if isinstance(data, (list, tuple)) else [data],
            arrays,
            owners,
            pack_size * itemsize,
            op,
            division,
        )

    def bcast(self, data: Any, src: int, inplace: bool = False, group: str = WORLD) -> None:
        """Copies rank ``src``'s ``data`` into every rank's ``data``."""
        comm = self._group(group)
        arrays, owners = _hosts(data)
        for same in _by_dtype(arrays):
            comm.broadcast(same, src, out=same)
        _store(arrays, owners)

    def reduce(self, data: Any, dst: int, division: bool = False, inplace: bool = False, group: str = WORLD) -> None:
        """Sums ``data`` over the group into rank ``dst``'s ``data`` (the others' stay as they were)."""
        comm = self._group(group)
        arrays, owners = _hosts(data)
        op = self._reduce_op(arrays, division)
        for array in arrays:  # collsvc fuses lists for all_reduce and broadcast only
            comm.reduce(array, dst, op, out=array)
        if comm.rank == dst:
            if op is not ReduceOp.AVG:
                self._divide_integers(arrays, division, comm.size)
            _store(arrays, owners)

    def all_gather(self, ndarray: Any, ndarray_list: Sequence[Any], group: str = WORLD) -> None:
        """Every rank's ``ndarray`` into ``ndarray_list[rank]`` of every rank.

        Raises:
            ValueError: ``ndarray_list`` does not hold one array per rank of the group.
        """
        comm = self._group(group)
        (array,), _ = _hosts(ndarray)
        targets, owners = _hosts(ndarray_list)
        if len(targets) != comm.size:
            raise ValueError(f"all_gather needs {comm.size} arrays in ndarray_list, got {len(targets)}")
        gathered = comm.all_gather(np.ascontiguousarray(array).reshape(1, -1))
        for i, target in enumerate(targets):
            target[...] = gathered[i].reshape(target.shape)
        _store(targets, owners)

    def reduce_scatter(
        self, ndarray_list: Sequence[Any], ndarray: Any, division: bool = False, group: str = WORLD
    ) -> None:
        """Sums ``ndarray_list[i]`` over the group; rank ``i`` gets the i-th sum in ``ndarray``.

        Raises:
            ValueError: ``ndarray_list`` does not hold one array per rank of the group.
        """
        comm = self._group(group)
        sources, _ = _hosts(ndarray_list)
        (target,), owners = _hosts(ndarray)
        if len(sources) != comm.size:
            raise ValueError(f"reduce_scatter needs {comm.size} arrays in ndarray_list, got {len(sources)}")
        stacked = np.stack([np.asarray(s, dtype=target.dtype).reshape(-1) for s in sources])
        op = self._reduce_op([target], division)
        result = comm.reduce_scatter(stacked, op)
        target[...] = result.reshape(target.shape)
        if op is not ReduceOp.AVG:
            self._divide_integers([target], division, comm.size)
        _store([target], owners)

    def barrier(self) -> None:
        """Returns when every rank has called it."""
        self._world().barrier()

    def abort(self) -> None:
        """Fails every rank's pending and later collectives (``collsvc.AbortedError``), as MPI_Abort ends
        every process of an MPI job."""
        self._world().abort("nnabla communicator abort()")


class AllReduceCallback:
    """What :meth:`MultiProcessDataParallelCommunicator.all_reduce_callback` returns: call it with each
    gradient as it becomes ready (packs go out as they fill), then :meth:`wait` for the rest."""

    def __init__(
        self,
        comm: CollsvcCommunicator,
        items: list[Any],
        arrays: list[np.ndarray[Any, Any]],
        owners: list[Any],
        pack_bytes: int,
        op: ReduceOp,
        division: bool,
    ) -> None:
        self._comm = comm
        self._arrays = arrays
        self._owners = owners
        self._by_id = {id(item): array for item, array in zip(items, arrays, strict=True)}
        self._by_id.update({id(array): array for array in arrays})
        self._division = division
        self._op = op
        self._bucketer = comm.all_reduce_callback(arrays, pack_bytes, op)

    def __call__(self, item: Any) -> None:
        """Marks ``item`` (one of the arrays given) ready.

        Raises:
            ValueError: not one of the arrays given, or already marked ready.
        """
        array = self._by_id.get(id(item))
        if array is None and getattr(item, "data", None) is not None:
            array = self._by_id.get(id(item.data))
        self._bucketer(item if array is None else array)

    def wait(self, timeout: float | None = None) -> None:
        """Reduces the arrays not yet reduced and waits until every result landed.

        Raises:
            CollsvcError: a reduction failed.
        """
        self._bucketer.wait(timeout)
        if self._op is not ReduceOp.AVG:
            MultiProcessDataParallelCommunicator._divide_integers(self._arrays, self._division, self._comm.size)
        _store(self._arrays, self._owners)


# nnabla's other names for the same class (the second is spelled so in nnabla).
MultiProcessCommunicator = MultiProcessDataParallelCommunicator
MultiProcessDataParalellCommunicator = MultiProcessDataParallelCommunicator
Communicator = MultiProcessDataParallelCommunicator
