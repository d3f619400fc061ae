"""Collectives among the ranks of one group that live on one host, through shared memory.

Every collective is a sequence of *steps*. In step ``g`` each rank writes only its own segment's slots
of parity ``g % 2``, then meets the others at barrier ``g``, then reads the peers' slots of that
parity (and may already write parity ``(g + 1) % 2``, the next step's). A rank can only write parity
``g % 2`` again in step ``g + 2``, after barrier ``g + 1``, which every peer reaches only once it has
finished reading step ``g``: two parities make one barrier per step enough.

all_reduce of a large array is pipelined: in the step that publishes chunk ``k``, each rank also
reduces its slice of chunk ``k - 1`` into its result slot and copies every rank's reduced slice of
chunk ``k - 2`` out, so ``K`` chunks take ``K + 1`` barriers. Contributions are always combined in
local-rank order 0..n-1, so every rank gets the same bits. Small arrays take one barrier: every rank
publishes its whole input and reduces all of them itself.

The first barrier of every call carries a descriptor (the caller's signature digest, the collective,
dtype, element count, op and root); ranks that disagree all raise CollectiveMismatchError after that
barrier, before any data is combined, and stay in step for the next call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from collsvc.client.backends.reduction import finish_average, fold, native_ufunc, reduce_parts
from collsvc.client.backends.shm.descriptor import encode as encode_call
from collsvc.client.backends.shm.steps import CallScope, StepEngine
from collsvc.types import ReduceOp, check_op_dtype

# Below this many bytes all_reduce/reduce take one barrier and every rank reduces everything itself.
_DIRECT_BYTES = 64 * 1024


def _flat(array: np.ndarray, what: str, *, writable: bool) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous")
    if writable and not array.flags.writeable:
        raise ValueError(f"{what} must be writable")
    return array.reshape(-1)


class LocalGroup(StepEngine):
    """Collectives among the ranks of one group that live on this host, through shared memory.

    One collective at a time per group (the Communicator serializes calls); :meth:`fail` may be called
    from any thread. Arrays are contiguous numpy arrays of any dtype, used flat. Construction and
    failure handling are :class:`~collsvc.client.backends.shm.steps.StepEngine`'s.
    """

    # -- public collectives ----------------------------------------------------------------------

    def all_reduce(self, buf: np.ndarray, op: ReduceOp, deadline: float, *, digest: int = 0) -> None:
        """Reduces ``buf`` across the local ranks, in place; AVG divides by the local size.

        Raises:
            TypeError / ValueError: bad array or op (before anything is shared).
            CollectiveMismatchError: local ranks called different collectives.
            CollectiveTimeoutError: a local rank did not arrive by ``deadline``.
            BaseException: the error given to :meth:`fail`.
        """
        flat = _flat(buf, "buf", writable=True)
        check_op_dtype(op, flat.dtype)
        if self._solo():
            return
        with self._call("all_reduce", flat, flat.size, op, None, digest, deadline) as body:
            self._reduce(flat, op, None, deadline, body)

    def reduce(self, buf: np.ndarray, op: ReduceOp, root: int, deadline: float, *, digest: int = 0) -> None:
        """Reduces ``buf`` onto local rank ``root`` in place; other ranks' ``buf`` is left unchanged.

        Raises:
            Same as :meth:`all_reduce`; ValueError for a bad root.
        """
        flat = _flat(buf, "buf", writable=True)
        check_op_dtype(op, flat.dtype)
        self._check_root(root)
        if self._solo():
            return
        with self._call("reduce", flat, flat.size, op, root, digest, deadline) as body:
            self._reduce(flat, op, root, deadline, body)

    def broadcast(self, buf: np.ndarray, root: int, deadline: float, *, digest: int = 0) -> None:
        """Copies local rank ``root``'s ``buf`` into every rank's ``buf``.

        Raises:
            Same as :meth:`all_reduce`; ValueError for a bad root.
        """
        flat = _flat(buf, "buf", writable=True)
        self._check_root(root)
        if self._solo():
            return
        with self._call("broadcast", flat, flat.size, None, root, digest, deadline) as body:
            chunk = self._chunk(flat.dtype)
            for index in range(max(1, -(-flat.size // chunk))):
                lo = index * chunk
                hi = min(flat.size, lo + chunk)
                parity = self._parity()
                if self._rank == root:
                    np.copyto(self._own(flat.dtype).inputs[parity][: hi - lo], flat[lo:hi])
                self._step(deadline, body if index == 0 else None)
                if self._rank != root:
                    np.copyto(flat[lo:hi], self._peer(root, flat.dtype).inputs[parity][: hi - lo])

    def all_gather(self, src: np.ndarray, out: np.ndarray, deadline: float, *, digest: int = 0) -> None:
        """Concatenates every local rank's ``src`` into ``out`` (``local_size * len(src)``), in rank order.

        Raises:
            Same as :meth:`all_reduce`.
        """
        flat = _flat(src, "src", writable=False)
        dst = _flat(out, "out", writable=True)
        n, me, m = self._size, self._rank, flat.size
        self._check_sizes(flat, dst, dst.size == n * m, "out must have local_size * len(src) elements")
        own_block = dst[me * m : (me + 1) * m]
        in_place = m > 0 and own_block.ctypes.data == flat.ctypes.data
        if not in_place and np.shares_memory(flat, dst):
            flat = flat.copy()  # src overlaps another rank's block of out: keep our input intact
        if self._solo():
            np.copyto(dst, flat)
            return
        with self._call("all_gather", flat, m, None, None, digest, deadline) as body:
            chunk = self._chunk(flat.dtype)
            for index in range(max(1, -(-m // chunk))):
                lo = index * chunk
                hi = min(m, lo + chunk)
                parity = self._parity()
                np.copyto(self._own(flat.dtype).inputs[parity][: hi - lo], flat[lo:hi])
                self._step(deadline, body if index == 0 else None)
                for rank in range(n):
                    if rank != me:
                        part = self._peer(rank, flat.dtype).inputs[parity][: hi - lo]
                        np.copyto(dst[rank * m + lo : rank * m + hi], part)
            if not in_place:
                np.copyto(own_block, flat)

    def reduce_scatter(
        self, src: np.ndarray, out: np.ndarray, op: ReduceOp, deadline: float, *, digest: int = 0
    ) -> None:
        """Reduces ``src`` (``local_size * len(out)``) across ranks; rank ``r`` gets block ``r`` in ``out``.

        Raises:
            Same as :meth:`all_reduce`.
        """
        flat = _flat(src, "src", writable=False)
        dst = _flat(out, "out", writable=True)
        n, me, m = self._size, self._rank, dst.size
        self._check_sizes(flat, dst, flat.size == n * m, "src must have local_size * len(out) elements")
        check_op_dtype(op, flat.dtype)
        if np.shares_memory(flat, dst):
            flat = flat.copy()  # out is written while other ranks' blocks of src are still to be read
        if self._solo():
            np.copyto(dst, flat)
            return
        with self._call("reduce_scatter", flat, m, op, None, digest, deadline) as body:
            block = self._chunk(flat.dtype) // n
            for index in range(max(1, -(-m // block))):
                lo = index * block
                hi = min(m, lo + block)
                parity = self._parity()
                slot = self._own(flat.dtype).inputs[parity]
                for rank in range(n):
                    if rank != me:
                        np.copyto(slot[rank * block : rank * block + hi - lo], flat[rank * m + lo : rank * m + hi])
                self._step(deadline, body if index == 0 else None)
                parts = [
                    flat[me * m + lo : me * m + hi]
                    if rank == me
                    else self._peer(rank, flat.dtype).inputs[parity][me * block : me * block + hi - lo]
                    for rank in range(n)
                ]
                _combine(op, dst[lo:hi], parts, n)

    def barrier(self, deadline: float, *, digest: int = 0) -> None:
        """Returns once every local rank has called ``barrier``.

        Raises:
            CollectiveMismatchError / CollectiveTimeoutError / the error given to :meth:`fail`.
        """
        if self._solo():
            return
        empty = np.empty(0, np.uint8)
        with self._call("barrier", empty, 0, None, None, digest, deadline) as body:
            self._step(deadline, body)

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
        nbytes = count * dtype.itemsize
        if self._solo() or ufunc is None or not 0 < nbytes <= min(_DIRECT_BYTES, self._layout.slot_bytes):
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
        self._solo()
        parity = (self._generation + 1) % 2
        plan.own_inputs[parity][...] = src
        self._descriptions = plan.descriptions
        with CallScope(self, plan.body):
            self._step(deadline, plan.body)
        parts = plan.parts[parity]
        # Into our slot of the other parity first, as _reduce does (same alignment on every rank).
        scratch = plan.own_inputs[1 - parity]
        if plan.quiet:
            with np.errstate(over="ignore", invalid="ignore"):
                fold(plan.ufunc, scratch, parts)
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
        if self._solo() or not 0 < count <= self._chunk(dtype):
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
        self._solo()
        parity = (self._generation + 1) % 2
        if plan.is_root:
            plan.root_slots[parity][...] = buf
        self._descriptions = plan.descriptions
        with CallScope(self, plan.body):
            self._step(deadline, plan.body)
        if not plan.is_root:
            buf[...] = plan.root_slots[parity]

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- reductions ------------------------------------------------------------------------------

    def _reduce(self, buf: np.ndarray, op: ReduceOp, root: int | None, deadline: float, body: bytes) -> None:
        n, me, total = self._size, self._rank, buf.size
        views = self._all_views(buf.dtype)
        gather = root is None or root == me
        if total * buf.dtype.itemsize <= min(_DIRECT_BYTES, self._layout.slot_bytes):
            parity = self._parity()
            views[me].inputs[parity][:total] = buf  # slice assignment: numpy's copyto wrapper costs more
            self._step(deadline, body)
            if gather:
                # Reduce into our slot of the other parity (free until the next step, see the module
                # docstring), not into buf: SIMD loops may round differently for different alignments,
                # and the slots sit at the same offsets on every rank.
                scratch = views[me].inputs[1 - parity][:total]
                _combine(op, scratch, [v.inputs[parity][:total] for v in views], n)
                buf[:] = scratch
            return
        chunk = self._chunk(buf.dtype)
        chunks = -(-total // chunk)
        pending: tuple[int, int] | None = None  # (offset, length) of the chunk whose slices are reduced
        for index in range(chunks + 1):
            parity = self._parity()
            current: tuple[int, int] | None = None
            if index < chunks:
                lo = index * chunk
                length = min(chunk, total - lo)
                a, z = length * me // n, length * (me + 1) // n
                slot = views[me].inputs[parity]
                # Our own slice is reduced straight from buf: only the others need it in the slot.
                np.copyto(slot[:a], buf[lo : lo + a])
                np.copyto(slot[z:length], buf[lo + z : lo + length])
                current = (lo, length)
            self._step(deadline, body if index == 0 else None)
            if pending is not None and gather:
                lo, length = pending
                for rank in range(n):
                    a, z = length * rank // n, length * (rank + 1) // n
                    np.copyto(buf[lo + a : lo + z], views[rank].results[parity][: z - a])
            if current is not None:
                lo, length = current
                a, z = length * me // n, length * (me + 1) // n
                parts = [buf[lo + a : lo + z] if r == me else views[r].inputs[parity][a:z] for r in range(n)]
                _combine(op, views[me].results[1 - parity][: z - a], parts, n)
            pending = current


@dataclass(frozen=True)
class SmallAllReduce:
    """One all_reduce shape of a :class:`LocalGroup`, prepared for :meth:`LocalGroup.run_all_reduce`.

    ``body``: the call's descriptor; ``own_inputs``: this rank's input slot of each parity, cut to the
    call's length; ``parts``: every rank's, per parity; ``quiet``: reduce with floating-point warnings
    off; ``average``: divide by the group size after the sum.
    """

    body: bytes
    descriptions: tuple[str, np.dtype, int, ReduceOp | None, int | None]
    own_inputs: tuple[np.ndarray, np.ndarray]
    parts: tuple[list[np.ndarray], list[np.ndarray]]
    ufunc: Any
    quiet: bool
    average: bool


@dataclass(frozen=True)
class SmallBroadcast:
    """One broadcast shape and root of a :class:`LocalGroup`, prepared for :meth:`LocalGroup.run_broadcast`
    (``root_slots``: the root's input slot of each parity, cut and shaped to the call)."""

    body: bytes
    descriptions: tuple[str, np.dtype, int, ReduceOp | None, int | None]
    root_slots: tuple[np.ndarray, np.ndarray]
    is_root: bool


def _combine(op: ReduceOp, out: np.ndarray, parts: list[np.ndarray], size: int) -> None:
    """``out = parts[0] OP parts[1] OP ...`` in this order; AVG divided by ``size`` once at the end.

    ``out`` may be ``parts[0]`` or ``parts[1]`` but no later part (it is overwritten first).
    """
    reduce_parts(op, out, parts)
    if op is ReduceOp.AVG:
        finish_average(out, size)
