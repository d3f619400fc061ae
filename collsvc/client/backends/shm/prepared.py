"""Calls of a :class:`~collsvc.client.backends.shm.group.LocalGroup` worked out once and run many times:
what the Communicator's fast path for repeated calls (``client/fast_path.py``) runs.

A prepared call takes exactly the steps, descriptor and reduction order of the same call made through
the group's general method, so peers may take either for the same call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from collsvc.client.backends.reduction import finish_average, fold, native_ufunc, quiet_fold, reduce_parts
from collsvc.client.backends.shm.descriptor import encode as encode_call
from collsvc.client.backends.shm.steps import CallDescription, StepEngine
from collsvc.types import ReduceOp, check_op_dtype

# Below this many bytes all_reduce/reduce take one barrier and every rank reduces everything itself.
DIRECT_BYTES = 64 * 1024
# A broadcast above this many bytes goes in BROADCAST_PIECES steps (or more, of one slot each), so that
# the root copies piece k + 1 in while the others copy piece k out; in one step they would take turns.
PIPELINED_BROADCAST_BYTES = 256 * 1024
BROADCAST_PIECES = 4


class SmallAllReduce(NamedTuple):
    """One all_reduce shape of a :class:`LocalGroup`, prepared for :meth:`LocalGroup.run_all_reduce`.

    ``body``: the call's descriptor; ``own_inputs``: this rank's input slot of each parity, cut to the
    call's length; ``parts``: every rank's, per parity; ``quiet``: reduce with floating-point warnings
    off; ``average``: divide by the group size after the sum.
    """

    body: bytes
    descriptions: CallDescription
    own_inputs: tuple[np.ndarray, np.ndarray]
    parts: tuple[list[np.ndarray], list[np.ndarray]]
    ufunc: Any
    quiet: bool
    average: bool


class SmallBroadcast(NamedTuple):
    """One broadcast shape and root of a :class:`LocalGroup`, prepared for :meth:`LocalGroup.run_broadcast`
    (``root_slots``: the root's input slot of each parity, cut and shaped to the call)."""

    body: bytes
    descriptions: CallDescription
    root_slots: tuple[np.ndarray, np.ndarray]
    is_root: bool


class SmallAllGather(NamedTuple):
    """One all_gather length of a :class:`LocalGroup`, prepared for :meth:`LocalGroup.run_all_gather`
    (``own_slots``: this rank's input slot of each parity, ``peer_slots``: (rank, slot) of every other
    rank per parity, all cut to the call's length; ``rank``: this rank's local rank)."""

    body: bytes
    descriptions: CallDescription
    own_slots: tuple[np.ndarray, np.ndarray]
    peer_slots: tuple[list[tuple[int, np.ndarray]], ...]
    rank: int


class SmallReduceScatter(NamedTuple):
    """One reduce_scatter length and op of a :class:`LocalGroup`, prepared for
    :meth:`LocalGroup.run_reduce_scatter`: ``own_slots``, per parity, (rank, the part of this rank's
    input slot that carries that rank's block) for every other rank; ``peer_blocks``, per parity and
    rank, the part of that rank's slot that carries this rank's block (None for this rank itself)."""

    body: bytes
    descriptions: CallDescription
    op: ReduceOp
    own_slots: tuple[list[tuple[int, np.ndarray]], ...]
    peer_blocks: tuple[list[np.ndarray | None], ...]
    rank: int


class SmallBarrier(NamedTuple):
    """A barrier of a :class:`LocalGroup`, prepared for :meth:`LocalGroup.run_barrier`."""

    body: bytes
    descriptions: CallDescription


class ChunkedCall(NamedTuple):
    """Calls too large for one step, which the group's own (pipelined) methods run: ``arg``, the op the
    data is combined with (AVG as SUM) or the root; ``digest``, the caller's signature digest."""

    arg: Any
    digest: int


class PreparedCalls(StepEngine):
    """The prepared calls of a local group (see the module docstring)."""

    def _broadcast_piece(self, dtype: np.dtype, count: int) -> int:
        """Elements per step of a broadcast of ``count`` elements of ``dtype``: the same on every rank (a
        function of the call and the slot size, which ranks agree on when they connect)."""
        chunk = self._chunk(dtype)
        if count * dtype.itemsize <= PIPELINED_BROADCAST_BYTES:
            return chunk
        return min(chunk, -(-count // BROADCAST_PIECES))

    def _direct(self, nbytes: int) -> bool:
        """Whether a call of ``nbytes`` goes in one step where every rank handles all the data itself:
        all_reduce and reduce do below this (``LocalGroup._reduce``), and the one-step plans of
        all_reduce and all_gather cover the same sizes."""
        return nbytes <= min(DIRECT_BYTES, self._layout.slot_bytes)

    def _has_plan(self, collective: str, dtype: np.dtype, count: int) -> bool:
        """Whether ``collective`` calls of ``count`` elements of ``dtype`` (per block, as for
        :meth:`prepare_chunked`) get a one-step plan from the ``prepare_*`` methods; the others (every
        all_to_all) run the group's own method (:meth:`prepare_chunked`)."""
        if collective == "broadcast":
            return count <= self._broadcast_piece(dtype, count)
        if collective == "reduce_scatter":
            n = self._size
            return count <= self._chunk(dtype) // n and n * count * dtype.itemsize <= DIRECT_BYTES
        if collective == "all_to_all":
            return False
        return self._direct(count * dtype.itemsize)  # all_reduce, all_gather

    def _begin(self) -> int:
        """Starts a prepared call: raises if the group failed or closed (as :meth:`_solo`, inline: this
        runs on every repeated call); returns its step's parity."""
        if self._error is not None or self._closed:
            self._solo()
        if self._watch is not None:
            self._watch()
        return (self._generation + 1) % 2

    # -- repeated barrier ----------------------------------------------------------------------------

    def prepare_barrier(self, digest: int) -> SmallBarrier | None:
        """What :meth:`run_barrier` needs, worked out once; None for a group of one (nothing to wait for).

        Raises:
            CollsvcError: the group failed or is closed.
        """
        if self._solo():
            return None
        empty = np.dtype(np.uint8)  # the general barrier's descriptor: no data
        return SmallBarrier(encode_call("barrier", empty, 0, None, None, digest), ("barrier", empty, 0, None, None))

    def run_barrier(self, plan: SmallBarrier, deadline: float) -> None:
        """:meth:`~collsvc.client.backends.shm.group.LocalGroup.barrier` as ``plan`` prepared it: the same
        step and descriptor, so peers may run either method for the same barrier.

        Raises:
            CollectiveMismatchError / CollectiveTimeoutError / the error given to :meth:`fail`.
        """
        self._begin()
        self._descriptions = plan.descriptions
        self._step(deadline, plan.body)

    # -- repeated calls larger than one step ---------------------------------------------------------

    def prepare_chunked(
        self, collective: str, dtype: np.dtype, count: int, arg: Any, digest: int
    ) -> ChunkedCall | None:
        """What the fast path needs to run ``collective`` calls (all_reduce, broadcast, all_gather,
        reduce_scatter or all_to_all) of ``count`` elements of ``dtype`` (per rank's block: all_gather's
        input, reduce_scatter's output, one block of all_to_all's) with ``arg`` (op or root) through the
        group's own method, for calls that take more than the one step of the ``prepare_*`` plans (every
        all_to_all: it has no such plan); None for calls that fit one step, a group of one, or a
        reduction numpy has no loop for (bfloat16: the general path).

        Raises:
            TypeError: ``op`` is not defined for ``dtype``. ValueError: a bad root.
            CollsvcError: the group failed or is closed.
        """
        if collective == "broadcast":
            self._check_root(arg)
        elif collective in ("all_reduce", "reduce_scatter"):
            check_op_dtype(arg, dtype)
            if native_ufunc(arg, dtype) is None:
                return None
        if self._solo() or count <= 0 or self._has_plan(collective, dtype, count):
            return None
        return ChunkedCall(arg, digest)

    # -- repeated small all_reduce -------------------------------------------------------------------

    def prepare_all_reduce(
        self, dtype: np.dtype, count: int, op: ReduceOp, digest: int, shape: tuple[int, ...] | None = None
    ) -> SmallAllReduce | None:
        """What :meth:`run_all_reduce` needs for all_reduce calls of ``count`` elements of ``dtype``
        (arrays of ``shape``, default flat), worked out once; None where such a call does not take the
        one-barrier path (too large, a group of one, a dtype numpy has no loop for) and must go through
        :meth:`all_reduce`.

        Raises:
            TypeError: ``op`` is not defined for ``dtype``.
            CollsvcError: the group failed or is closed.
        """
        check_op_dtype(op, dtype)
        ufunc = native_ufunc(op, dtype)
        if self._solo() or ufunc is None or count <= 0 or not self._has_plan("all_reduce", dtype, count):
            return None
        views = self._all_views(dtype)
        inputs = [
            [v.inputs[parity][:count].reshape((count,) if shape is None else shape) for v in views] for parity in (0, 1)
        ]
        return SmallAllReduce(
            body=encode_call("all_reduce", dtype, count, op, None, digest),
            descriptions=("all_reduce", dtype, count, op, None),
            own_inputs=(inputs[0][self._rank], inputs[1][self._rank]),
            parts=(inputs[0], inputs[1]),
            ufunc=ufunc,
            # Integer and boolean loops never warn; floating-point overflow to inf and inf - inf = nan are
            # results, not warnings (as in _combine).
            quiet=dtype.kind not in "biu",
            average=op is ReduceOp.AVG,
        )

    def run_all_reduce(self, plan: SmallAllReduce, src: np.ndarray, dst: np.ndarray, deadline: float) -> None:
        """:meth:`all_reduce` of ``src`` into ``dst`` (contiguous, of ``plan``'s dtype and shape; ``dst``
        may be ``src``), as ``plan`` prepared it: the same descriptor, barrier and reduction order, so
        peers may run either method for the same call.

        Raises:
            CollectiveMismatchError / CollectiveTimeoutError / the error given to :meth:`fail`.
        """
        parity = self._begin()
        plan.own_inputs[parity][...] = src
        self._descriptions = plan.descriptions
        self._step(deadline, plan.body)
        parts = plan.parts[parity]
        # Into our slot of the other parity first, as _reduce does (same alignment on every rank).
        scratch = plan.own_inputs[1 - parity]
        if plan.quiet:
            quiet_fold(plan.ufunc, scratch, parts)
        else:
            fold(plan.ufunc, scratch, parts)
        if plan.average:
            finish_average(scratch, self._size)
        dst[...] = scratch

    def prepare_broadcast(
        self, dtype: np.dtype, count: int, root: int, digest: int, shape: tuple[int, ...] | None = None
    ) -> SmallBroadcast | None:
        """What :meth:`run_broadcast` needs for broadcasts from ``root`` of ``count`` elements of
        ``dtype`` (arrays of ``shape``, default flat), worked out once; None where such a call takes
        more than one step or there are no peers (then :meth:`broadcast` runs it).

        Raises:
            ValueError: a bad root. CollsvcError: the group failed or is closed.
        """
        self._check_root(root)
        if self._solo() or count <= 0 or not self._has_plan("broadcast", dtype, count):
            return None
        views = self._all_views(dtype)
        slots = tuple(
            views[root].inputs[parity][:count].reshape((count,) if shape is None else shape) for parity in (0, 1)
        )
        return SmallBroadcast(
            body=encode_call("broadcast", dtype, count, None, root, digest),
            descriptions=("broadcast", dtype, count, None, root),
            root_slots=(slots[0], slots[1]),
            is_root=root == self._rank,
        )

    def run_broadcast(self, plan: SmallBroadcast, buf: np.ndarray, deadline: float) -> None:
        """:meth:`broadcast` as ``plan`` prepared it: the root's ``buf`` is read, every other rank's
        written (contiguous, of the plan's dtype and shape); peers may run either method.

        Raises:
            CollectiveMismatchError / CollectiveTimeoutError / the error given to :meth:`fail`.
        """
        parity = self._begin()
        if plan.is_root:
            plan.root_slots[parity][...] = buf
        self._descriptions = plan.descriptions
        self._step(deadline, plan.body)
        if not plan.is_root:
            buf[...] = plan.root_slots[parity]

    # -- repeated small all_gather -------------------------------------------------------------------

    def prepare_all_gather(self, dtype: np.dtype, count: int, digest: int) -> SmallAllGather | None:
        """What :meth:`run_all_gather` needs for all_gather calls of ``count`` elements of ``dtype`` per
        rank, worked out once; None where such a call takes more than one step or there are no peers
        (then :meth:`~collsvc.client.backends.shm.group.LocalGroup.all_gather` runs it).

        Raises:
            CollsvcError: the group failed or is closed.
        """
        if self._solo() or count <= 0 or not self._has_plan("all_gather", dtype, count):
            return None
        views = self._all_views(dtype)
        return SmallAllGather(
            body=encode_call("all_gather", dtype, count, None, None, digest),
            descriptions=("all_gather", dtype, count, None, None),
            own_slots=(views[self._rank].inputs[0][:count], views[self._rank].inputs[1][:count]),
            peer_slots=tuple(
                [(rank, v.inputs[parity][:count]) for rank, v in enumerate(views) if rank != self._rank]
                for parity in (0, 1)
            ),
            rank=self._rank,
        )

    def run_all_gather(self, plan: SmallAllGather, src: np.ndarray, dst: np.ndarray, deadline: float) -> None:
        """``all_gather`` of ``src`` (flat, contiguous, of the plan's count and dtype) into ``dst`` (flat,
        ``local_size`` times as long, sharing no memory with ``src``), as ``plan`` prepared it: peers may
        run either method for the same call.

        Raises:
            CollectiveMismatchError / CollectiveTimeoutError / the error given to :meth:`fail`.
        """
        parity = self._begin()
        plan.own_slots[parity][...] = src
        self._descriptions = plan.descriptions
        self._step(deadline, plan.body)
        count = src.size
        for rank, slot in plan.peer_slots[parity]:
            dst[rank * count : (rank + 1) * count] = slot
        dst[plan.rank * count : (plan.rank + 1) * count] = src

    # -- repeated small reduce_scatter ---------------------------------------------------------------

    def prepare_reduce_scatter(
        self, dtype: np.dtype, count: int, op: ReduceOp, digest: int
    ) -> SmallReduceScatter | None:
        """What :meth:`run_reduce_scatter` needs for reduce_scatter calls with ``op`` (SUM for AVG: the
        caller divides) whose blocks have ``count`` elements of ``dtype``, worked out once; None where
        such a call takes more than one step, is not small, or there are no peers.

        Raises:
            TypeError: ``op`` is not defined for ``dtype``. CollsvcError: the group failed or is closed.
        """
        check_op_dtype(op, dtype)
        n, me = self._size, self._rank
        block = self._chunk(dtype) // max(n, 1)
        if self._solo() or count <= 0 or not self._has_plan("reduce_scatter", dtype, count):
            return None
        views = self._all_views(dtype)
        return SmallReduceScatter(
            body=encode_call("reduce_scatter", dtype, count, op, None, digest),
            descriptions=("reduce_scatter", dtype, count, op, None),
            op=op,
            own_slots=tuple(
                [(r, views[me].inputs[parity][r * block : r * block + count]) for r in range(n) if r != me]
                for parity in (0, 1)
            ),
            peer_blocks=tuple(
                [None if r == me else views[r].inputs[parity][me * block : me * block + count] for r in range(n)]
                for parity in (0, 1)
            ),
            rank=me,
        )

    def run_reduce_scatter(self, plan: SmallReduceScatter, src: np.ndarray, dst: np.ndarray, deadline: float) -> None:
        """``reduce_scatter`` of ``src`` (flat, ``local_size`` blocks of the plan's count) into ``dst`` (flat,
        one block, sharing no memory with ``src``), as ``plan`` prepared it: the same descriptor, step and
        reduction order, so peers may run either method for the same call.

        Raises:
            CollectiveMismatchError / CollectiveTimeoutError / the error given to :meth:`fail`.
        """
        parity = self._begin()
        count = dst.size
        for rank, slot in plan.own_slots[parity]:
            slot[...] = src[rank * count : (rank + 1) * count]
        self._descriptions = plan.descriptions
        self._step(deadline, plan.body)
        me = plan.rank
        parts = [src[me * count : (me + 1) * count] if block is None else block for block in plan.peer_blocks[parity]]
        reduce_parts(plan.op, dst, parts)
