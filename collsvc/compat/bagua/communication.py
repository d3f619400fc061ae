"""Bagua's ``bagua.torch_api.communication`` (seed 002) on collsvc, for torch tensors on CPU and CUDA.

Every function and class of the seed keeps Bagua's name, signature, defaults and ``ReduceOp`` values;
each call is one call (or, for ``alltoall_v``, three) on a :class:`collsvc.Communicator`, writing into
the caller's ``recv_tensor`` (or ``tensor`` for the ``_inplace`` forms). ``comm=`` takes the handles a
:class:`BaguaProcessGroup` gives (global, intra-node, inter-node); None means the default group's
global communicator.

Left out, and why: CUDA streams (``stream=`` is accepted and ignored: collsvc orders a group's calls
itself and hands results back on the caller's device); ``init_process_group(store=)`` joins collsvc's
job from the launcher's environment and does not initialise ``torch.distributed`` (use
``collsvc.torch`` for that); ``from_torch_group`` needs ``torch.distributed`` initialised. Errors are
collsvc's: ``collsvc.CollsvcError`` and its subclasses, ``ValueError``/``TypeError`` for bad arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import collsvc
from collsvc import Communicator
from collsvc import ReduceOp as _Op
from collsvc.compat.bagua._process_group import BaguaProcessGroup, BaguaSingleCommunicator, ReduceOp, _op

__all__ = [
    "BaguaProcessGroup",
    "BaguaSingleCommunicator",
    "ReduceOp",
    "allgather",
    "allgather_inplace",
    "allreduce",
    "allreduce_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "barrier",
    "broadcast",
    "broadcast_object",
    "from_torch_group",
    "gather",
    "gather_inplace",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
    "send",
]


_default_group: list[BaguaProcessGroup] = []
_group_count = [0]


def init_process_group(store: Any = None) -> None:
    """Joins the job from the launcher's environment (``collsvc run``, mpirun, torchrun ...).

    Raises:
        The errors of :func:`collsvc.init`.
    """
    comm = collsvc.init()
    if not _default_group or _default_group[0]._comm is not comm:
        _default_group[:] = [BaguaProcessGroup(range(comm.size), None, "default", comm)]


def is_initialized() -> bool:
    """Whether :func:`init_process_group` ran."""
    return bool(_default_group) and collsvc.is_initialized()


def _get_default_group() -> BaguaProcessGroup:
    if not is_initialized():
        raise collsvc.CollsvcError("Bagua is not initialized: call init_process_group() first")
    return _default_group[0]


def get_rank() -> int:
    """This process's rank in the job."""
    return collsvc.get_rank()


def get_world_size() -> int:
    """The number of processes in the job."""
    return collsvc.get_world_size()


def get_local_rank() -> int:
    """This process's rank among the job's processes on this host."""
    return collsvc.get_local_rank()


def get_local_size() -> int:
    """The number of the job's processes on this host."""
    return collsvc.default_communicator().local_size


def new_group(ranks: Sequence[int] | None = None, stream: Any = None) -> BaguaProcessGroup:
    """A process group of ``ranks`` (every rank when None); every rank of the job calls it, in order.

    Raises:
        ValueError: duplicate or out-of-range ranks.
    """
    world = _get_default_group()._comm
    assert world is not None
    members = list(range(world.size)) if ranks is None else sorted(int(r) for r in ranks)
    _group_count[0] += 1
    name = f"bagua/{_group_count[0]}"
    return BaguaProcessGroup(members, stream, name, world.new_group(members, name=name))


def from_torch_group(group: Any, stream: Any = None) -> BaguaProcessGroup:
    """The Bagua process group of the ranks of a ``torch.distributed`` process group."""
    import torch.distributed as dist

    return new_group(dist.get_process_group_ranks(group), stream)


def _comm(comm: Any) -> Communicator:
    if comm is None:
        found = _get_default_group()._comm
        assert found is not None
        return found
    if isinstance(comm, BaguaSingleCommunicator):
        return comm.communicator
    if isinstance(comm, Communicator):
        return comm
    raise TypeError(f"comm must be a communicator of a BaguaProcessGroup, got {type(comm).__name__}")


def _flat(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return tensor.view(-1)


def _numel(send: torch.Tensor, recv: torch.Tensor, factor_send: int, factor_recv: int, what: str) -> None:
    if send.numel() * factor_send != recv.numel() * factor_recv:
        raise ValueError(f"{what}: send_tensor has {send.numel()} elements and recv_tensor {recv.numel()}")


def allreduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: Any = ReduceOp.SUM, comm: Any = None) -> None:
    """Reduces ``send_tensor`` over the communicator into every rank's ``recv_tensor``."""
    c = _comm(comm)
    _numel(send_tensor, recv_tensor, 1, 1, "allreduce")
    c.all_reduce(_flat(send_tensor, "send_tensor"), _op(op), out=_flat(recv_tensor, "recv_tensor"))


def allreduce_inplace(tensor: torch.Tensor, op: Any = ReduceOp.SUM, comm: Any = None) -> None:
    """The in-place version of :func:`allreduce`."""
    flat = _flat(tensor, "tensor")
    _comm(comm).all_reduce(flat, _op(op), out=flat)


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Any = None) -> None:
    """Every rank's ``send_tensor``, in rank order, into ``recv_tensor`` (``nranks`` times its size)."""
    c = _comm(comm)
    _numel(send_tensor, recv_tensor, c.size, 1, "allgather")
    c.all_gather(_flat(send_tensor, "send_tensor"), out=_flat(recv_tensor, "recv_tensor"))


def allgather_inplace(tensor: torch.Tensor, comm: Any = None) -> None:
    """The in-place version of :func:`allgather`: rank r's part is chunk r of ``tensor``."""
    c = _comm(comm)
    flat = _flat(tensor, "tensor")
    count = _chunk(flat, c.size, "tensor")
    c.all_gather(flat[c.rank * count : (c.rank + 1) * count].clone(), out=flat)


def _chunk(flat: torch.Tensor, n: int, name: str) -> int:
    if flat.numel() % n:
        raise ValueError(f"{name} has {flat.numel()} elements, not divisible by the {n} ranks")
    return flat.numel() // n


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Any = None) -> None:
    """Chunk j of rank i's ``send_tensor`` lands as chunk i of rank j's ``recv_tensor``."""
    c = _comm(comm)
    _numel(send_tensor, recv_tensor, 1, 1, "alltoall")
    send = _flat(send_tensor, "send_tensor")
    count = _chunk(send, c.size, "send_tensor")
    c.all_to_all(send.view(c.size, count), out=_flat(recv_tensor, "recv_tensor").view(c.size, count))


def alltoall_inplace(tensor: torch.Tensor, comm: Any = None) -> None:
    """The in-place version of :func:`alltoall`."""
    c = _comm(comm)
    flat = _flat(tensor, "tensor")
    blocks = flat.view(c.size, _chunk(flat, c.size, "tensor"))
    c.all_to_all(blocks, out=blocks)


def alltoall_v(
    send_tensor: torch.Tensor,
    send_counts: Sequence[int],
    send_displs: Sequence[int],
    recv_tensor: torch.Tensor,
    recv_counts: Sequence[int],
    recv_displs: Sequence[int],
    comm: Any = None,
) -> None:
    """``send_counts[j]`` elements from ``send_displs[j]`` of ``send_tensor`` go to rank j, which puts
    them at ``recv_displs[i]`` of its ``recv_tensor`` (``recv_counts[i]`` of them).

    Raises:
        ValueError: counts or displacements do not have one entry per rank, or do not fit the tensors.
    """
    c = _comm(comm)
    send, recv = _flat(send_tensor, "send_tensor"), _flat(recv_tensor, "recv_tensor")
    for name, values, tensor in (
        ("send", (send_counts, send_displs), send),
        ("recv", (recv_counts, recv_displs), recv),
    ):
        counts, displs = values
        if len(counts) != c.size or len(displs) != c.size:
            raise ValueError(f"{name}_counts and {name}_displs need one entry per rank ({c.size})")
        if any(n < 0 or d < 0 or d + n > tensor.numel() for n, d in zip(counts, displs, strict=True)):
            raise ValueError(f"{name}_counts/{name}_displs reach outside {name}_tensor ({tensor.numel()} elements)")
    # One all_to_all of equal blocks, each as long as the longest part any rank sends.
    longest = c.all_reduce(torch.tensor([max(send_counts)], dtype=torch.int64), _Op.MAX)
    width = int(longest[0])
    blocks = torch.zeros((c.size, max(width, 1)), dtype=send.dtype, device=send.device)
    for j in range(c.size):
        blocks[j, : send_counts[j]] = send[send_displs[j] : send_displs[j] + send_counts[j]]
    received = c.all_to_all(blocks)
    for i in range(c.size):
        recv[recv_displs[i] : recv_displs[i] + recv_counts[i]] = received[i, : recv_counts[i]]


def reduce_scatter(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: Any = ReduceOp.SUM, comm: Any = None
) -> None:
    """Reduces ``send_tensor`` (``nranks`` times ``recv_tensor``'s size); rank r gets chunk r."""
    c = _comm(comm)
    _numel(send_tensor, recv_tensor, 1, c.size, "reduce_scatter")
    send = _flat(send_tensor, "send_tensor")
    result = c.reduce_scatter(send.view(c.size, -1), _op(op))
    _flat(recv_tensor, "recv_tensor").copy_(result.view(-1))


def reduce_scatter_inplace(tensor: torch.Tensor, op: Any = ReduceOp.SUM, comm: Any = None) -> None:
    """The in-place version of :func:`reduce_scatter`: rank r's result is chunk r of ``tensor``."""
    c = _comm(comm)
    flat = _flat(tensor, "tensor")
    count = _chunk(flat, c.size, "tensor")
    result = c.reduce_scatter(flat.view(c.size, count), _op(op))
    flat[c.rank * count : (c.rank + 1) * count] = result.view(-1)


def broadcast(tensor: torch.Tensor, src: int = 0, comm: Any = None) -> None:
    """Rank ``src``'s ``tensor`` into every rank's ``tensor``."""
    flat = _flat(tensor, "tensor")
    _comm(comm).broadcast(flat, src, out=flat)


def broadcast_object(obj: Any, src: int = 0, comm: Any = None) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (pickled only between authenticated peers)."""
    return _comm(comm).broadcast_object(obj, src)


def gather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, comm: Any = None) -> None:
    """Every rank's ``send_tensor``, in rank order, into rank ``dst``'s ``recv_tensor``."""
    c = _comm(comm)
    send = _flat(send_tensor, "send_tensor")
    if c.rank == dst:
        _numel(send_tensor, recv_tensor, c.size, 1, "gather")
        c.gather(send, dst, out=_flat(recv_tensor, "recv_tensor"))
    else:
        c.gather(send, dst)


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm: Any = None) -> None:
    """The in-place version of :func:`gather`: on ``dst``, ``tensor`` has ``nranks * count`` elements
    and its own part at chunk ``dst``; elsewhere ``count`` elements."""
    c = _comm(comm)
    flat = _flat(tensor, "tensor")
    if c.rank == dst:
        if flat.numel() != c.size * count:
            raise ValueError(f"gather_inplace: tensor on dst has {flat.numel()} elements, expected {c.size * count}")
        c.gather(flat[dst * count : (dst + 1) * count].clone(), dst, out=flat)
    else:
        if flat.numel() != count:
            raise ValueError(f"gather_inplace: tensor has {flat.numel()} elements, expected count={count}")
        c.gather(flat, dst)


def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int, comm: Any = None) -> None:
    """Chunk r of rank ``src``'s ``send_tensor`` into rank r's ``recv_tensor``."""
    c = _comm(comm)
    recv = _flat(recv_tensor, "recv_tensor")
    if c.rank == src:
        _numel(send_tensor, recv_tensor, 1, c.size, "scatter")
        c.scatter(_flat(send_tensor, "send_tensor").view(c.size, -1), src, out=recv.view(1, -1))
    else:
        c.scatter(None, src, out=recv.view(1, -1))


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm: Any = None) -> None:
    """The in-place version of :func:`scatter`: on ``src``, ``tensor`` has ``nranks * count`` elements
    (it keeps chunk ``src``); elsewhere ``count`` elements receive their chunk."""
    c = _comm(comm)
    flat = _flat(tensor, "tensor")
    if c.rank == src:
        if flat.numel() != c.size * count:
            raise ValueError(f"scatter_inplace: tensor on src has {flat.numel()} elements, expected {c.size * count}")
        c.scatter(flat.view(c.size, count).clone(), src, out=flat[src * count : (src + 1) * count].view(1, count))
    else:
        if flat.numel() != count:
            raise ValueError(f"scatter_inplace: tensor has {flat.numel()} elements, expected count={count}")
        c.scatter(None, src, out=flat.view(1, count))


def reduce(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, comm: Any = None
) -> None:
    """Reduces ``send_tensor`` into rank ``dst``'s ``recv_tensor`` (the others' are left as they were)."""
    c = _comm(comm)
    _numel(send_tensor, recv_tensor, 1, 1, "reduce")
    c.reduce(_flat(send_tensor, "send_tensor"), dst, _op(op), out=_flat(recv_tensor, "recv_tensor"))


def reduce_inplace(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, comm: Any = None) -> None:
    """The in-place version of :func:`reduce`."""
    flat = _flat(tensor, "tensor")
    _comm(comm).reduce(flat, dst, _op(op), out=flat)


def send(tensor: torch.Tensor, dst: int, comm: Any = None) -> None:
    """Sends ``tensor`` to rank ``dst``."""
    _comm(comm).send(_flat(tensor, "tensor"), dst)


def recv(tensor: torch.Tensor, src: int, comm: Any = None) -> None:
    """Receives from rank ``src`` into ``tensor``."""
    flat = _flat(tensor, "tensor")
    _comm(comm).recv(src, out=flat)


def barrier(comm: Any = None) -> None:
    """Returns when every rank of the communicator has called it."""
    _comm(comm).barrier()
