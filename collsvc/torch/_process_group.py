"""The ``dist.ProcessGroup`` that runs torch.distributed's collectives on a collsvc Communicator.

torch calls these methods from Python (``dist.all_reduce`` and friends) and from C++ (DDP's reducer,
functional collectives, DTensor) through its Python process-group trampoline. Each method validates,
issues the Communicator's calls on detached views of the caller's tensors (in place and zero-copy
through DLPack where the layout allows) and returns a :class:`CollsvcWork`. Calls are asynchronous
(``async_op=True`` on the Communicator), except for a torch function called with ``async_op=False``,
which waits at once anyway: its calls run inline on the caller's thread (unless the group's timeout is
shorter than the job's, which only a Work's ``wait()`` can bound).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

import collsvc.torch._collectives as ops
from collsvc.errors import CollsvcError
from collsvc.torch._errors import missed_monitored_barrier, raise_for_torch, translated
from collsvc.torch._issuing import Issuer, caller_waits, waited_sum_view
from collsvc.torch._p2p import PointToPoint
from collsvc.torch._streams import current, run_on_caller_stream
from collsvc.torch._work import AnySourceWork, CollsvcWork, CompletedWork, Finished, Finisher

if TYPE_CHECKING:  # imported by collsvc itself at run time, in its own order
    from collsvc.client.communicator import Communicator

BACKEND_NAME = "collsvc"

F = TypeVar("F", bound=Callable[..., Any])


def _collective(fn: F) -> F:
    """Decorates a collective method: it runs on the caller's CUDA stream (``run_on_caller_stream``) and
    raises collsvc errors as torch-facing ones (``translated``), one wrapper for both."""
    return translated(fn, run_on_caller_stream)


# torch's stubs declare each method with overloads that its Python trampoline never calls; subclassing
# through Any keeps our signatures (the ones the trampoline does call) free of them.
_ProcessGroup: Any = dist.ProcessGroup


class ProcessGroupCollsvc(_ProcessGroup):  # type: ignore[misc]
    """torch.distributed's process-group interface over one collsvc Communicator.

    Args:
        comm: the Communicator of this group's members (rank order = torch group rank order).
        timeout: seconds any one collective of this group may take (from ``init_process_group`` or
            ``new_group``).
        on_shutdown: called once when torch shuts the group down (leaves the job for the world group).
    """

    def __init__(self, comm: Communicator, timeout: float, on_shutdown: Any = None) -> None:
        super().__init__(comm.rank, comm.size)
        self._comm = comm
        self._timeout = timeout
        # The Communicator bounds every call by the job's timeout; a group with a shorter one is
        # bounded where torch waits.
        job_timeout = comm.job.timeout
        self._wait_limit = timeout if timeout < job_timeout else None
        self._p2p = PointToPoint(comm)
        self._async_issuer = Issuer(comm, inline=False)
        # A call run inline is bounded by the job's timeout only: with a shorter one of its own, the
        # group issues every call asynchronously, and its Work's wait() bounds it.
        self._inline_issuer = Issuer(comm, inline=True) if self._wait_limit is None else self._async_issuer
        self._on_shutdown = on_shutdown
        self._shut = False
        self._group_name = comm.name
        self._group_desc = comm.name
        self._where = f" in group '{comm.name}' (rank {comm.rank} of {comm.size})"  # for errors
        self._allreduce_what = "allreduce" + self._where

    @property
    def communicator(self) -> Communicator:
        """The collsvc Communicator behind this group (its own API works alongside torch's)."""
        return self._comm

    def __repr__(self) -> str:
        return f"ProcessGroupCollsvc(rank={self._comm.rank}, size={self._comm.size}, group={self._comm.name!r})"

    def getBackendName(self) -> str:  # noqa: N802 - the name torch's trampoline looks up
        return BACKEND_NAME

    # torch keeps a Python group's name and description only where the group stores them itself.
    def getGroupName(self) -> str:  # noqa: N802 - the name torch's trampoline looks up
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def _ops(self, opts: Any = None) -> Issuer:
        """The issuer of a call with torch's options ``opts``: inline where the caller waits at once."""
        return self._inline_issuer if caller_waits(opts) else self._async_issuer

    def _work(self, calls: Sequence[Any], outputs: list[torch.Tensor], finish: Finisher | None, what: str) -> Any:
        stream = current()
        if finish is None and stream is None and len(calls) == 1 and type(calls[0]) is Finished:
            return CompletedWork(outputs, what + self._where)  # a synchronous call on CPU tensors
        return CollsvcWork(calls, outputs, finish, what + self._where, self._wait_limit, stream)

    # ---- reductions ------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        # The most frequent call of all, dist.all_reduce(t) of one CPU tensor with SUM, goes straight to
        # the Communicator with the tensor's kept numpy view; every other call (other ops, several or
        # CUDA tensors, async_op=True, C++ callers) takes the general path.
        view = waited_sum_view(tensors, opts) if self._wait_limit is None else None
        if view is None:
            return self._allreduce(tensors, opts)
        try:
            self._comm.all_reduce(view, out=view)
        except CollsvcError as exc:
            raise_for_torch(exc)
        return CompletedWork(tensors, self._allreduce_what)

    @_collective
    def _allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = (opts or dist.AllreduceOptions()).reduceOp
        return self._work(*ops.all_reduce(self._ops(opts), tensors, op), "allreduce")

    @_collective
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = (opts or dist.AllreduceCoalescedOptions()).reduceOp
        return self._work(*ops.all_reduce(self._ops(opts), tensors, op), "allreduce_coalesced")

    @_collective
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.ReduceOptions()
        return self._work(*ops.reduce(self._ops(opts), ops.single(tensors), opts.rootRank, opts.reduceOp), "reduce")

    @_collective
    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        parts = ops.reduce_scatter_list(self._ops(opts), ops.single(outputs), inputs[0], op)
        return self._work(*parts, "reduce_scatter")

    @_collective
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        return self._work(*ops.reduce_scatter(self._ops(opts), output, input, op), "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    @_collective
    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        op = (opts or dist.ReduceScatterOptions()).reduceOp
        parts = [ops.reduce_scatter(self._ops(opts), o, i, op) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(*ops.merge(parts), "reduce_scatter_tensor_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- broadcast and gathers -------------------------------------------------------------------
    @_collective
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.BroadcastOptions()
        return self._work(*ops.broadcast(self._ops(opts), tensors, opts.rootRank), "broadcast")

    @_collective
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._work(*ops.all_gather_list(self._ops(opts), ops.single(outputs), ops.single(inputs)), "allgather")

    @_collective
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self._work(*ops.all_gather(self._ops(opts), output, input), "all_gather_into_tensor")

    _allgather_base = all_gather_single

    @_collective
    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        # outputs[r][j] receives rank r's inputs[j].
        if len(outputs) != self._comm.size or any(len(per_rank) != len(inputs) for per_rank in outputs):
            raise ValueError(
                f"all_gather_coalesced: needs {self._comm.size} output lists of {len(inputs)} tensors each"
            )
        issuer = self._ops(opts)
        parts = [ops.all_gather_list(issuer, [per_rank[j] for per_rank in outputs], t) for j, t in enumerate(inputs)]
        return self._work(*ops.merge(parts), "allgather_coalesced")

    @_collective
    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        parts = [ops.all_gather(self._ops(opts), o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(*ops.merge(parts), "all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_collective
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        root = (opts or dist.GatherOptions()).rootRank
        listed = outputs[0] if outputs else []
        return self._work(*ops.gather(self._ops(opts), listed, ops.single(inputs), root), "gather")

    @_collective
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        root = (opts or dist.ScatterOptions()).rootRank
        listed = inputs[0] if inputs else []
        return self._work(*ops.scatter(self._ops(opts), ops.single(outputs), listed, root), "scatter")

    # ---- all to all ------------------------------------------------------------------------------
    @_collective
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        parts = ops.all_to_all_single(self._ops(opts), output, input, output_split_sizes, input_split_sizes)
        return self._work(*parts, "all_to_all_single")

    alltoall_base = all_to_all_single

    @_collective
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self._work(*ops.all_to_all_list(self._ops(opts), outputs, inputs), "alltoall")

    # ---- point to point --------------------------------------------------------------------------
    @_collective
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        tensor = ops.single(tensors)
        return self._work([self._p2p.send(tensor, dst, tag)], [tensor], None, f"send to {dst} (tag {tag})")

    @_collective
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        tensor = ops.single(tensors)
        return self._work([self._p2p.recv(tensor, src, tag)], [tensor], None, f"recv from {src} (tag {tag})")

    @_collective
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        tensor = ops.single(tensors)
        description = f"recv from any rank (tag {tag}) in group '{self._comm.name}' (rank {self._comm.rank})"
        return AnySourceWork(self._p2p.recv_any(tensor, tag), tensor, description, self._wait_limit, current())

    # ---- barriers --------------------------------------------------------------------------------
    @translated
    def barrier(self, opts: Any = None) -> Any:
        self._comm.barrier(self._timeout)
        return CompletedWork([], "barrier")

    @translated
    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive within ``timeout`` (a timedelta or seconds;
        None: the group's timeout). ``dist.monitored_barrier`` lands here for collsvc groups
        (``_monitored_barrier.py``). Every rank that arrives names every missing one; the message starts
        as gloo's does ("Rank 2 failed to pass monitoredBarrier in 1000 ms").

        Raises:
            ValueError: ``timeout`` is not above zero.
            CollectiveTimeoutError: some ranks did not arrive in time (``waiting_on`` names them).
            RankFailedError: a rank failed or left instead (``ranks`` names it).
            Every one of them also a ``DistBackendError``.
        """
        if timeout is None:
            seconds = self._timeout
        else:
            seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
            if not seconds > 0:
                raise ValueError(f"monitored_barrier: timeout must be above zero, got {timeout!r}")
        try:
            self._comm.barrier(seconds)
        except CollsvcError as exc:
            raise missed_monitored_barrier(exc, round(seconds * 1000), wait_all_ranks) from exc

    # ---- lifecycle -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Closes the group; for the world group, leaves the collsvc job (and stops its coordinator)."""
        if self._shut:
            return
        self._shut = True
        self._p2p.close()
        if self._on_shutdown is not None:
            self._on_shutdown()
        else:
            self._comm.close()

    def abort(self) -> None:
        """Aborts the job: every rank's pending and later collectives fail with ``AbortedError``."""
        self._comm.abort(f"process group '{self._comm.name}' aborted through torch.distributed")
        self.shutdown()
