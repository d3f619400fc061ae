"""``mindspore.ops`` collective primitives on collsvc: each call is one collsvc collective.

Inputs are this face's ``Tensor``, MindSpore's own ``Tensor`` (where MindSpore is installed: it comes
back as one) or numpy arrays; outputs are the same kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from collsvc import ReduceOp as _Op
from collsvc.compat.mindspore._tensor import Tensor
from collsvc.compat.mindspore.communication import GlobalComm, group_communicator

__all__ = ["AllGather", "AllReduce", "AlltoAll", "Broadcast", "NeighborExchange", "ReduceOp", "ReduceScatter"]


class ReduceOp:
    """MindSpore's reduction names."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    PROD = "prod"


_OPS = {ReduceOp.SUM: _Op.SUM, ReduceOp.MAX: _Op.MAX, ReduceOp.MIN: _Op.MIN, ReduceOp.PROD: _Op.PRODUCT}


def _op(op: str) -> _Op:
    if op not in _OPS:
        raise ValueError(f"op must be one of ReduceOp.SUM, MAX, MIN, PROD ('sum', 'max', 'min', 'prod'), got {op!r}")
    return _OPS[op]


def _array(x: Any) -> tuple[np.ndarray[Any, Any], Any]:
    """The numpy array of ``x`` and a function that wraps a result as ``x``'s kind."""
    if isinstance(x, Tensor):
        return x.asnumpy(), Tensor
    if isinstance(x, np.ndarray):
        return x, np.asarray
    if hasattr(x, "asnumpy"):  # MindSpore's own Tensor
        kind = type(x)
        return np.ascontiguousarray(x.asnumpy()), kind
    raise TypeError(f"expected a Tensor or numpy array, got {type(x).__name__}")


class _Primitive:
    def __init__(self, group: str) -> None:
        self.group = group

    def __call__(self, *args: Any) -> Any:
        return self.construct(*args)

    def construct(self, *args: Any) -> Any:
        raise NotImplementedError


class AllReduce(_Primitive):
    """Every rank gets the elementwise ``op`` of the group's inputs."""

    def __init__(self, op: str = ReduceOp.SUM, group: str = GlobalComm.WORLD_COMM_GROUP) -> None:
        super().__init__(group)
        self.op = op
        _op(op)

    def construct(self, x: Any) -> Any:
        array, kind = _array(x)
        return kind(group_communicator(self.group).all_reduce(array, _op(self.op)))


class AllGather(_Primitive):
    """The group's inputs concatenated along dimension 0, in rank order."""

    def __init__(self, group: str = GlobalComm.WORLD_COMM_GROUP) -> None:
        super().__init__(group)

    def construct(self, x: Any) -> Any:
        array, kind = _array(x)
        return kind(group_communicator(self.group).all_gather(array))


class ReduceScatter(_Primitive):
    """The ``op`` of the group's inputs, split along dimension 0: rank r gets part r."""

    def __init__(self, op: str = ReduceOp.SUM, group: str = GlobalComm.WORLD_COMM_GROUP) -> None:
        super().__init__(group)
        self.op = op
        _op(op)

    def construct(self, x: Any) -> Any:
        array, kind = _array(x)
        return kind(group_communicator(self.group).reduce_scatter(array, _op(self.op)))


class Broadcast(_Primitive):
    """Rank ``root_rank``'s tensors on every rank: takes a tuple of tensors and returns a tuple."""

    def __init__(self, root_rank: int, group: str = GlobalComm.WORLD_COMM_GROUP) -> None:
        super().__init__(group)
        self.root_rank = root_rank

    def construct(self, input_x: Sequence[Any]) -> tuple[Any, ...]:
        if not isinstance(input_x, (tuple, list)):
            raise TypeError(f"Broadcast takes a tuple of tensors, got {type(input_x).__name__}")
        comm = group_communicator(self.group)
        return tuple(kind(comm.broadcast(array, self.root_rank)) for array, kind in map(_array, input_x))


class AlltoAll(_Primitive):
    """Splits the input into ``split_count`` parts along ``split_dim``; part j goes to rank j, and the
    parts received are concatenated along ``concat_dim`` in rank order."""

    def __init__(
        self, split_count: int, split_dim: int, concat_dim: int, group: str = GlobalComm.WORLD_COMM_GROUP
    ) -> None:
        super().__init__(group)
        self.split_count, self.split_dim, self.concat_dim = split_count, split_dim, concat_dim

    def construct(self, x: Any) -> Any:
        array, kind = _array(x)
        comm = group_communicator(self.group)
        if self.split_count != comm.size:
            raise ValueError(f"AlltoAll: split_count {self.split_count} must equal the group's size {comm.size}")
        if array.shape[self.split_dim] % comm.size:
            raise ValueError(
                f"AlltoAll: dimension {self.split_dim} of shape {array.shape} is not divisible by {comm.size}"
            )
        parts = np.stack(np.split(array, comm.size, axis=self.split_dim))
        received = comm.all_to_all(parts)
        return kind(np.concatenate(list(received), axis=self.concat_dim))


class NeighborExchange(_Primitive):
    """Sends ``x[i]`` to ``send_rank_ids[i]`` and returns the tensors received from ``recv_rank_ids``
    (of ``recv_shapes`` and ``recv_type``), as a tuple."""

    def __init__(
        self,
        send_rank_ids: Sequence[int],
        recv_rank_ids: Sequence[int],
        recv_shapes: Sequence[Sequence[int]],
        send_shapes: Sequence[Sequence[int]],
        recv_type: Any,
        group: str = GlobalComm.WORLD_COMM_GROUP,
    ) -> None:
        super().__init__(group)
        if len(recv_rank_ids) != len(recv_shapes) or len(send_rank_ids) != len(send_shapes):
            raise ValueError("NeighborExchange: one shape per send and per receive rank")
        self.send_rank_ids, self.recv_rank_ids = list(send_rank_ids), list(recv_rank_ids)
        self.recv_shapes, self.send_shapes = [tuple(s) for s in recv_shapes], [tuple(s) for s in send_shapes]
        self.recv_type = recv_type

    def construct(self, x: Sequence[Any]) -> tuple[Any, ...]:
        comm = group_communicator(self.group)
        inputs = [_array(t) for t in x]
        if len(inputs) != len(self.send_rank_ids):
            raise ValueError(f"NeighborExchange: {len(self.send_rank_ids)} tensors to send, got {len(inputs)}")
        for (array, _), dst, shape in zip(inputs, self.send_rank_ids, self.send_shapes, strict=True):
            if tuple(array.shape) != shape:
                raise ValueError(f"NeighborExchange: a tensor to send has shape {array.shape}, declared {shape}")
            comm.send(array, dst)
        kind = inputs[0][1] if inputs else Tensor
        dtype = np.dtype(self.recv_type)
        return tuple(
            kind(comm.recv(src, shape=shape, dtype=dtype))
            for src, shape in zip(self.recv_rank_ids, self.recv_shapes, strict=True)
        )
