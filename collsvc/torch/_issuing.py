"""How the process group's collectives reach the Communicator: inline on the caller's thread, or
asynchronously on the Communicator's executor (:class:`Issuer`, :func:`caller_waits`), and which call
goes straight to it with no collective function in between (:func:`waited_sum_view`)."""

from __future__ import annotations

import sys
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from collsvc.torch._host_arrays import host_array
from collsvc.torch._work import Finished

if TYPE_CHECKING:  # imported by collsvc itself at run time, in its own order
    from collsvc.client.communicator import Communicator
    from collsvc.client.work import Work as CollsvcCall

SUM: Any = dist.ReduceOp.SUM


class Issuer:
    """The Communicator as the collectives of ``_collectives.py`` call it.

    Each call returns the collsvc ``Work`` of its result: issued with ``async_op=True`` (the caller's
    thread goes on at once), or, for a caller known to wait at once, run inline on the caller's
    thread (no hand-off to the Communicator's worker thread) and returned done.

    Args:
        comm: the group's Communicator.
        inline: run calls on the caller's thread.
    """

    def __init__(self, comm: Communicator, inline: bool) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.inline = inline

    def _call(self, method: str, *args: Any, **kwargs: Any) -> CollsvcCall[Any] | Finished:
        fn = getattr(self.comm, method)
        if not self.inline:
            work: CollsvcCall[Any] = fn(*args, async_op=True, **kwargs)  # names who is late if a wait gives up
            return work
        return Finished(fn(*args, **kwargs))

    def all_reduce(self, *args: Any, **kwargs: Any) -> CollsvcCall[Any] | Finished:
        return self._call("all_reduce", *args, **kwargs)

    def reduce(self, *args: Any, **kwargs: Any) -> CollsvcCall[Any] | Finished:
        return self._call("reduce", *args, **kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> CollsvcCall[Any] | Finished:
        return self._call("broadcast", *args, **kwargs)

    def all_gather(self, *args: Any, **kwargs: Any) -> CollsvcCall[Any] | Finished:
        return self._call("all_gather", *args, **kwargs)

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> CollsvcCall[Any] | Finished:
        return self._call("reduce_scatter", *args, **kwargs)

    def gather(self, *args: Any, **kwargs: Any) -> CollsvcCall[Any] | Finished:
        return self._call("gather", *args, **kwargs)

    def scatter(self, *args: Any, **kwargs: Any) -> CollsvcCall[Any] | Finished:
        return self._call("scatter", *args, **kwargs)

    def all_to_all(self, *args: Any, **kwargs: Any) -> CollsvcCall[Any] | Finished:
        return self._call("all_to_all", *args, **kwargs)


_C10D = "torch.distributed.distributed_c10d"


def caller_waits(opts: Any = None, depth: int = 6) -> bool:
    """Whether the torch.distributed function that called into the process group was given
    ``async_op=False``: it waits on the Work as soon as it gets it, so the call may run inline.

    torch's functions say so in the call's options (``opts.asyncOp``, whose default, True, is what
    calls from C++ such as DDP's reducer and functional collectives carry). Without options or on a
    torch whose options lack it, the nearest torch.distributed function's ``async_op`` argument, read
    from its frame (~10x the cost: reading a frame's locals builds them all); none found counts as
    asynchronous.
    """
    asked = getattr(opts, "asyncOp", None)
    if asked is not None:
        return asked is False
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == _C10D:
            return frame.f_locals.get("async_op", True) is False
        frame = frame.f_back
    return False


def waited_sum_view(tensors: list[torch.Tensor], opts: Any) -> np.ndarray | None:
    """The numpy view of the one tensor of an all_reduce with SUM that the caller waits for at once
    (``dist.all_reduce(t)``, whose options say ``asyncOp=False``), where that tensor is a dense CPU
    tensor numpy can view; None for any other call (CUDA in this process, other ops, several tensors,
    options without ``asyncOp``): the general path (``_collectives.all_reduce``) runs those."""
    if (
        opts is None
        or len(tensors) != 1
        or getattr(opts, "asyncOp", True) is not False
        or opts.reduceOp != SUM
        or torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    ):
        return None
    return host_array(tensors[0], held=True)
