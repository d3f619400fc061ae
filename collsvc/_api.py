"""``collsvc.init`` and the module-level functions that act on the default communicator."""

from __future__ import annotations

import threading
from typing import Any

from collsvc.client.communicator import WORLD, Communicator
from collsvc.client.job import connect
from collsvc.config import resolve_init
from collsvc.errors import CollsvcError
from collsvc.types import ReduceOp

_default: Communicator | None = None
_lock = threading.Lock()


def init(
    coordinator: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    backend: str = "auto",
    timeout: float = 300.0,
    token: str | None = None,
    job_id: str | None = None,
) -> Communicator:
    """Joins a job and returns its world communicator (also the process-wide default).

    Arguments left None come from the environment (see ``collsvc.config``).

    Raises:
        ValueError: no coordinator or world size given or found in the environment, or a bad value.
        RendezvousError: world-size disagreement, duplicate rank, full job, device clash, or no
            coordinator within ``timeout``.
        AuthenticationError: missing or wrong token, or TLS refused.
        BackendUnavailableError: ``backend="nccl"`` without CuPy or a GPU.
    """
    global _default
    options = resolve_init(coordinator, world_size, rank, backend, timeout, token, job_id)
    job = connect(options)
    comm = Communicator(job, WORLD, [m.rank for m in job.members])
    with _lock:
        _default = comm
    return comm


def is_initialized() -> bool:
    """Whether ``init`` ran and ``destroy`` has not."""
    return _default is not None


def default_communicator() -> Communicator:
    """The communicator ``init`` made.

    Raises:
        CollsvcError: ``init`` has not been called.
    """
    if _default is None:
        raise CollsvcError("collsvc is not initialized: call collsvc.init() first")
    return _default


def get_rank() -> int:
    """This process's rank in the default communicator."""
    return default_communicator().rank


def get_world_size() -> int:
    """The size of the default communicator."""
    return default_communicator().size


def get_local_rank() -> int:
    """This process's rank among the default communicator's ranks on this host."""
    return default_communicator().local_rank


def destroy() -> None:
    """Closes the default communicator (leaves the job); a later ``init`` may join another job."""
    global _default
    with _lock:
        comm, _default = _default, None
    if comm is not None:
        comm.close()


def all_reduce(x: Any, op: ReduceOp = ReduceOp.SUM, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.all_reduce` on the default communicator."""
    return default_communicator().all_reduce(x, op, out=out, async_op=async_op)


def reduce(x: Any, dst: int, op: ReduceOp = ReduceOp.SUM, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.reduce` on the default communicator."""
    return default_communicator().reduce(x, dst, op, out=out, async_op=async_op)


def broadcast(x: Any, src: int = 0, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.broadcast` on the default communicator."""
    return default_communicator().broadcast(x, src, out=out, async_op=async_op)


def all_gather(x: Any, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.all_gather` on the default communicator."""
    return default_communicator().all_gather(x, out=out, async_op=async_op)


def reduce_scatter(x: Any, op: ReduceOp = ReduceOp.SUM, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.reduce_scatter` on the default communicator."""
    return default_communicator().reduce_scatter(x, op, out=out, async_op=async_op)


def gather(x: Any, dst: int, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.gather` on the default communicator."""
    return default_communicator().gather(x, dst, out=out, async_op=async_op)


def scatter(x: Any, src: int, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.scatter` on the default communicator."""
    return default_communicator().scatter(x, src, out=out, async_op=async_op)


def all_to_all(x: Any, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.all_to_all` on the default communicator."""
    return default_communicator().all_to_all(x, out=out, async_op=async_op)


def send(x: Any, dst: int, tag: int = 0) -> None:
    """:meth:`Communicator.send` on the default communicator."""
    default_communicator().send(x, dst, tag)


def recv(src: int, tag: int = 0, *, out: Any = None, shape: Any = None, dtype: Any = None) -> Any:
    """:meth:`Communicator.recv` on the default communicator."""
    return default_communicator().recv(src, tag, out=out, shape=shape, dtype=dtype)


def barrier(timeout: float | None = None) -> None:
    """:meth:`Communicator.barrier` on the default communicator."""
    default_communicator().barrier(timeout)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """:meth:`Communicator.broadcast_object` on the default communicator."""
    return default_communicator().broadcast_object(obj, src)


def all_gather_object(obj: Any) -> list[Any]:
    """:meth:`Communicator.all_gather_object` on the default communicator."""
    return default_communicator().all_gather_object(obj)


def new_group(ranks: list[int], name: str | None = None) -> Communicator | None:
    """:meth:`Communicator.new_group` on the default communicator."""
    return default_communicator().new_group(ranks, name)


def find_group(name: str) -> list[int]:
    """:meth:`Communicator.find_group` on the default communicator."""
    return default_communicator().find_group(name)
