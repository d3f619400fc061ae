"""The Communicator: the public collective API over one group of a job.

Arguments are validated here once, before anything is sent; each call gets the next sequence number
of its group and runs on its group's ordered executor. The array plumbing of each collective lives in
``ops.py``; object collectives in ``objects.py``; gradient bucketing in ``bucketing.py``; sub-communicators
in ``subgroups.py``.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from collections.abc import Sequence
from typing import Any, TypeVar

from collsvc.arrays import adapt
from collsvc.client import any_source, bucketing, objects, ops
from collsvc.client.backends.base import Backend, Call, GroupSpec
from collsvc.client.devices import caller_gpu_context
from collsvc.client.fast_path import BARRIER, NOT_RUN, RepeatedCalls
from collsvc.client.gpu_sync import GpuSync
from collsvc.client.job import Job
from collsvc.client.job_handle import JobHandle
from collsvc.client.numbering import StreamNumbers
from collsvc.client.placement import placement_of
from collsvc.client.subgroups import Subgroups
from collsvc.errors import AbortedError, CollsvcError
from collsvc.proto.v1 import coordinator_pb2
from collsvc.types import ReduceOp

T = TypeVar("T")
WORLD = "world"


class Communicator(GpuSync, Subgroups):
    """A group of ranks that run collectives together.

    Attributes:
        rank: this process's rank in the group. size: members in the group.
        local_rank / local_size: position among, and count of, the group's members on this host.
        node_rank / num_nodes: index of this host among the group's hosts, and their count.
        name: the group's name ("world" for the job). backend: "ring" or "nccl".
    """

    def __init__(self, job: Job, name: str, global_ranks: Sequence[int]) -> None:
        self._job = job
        self._calls = job.calls
        self._coordinator = job.coordinator
        self._options = job.options
        self._ranks = tuple(global_ranks)
        self._members = frozenset(self._ranks)
        self.name = name
        self.rank = self._ranks.index(job.rank)
        self.size = len(self._ranks)
        self.backend = job.backend_name
        placed = placement_of([job.hosts[r] for r in self._ranks], self.rank)
        self.local_rank, self.local_size = placed.local_rank, placed.local_size
        self.node_rank, self.num_nodes = placed.node_rank, placed.num_nodes
        self._spec = GroupSpec(name, self._ranks, self.rank)
        self._lock = threading.Lock()
        self._numbers = StreamNumbers()
        self._barrier_numbers = itertools.count(1)
        self._groups = 0
        self._closed = False
        self._intra = None
        self._executor = self._calls.executor_of(name)  # calls of this group run in issue order there
        gpu = job.backend_for(True) if job.backend_name == "nccl" else None
        number = self._numbers.of(name)
        self._repeated = RepeatedCalls(self._calls, job.backend_for(False), gpu, self._spec, self._check_usable, number)
        self._inter = None

    def __repr__(self) -> str:
        return f"Communicator(name={self.name!r}, rank={self.rank}, size={self.size}, backend={self.backend!r})"

    @functools.cached_property
    def _view(self) -> ops.GroupView:
        # The job's backends are fixed once it is connected, before any communicator exists.
        return ops.GroupView(self.name, self.rank, self.size, self._ranks, self.backend == "nccl")

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """The job-wide ranks of this group's members, in group order."""
        return self._ranks

    @property
    def job(self) -> JobHandle:
        """The job this communicator belongs to: its options, first failure, departed members and
        key/value store (for libraries built on collsvc, such as its torch backend)."""
        return self._job.handle

    @property
    def closed(self) -> bool:
        """Whether this communicator (or the job under it) was closed."""
        return self._closed or self._calls.closed

    # ---- infrastructure -------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed or self._calls.closed:  # self.closed, without a property call per collective
            raise CollsvcError(f"communicator '{self.name}' is closed")
        self._calls.check_usable(self._members)

    def _issue(self, planned: ops.Planned, *, async_op: bool = False, timeout: float | None = None) -> Any:
        """Numbers a planned call and runs its body in issue order; maps failures for every rank.

        Returns:
            The body's result, or a :class:`Work` for it with ``async_op``.
        """
        self._check_usable()
        signature, body = planned.signature, planned.body
        stream = planned.stream or self.name
        seq = self._numbers.next(stream)
        backend = self._job.backend_for(planned.on_gpu)
        group = planned.spec or self._spec
        # CuPy arrays (on either backend) may run on the worker thread: take the caller's device and stream.
        gpu_context = caller_gpu_context() if "cupy" in sys.modules else None
        calls = self._calls

        def execute() -> Any:
            return calls.execute(group, stream, seq, signature, timeout, body, backend, gpu_context)

        if async_op:
            return self._async_work(execute, group, stream, seq, signature, backend)
        return self._executor.run(execute)

    def _learned(self, kind: str, x: Any, arg: Any, out: Any, async_op: bool, planned: ops.Planned) -> Any:
        """Issues ``planned``, a call the fast path for repeated calls (``client/fast_path.py``) did not
        run, and teaches that path such calls."""
        result = self._issue(planned, async_op=async_op)
        self._repeated.learn(kind, x, arg, out, async_op, planned.signature)
        return result

    def _group_rank(self, rank: int, what: str) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{what} must be an int rank, got {rank!r}")
        if not 0 <= rank < self.size:
            raise ValueError(f"{what}={rank} is outside this communicator's ranks [0, {self.size})")
        return rank

    # ---- collectives ------------------------------------------------------------------------------
    def all_reduce(
        self,
        x: Any,
        op: ReduceOp = ReduceOp.SUM,
        *,
        out: Any = None,
        async_op: bool = False,
        compression: str | None = None,
    ) -> Any:
        """Every rank gets the elementwise reduction of every rank's ``x``.

        Args:
            x: an array, or a list of arrays of one dtype (one fused transfer, returns a list).
            op: the reduction. out: where to write the result (``out is x``: in place).
            async_op: return a :class:`Work` instead of the result.
            compression: None (exact), or "bf16", "fp16" or "minmax_uint8": the frames that cross hosts
                travel in fewer bits, within the error docs/api.md states; every rank gets the same bits.
                On one host the result is exact. Every rank must pass the same value.

        Raises:
            TypeError: unsupported array kind or dtype, an op/dtype pair API.md forbids, or a
                compression of a non-float array.
            ValueError: ``out`` has the wrong shape; an unknown compression, one with an op other than
                SUM or AVG, or one of GPU arrays on the NCCL backend.
            CollectiveMismatchError / CollectiveTimeoutError / RankFailedError / AbortedError: see API.md.
        """
        if compression is not None:  # never the fast path, which knows exact calls only
            return self._issue(ops.all_reduce(self._view, x, op, out=out, compression=compression), async_op=async_op)
        result = self._repeated.run("all_reduce", x, op, out, async_op)
        if result is NOT_RUN:
            result = self._learned("all_reduce", x, op, out, async_op, ops.all_reduce(self._view, x, op, out=out))
        return result

    def reduce(self, x: Any, dst: int, op: ReduceOp = ReduceOp.SUM, *, out: Any = None, async_op: bool = False) -> Any:
        """Only ``dst`` gets the reduction; other ranks get None (their ``out`` untouched).

        Raises:
            TypeError / ValueError: as all_reduce, or ``dst`` is not a rank of this communicator.
        """
        planned = ops.reduce(self._view, x, self._group_rank(dst, "dst"), op, out=out)
        return self._issue(planned, async_op=async_op)

    def broadcast(self, x: Any, src: int = 0, *, out: Any = None, async_op: bool = False) -> Any:
        """Every rank gets ``src``'s array (``x`` gives the shape and dtype on every rank).

        Raises:
            TypeError / ValueError: unsupported array, wrong ``out``, or ``src`` out of range.
        """
        root = self._group_rank(src, "src")
        result = self._repeated.run("broadcast", x, root, out, async_op)
        if result is NOT_RUN:
            result = self._learned("broadcast", x, root, out, async_op, ops.broadcast(self._view, x, root, out=out))
        return result

    def all_gather(self, x: Any, *, out: Any = None, async_op: bool = False) -> Any:
        """Every rank's ``x`` concatenated along axis 0 in rank order (0-d arrays count as shape (1,)).

        Raises:
            TypeError / ValueError: unsupported array, or ``out`` of the wrong shape.
        """
        result = self._repeated.run("all_gather", x, None, out, async_op)
        if result is NOT_RUN:
            result = self._learned("all_gather", x, None, out, async_op, ops.all_gather(self._view, x, out=out))
        return result

    def reduce_scatter(
        self,
        x: Any,
        op: ReduceOp = ReduceOp.SUM,
        *,
        out: Any = None,
        async_op: bool = False,
        compression: str | None = None,
    ) -> Any:
        """Rank r gets block r (along axis 0) of the reduction (``compression``: as all_reduce's).

        Raises:
            ValueError: ``x.shape[0]`` is not divisible by the size, or ``out`` has the wrong shape.
            TypeError / ValueError: a compression all_reduce would refuse.
        """
        if compression is not None:
            planned = ops.reduce_scatter(self._view, x, op, out=out, compression=compression)
            return self._issue(planned, async_op=async_op)
        result = self._repeated.run("reduce_scatter", x, op, out, async_op)
        if result is NOT_RUN:
            planned = ops.reduce_scatter(self._view, x, op, out=out)
            result = self._learned("reduce_scatter", x, op, out, async_op, planned)
        return result

    def gather(self, x: Any, dst: int, *, out: Any = None, async_op: bool = False) -> Any:
        """Like all_gather, with the result on ``dst`` only (None elsewhere)."""
        planned = ops.gather(self._view, x, self._group_rank(dst, "dst"), out=out)
        return self._issue(planned, async_op=async_op)

    def scatter(self, x: Any, src: int, *, out: Any = None, async_op: bool = False) -> Any:
        """Rank r gets block r of ``src``'s ``x``. Other ranks may pass ``x=None`` with ``out=``.

        Raises:
            ValueError: ``x.shape[0]`` on ``src`` not divisible by the size; neither ``x`` nor ``out``.
        """
        planned = ops.scatter(self._view, x, self._group_rank(src, "src"), out=out)
        return self._issue(planned, async_op=async_op)

    def all_to_all(self, x: Any, *, out: Any = None, async_op: bool = False) -> Any:
        """Block j of rank i's ``x`` lands as block i of rank j's result.

        Raises:
            ValueError: ``x.shape[0]`` not divisible by the size.
        """
        result = self._repeated.run("all_to_all", x, None, out, async_op)
        if result is NOT_RUN:
            result = self._learned("all_to_all", x, None, out, async_op, ops.all_to_all(self._view, x, out=out))
        return result

    def send(self, x: Any, dst: int, tag: int = 0) -> None:
        """Sends ``x`` to ``dst``; returns once it was delivered to ``dst``'s endpoint.

        Raises:
            ValueError: ``dst`` is this rank or out of range.
        """
        self._issue(ops.send(self._view, x, self._group_rank(dst, "dst"), tag))

    def recv(self, src: int, tag: int = 0, *, out: Any = None, shape: Any = None, dtype: Any = None) -> Any:
        """Receives the next array ``src`` sent with ``tag`` (shape and dtype from ``out`` or the arguments).

        Raises:
            ValueError: ``src`` is this rank or out of range; neither ``out`` nor ``shape`` and ``dtype``.
            CollectiveMismatchError: the sender's array has another shape or dtype.
        """
        planned = ops.recv(self._view, self._group_rank(src, "src"), tag, out=out, shape=shape, dtype=dtype)
        return self._issue(planned)

    def recv_any(
        self, tag: int = 0, *, out: Any = None, shape: Any = None, dtype: Any = None, timeout: float | None = None
    ) -> tuple[int, Any]:
        """Receives the next array any rank sent with ``tag``; returns ``(source rank, array)``.

        Messages from one source keep their order. Not for GPU arrays that go through NCCL.

        Raises:
            ValueError: bad tag or arguments (as :meth:`recv`), a GPU ``out`` on the NCCL backend.
            CollectiveTimeoutError: no message within ``timeout`` (default: the communicator's).
        """
        if out is not None and self._view.gpu_backend and adapt(out, name="out").on_gpu:
            raise ValueError("recv_any cannot receive into a GPU array on the NCCL backend (NCCL needs a source)")
        self._check_usable()
        limit = self._options.timeout if timeout is None else timeout
        source = any_source.first_sender(self._view, self._job.mailbox, self._numbers.peek, tag, limit)
        return source, self.recv(source, tag, out=out, shape=shape, dtype=dtype)

    def barrier(self, timeout: float | None = None) -> None:
        """Returns when every rank of this communicator entered the barrier.

        Raises:
            CollectiveTimeoutError: ``timeout`` (default: the communicator's) passed; names who is missing.
            RankFailedError / AbortedError: a member failed or the job was aborted.
        """
        wait = self._options.timeout if timeout is None else float(timeout)
        if not wait > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        generation = next(self._barrier_numbers)  # the coordinator's barrier generation (no lock: see numbering.py)
        if self._repeated.barrier(wait):
            return

        def body(call: Call, backend: Backend) -> None:
            # In the data plane where the group allows (shared memory on one host: microseconds;
            # over several hosts, empty frames among the hosts' leaders; a rank that called another
            # collective instead is named as a mismatch); else through the coordinator. Who never
            # arrived is named either way (the call runner asks the coordinator after a data-plane timeout).
            if not backend.barrier(call):
                self._coordinator.barrier(self.name, self._job.rank, generation, wait)

        self._issue(ops.Planned(BARRIER, body, on_gpu=False), timeout=wait)
        self._repeated.learn_barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s picklable object on every rank (unpickled only from authenticated peers).

        Raises:
            AuthenticationError: the job has neither token nor TLS (set COLLSVC_TOKEN, or
                COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE=1 to accept the risk).
            CollsvcError: ``src`` could not pickle its object (names it and pickle's error; ``src``
                itself raises pickle's error); the group stays usable.
        """
        return objects.broadcast_object(self, obj, self._group_rank(src, "src"), allowed=self._pickle_allowed())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order (same authentication rule and errors as
        broadcast_object: a rank that cannot pickle its object is named to the others)."""
        return objects.all_gather_object(self, obj, allowed=self._pickle_allowed())

    def _pickle_allowed(self) -> bool:
        """Whether peers are authenticated (token or TLS) or the user accepted unpickling without it."""
        options = self._options
        return bool(options.token or options.tls is not None or options.allow_pickle)

    def all_reduce_callback(
        self, arrays: Sequence[Any], pack_size: int, op: ReduceOp = ReduceOp.AVG
    ) -> bucketing.GradientBucketer:
        """A callable to call with each array as it becomes ready; reduces buckets of ``pack_size`` bytes
        in place as they fill. ``wait()`` on it reduces the rest and waits for everything.

        Raises:
            ValueError: ``pack_size`` < 1 or no arrays. TypeError: as all_reduce.
        """
        return bucketing.GradientBucketer(self, list(arrays), pack_size, op)

    # ---- lifecycle --------------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Fails every rank's pending and future collectives with AbortedError(reason)."""
        self._coordinator.report(coordinator_pb2.EVENT_KIND_JOB_ABORTED, reason)
        self._calls.fail(AbortedError(f"job aborted by rank {self._job.rank}: {reason}", reason))

    def close(self) -> None:
        """Leaves cleanly. Closing the world communicator leaves the job; a sub-communicator just closes."""
        self._closed = True
        self._repeated.close()
        if self.name == WORLD:
            self._job.close()
