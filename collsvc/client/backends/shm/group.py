"""Collectives among the ranks of one group that live on one host, through shared memory.

Every collective is a sequence of *steps*. In step ``g`` each rank writes only its own segment's slots
of parity ``g % 2``, then meets the others at barrier ``g``, then reads the peers' slots of that
parity (and may already write parity ``(g + 1) % 2``, the next step's). A rank can only write parity
``g % 2`` again in step ``g + 2``, after barrier ``g + 1``, which every peer reaches only once it has
finished reading step ``g``: two parities make one barrier per step enough.

all_reduce of a large array is pipelined: in the step that publishes chunk ``k``, each rank also
reduces its slice of chunk ``k - 1`` into its result slot and copies every rank's reduced slice of
chunk ``k - 2`` out, so ``K`` chunks take ``K + 1`` barriers. Contributions are always combined in
local-rank order 0..n-1, so every rank gets the same bits. (In all_reduce, local ranks 0 and 1 reduce
their slice in place in their own array and copy it to their result slot: cheaper than writing a
third array.) With an ``exchange`` each rank hands its reduced slice of every chunk to it before
publishing it, one step later: the hierarchical all_reduce across hosts all-reduces the slice there
with the ranks of the same local index on the other hosts. Small arrays take one barrier: every rank
publishes its whole input and reduces all of them itself. A broadcast above 256 KiB goes in at least
four pieces, so that the root copies piece ``k + 1`` in while the others copy piece ``k`` out.

The first barrier of every call carries a descriptor (the caller's signature digest, the collective,
dtype, element count, op and root); ranks that disagree all raise CollectiveMismatchError after that
barrier, before any data is combined (a JobBrokenError: the job is over, as a mismatch anywhere ends it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from collsvc.client.backends.reduction import finish_average, reduce_parts
from collsvc.client.backends.shm.prepared import PreparedCalls
from collsvc.client.backends.shm.segment import SegmentViews
from collsvc.types import ReduceOp, check_op_dtype

# ``exchange(chunk, lo, hi)`` of :meth:`LocalGroup.all_reduce`: starts the exchange of this rank's
# reduced slice ``buf[lo:hi]`` of a chunk; returns a function that waits until it finished (raising
# what it raised).
Exchange = Callable[[int, int, int], Callable[[], None]]


def _flat(array: np.ndarray, what: str, *, writable: bool) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{what} must be contiguous")
    if writable and not array.flags.writeable:
        raise ValueError(f"{what} must be writable")
    return array.reshape(-1)


class LocalGroup(PreparedCalls):
    """Collectives among the ranks of one group that live on this host, through shared memory.

    One collective at a time per group (the Communicator serializes calls); :meth:`fail` may be called
    from any thread. Arrays are contiguous numpy arrays of any dtype, used flat. Construction and
    failure handling are :class:`~collsvc.client.backends.shm.steps.StepEngine`'s.
    """

    # -- public collectives ----------------------------------------------------------------------

    def all_reduce(
        self,
        buf: np.ndarray,
        op: ReduceOp,
        deadline: float,
        *,
        digest: int = 0,
        exchange: Exchange | None = None,
        spin: float | None = None,
    ) -> None:
        """Reduces ``buf`` across the local ranks, in place; AVG divides by the local size.

        ``exchange(chunk, lo, hi)``, where given, is started on each rank once per chunk, right after the
        rank reduced its slice ``buf[lo:hi]`` of that chunk, and finished (the function it returns) before
        the slice is handed to the others; meanwhile the rank works on the neighbouring chunks. It may
        rewrite the slice in place (the hierarchical all_reduce all-reduces it there with the ranks of
        the same local index on the other hosts). The call then takes the chunked path at any size.
        ``spin`` as in :meth:`reduce`.

        Raises:
            TypeError / ValueError: bad array or op (before anything is shared).
            CollectiveMismatchError: local ranks called different collectives.
            CollectiveTimeoutError: a local rank did not arrive by ``deadline``.
            BaseException: the error given to :meth:`fail`; what ``exchange`` raises.
        """
        flat = _flat(buf, "buf", writable=True)
        check_op_dtype(op, flat.dtype)
        if self._solo():
            if exchange is not None:
                exchange(0, 0, flat.size)()
            return
        with self._polling(spin), self._call("all_reduce", flat, flat.size, op, None, digest, deadline) as body:
            if exchange is None:
                self._reduce(flat, op, None, deadline, body)
            else:
                self._exchanging_all_reduce(flat, op, deadline, body, exchange)

    def reduce(
        self, buf: np.ndarray, op: ReduceOp, root: int, deadline: float, *, digest: int = 0, spin: float | None = None
    ) -> None:
        """Reduces ``buf`` onto local rank ``root`` in place; other ranks' ``buf`` is left unchanged.

        ``spin``: seconds each wait of this call polls before it sleeps, in place of the group's budget
        (``spin_seconds``); 0 where the caller knows its peers are busy elsewhere for longer.

        Raises:
            Same as :meth:`all_reduce`; ValueError for a bad root.
        """
        flat = _flat(buf, "buf", writable=True)
        check_op_dtype(op, flat.dtype)
        self._check_root(root)
        if self._solo():
            return
        with self._polling(spin), self._call("reduce", flat, flat.size, op, root, digest, deadline) as body:
            self._reduce(flat, op, root, deadline, body)

    def broadcast(
        self, buf: np.ndarray, root: int, deadline: float, *, digest: int = 0, spin: float | None = None
    ) -> None:
        """Copies local rank ``root``'s ``buf`` into every rank's ``buf``; ``spin`` as in :meth:`reduce`.

        Raises:
            Same as :meth:`all_reduce`; ValueError for a bad root.
        """
        flat = _flat(buf, "buf", writable=True)
        self._check_root(root)
        if self._solo():
            return
        with self._polling(spin), self._call("broadcast", flat, flat.size, None, root, digest, deadline) as body:
            piece = self._broadcast_piece(flat.dtype, flat.size)
            sent = flat if self._rank == root else None
            for lo, hi, parity in self._own_pieces(sent, flat.dtype, flat.size, piece, body, deadline):
                if sent is None:
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
            for lo, hi, parity in self._own_pieces(flat, flat.dtype, m, self._chunk(flat.dtype), body, deadline):
                self._copy_peers_pieces(dst, m, lo, hi, parity)
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
            for lo, hi, parity, piece in self._pieces_for_peers(flat, flat.dtype, m, body, deadline):
                parts = [
                    flat[me * m + lo : me * m + hi]
                    if rank == me
                    else self._peer(rank, flat.dtype).inputs[parity][me * piece : me * piece + hi - lo]
                    for rank in range(n)
                ]
                _combine(op, dst[lo:hi], parts, n)

    def all_to_all(self, src: np.ndarray, out: np.ndarray, deadline: float, *, digest: int = 0) -> None:
        """Block ``r`` of every local rank's ``src`` (``local_size`` equal blocks) goes to rank ``r``;
        ``out`` gets one block from each rank, in rank order.

        Each step carries a piece of every block: a rank copies the pieces for its peers into its slot,
        meets them, and copies the pieces they left for it out of theirs; its own block goes straight
        from ``src`` to ``out``.

        Raises:
            Same as :meth:`all_reduce`.
        """
        flat = _flat(src, "src", writable=False)
        dst = _flat(out, "out", writable=True)
        n, me = self._size, self._rank
        self._check_sizes(
            flat, dst, flat.size == dst.size and flat.size % n == 0, "src and out must have local_size equal blocks"
        )
        m = flat.size // n
        if np.shares_memory(flat, dst):
            flat = flat.copy()  # out is written while other ranks' blocks of src are still to be sent
        if self._solo():
            np.copyto(dst, flat)
            return
        with self._call("all_to_all", flat, m, None, None, digest, deadline) as body:
            for lo, hi, parity, piece in self._pieces_for_peers(flat, flat.dtype, m, body, deadline):
                for rank in range(n):
                    if rank != me:
                        part = self._peer(rank, flat.dtype).inputs[parity][me * piece : me * piece + hi - lo]
                        np.copyto(dst[rank * m + lo : rank * m + hi], part)
            np.copyto(dst[me * m : (me + 1) * m], flat[me * m : (me + 1) * m])

    def gather(self, src: np.ndarray, out: np.ndarray | None, root: int, deadline: float, *, digest: int = 0) -> None:
        """Local rank ``root``'s ``out`` (``local_size * len(src)``; None elsewhere) becomes every rank's
        ``src`` in rank order. The others copy their ``src`` into their slot one piece per step; the
        root copies each piece out.

        Raises:
            Same as :meth:`all_reduce`; ValueError for a bad root, or a missing or wrong ``out`` on it.
        """
        flat = _flat(src, "src", writable=False)
        self._check_root(root)
        n, me, m = self._size, self._rank, flat.size
        dst = None
        if me == root:
            if out is None:
                raise ValueError("gather needs an output array on the root")
            dst = _flat(out, "out", writable=True)
            self._check_sizes(flat, dst, dst.size == n * m, "out must have local_size * len(src) elements")
            if np.shares_memory(flat, dst) and dst[me * m : (me + 1) * m].ctypes.data != flat.ctypes.data:
                flat = flat.copy()
        if self._solo():
            if dst is not None:
                np.copyto(dst, flat)
            return
        with self._call("gather", flat, m, None, root, digest, deadline) as body:
            sent = flat if dst is None else None  # the root publishes nothing
            for lo, hi, parity in self._own_pieces(sent, flat.dtype, m, self._chunk(flat.dtype), body, deadline):
                if dst is not None:
                    self._copy_peers_pieces(dst, m, lo, hi, parity)
            if dst is not None:
                np.copyto(dst[me * m : (me + 1) * m], flat)

    def scatter(self, src: np.ndarray | None, out: np.ndarray, root: int, deadline: float, *, digest: int = 0) -> None:
        """Every local rank's ``out`` becomes its block of local rank ``root``'s ``src`` (``local_size``
        blocks; None elsewhere). The root copies one piece of every other rank's block into its slot
        per step; each rank copies its piece out.

        Raises:
            Same as :meth:`all_reduce`; ValueError for a bad root, or a missing or wrong ``src`` on it.
        """
        dst = _flat(out, "out", writable=True)
        self._check_root(root)
        n, me, m = self._size, self._rank, dst.size
        flat = None
        if me == root:
            if src is None:
                raise ValueError("scatter needs an input array on the root")
            flat = _flat(src, "src", writable=False)
            self._check_sizes(flat, dst, flat.size == n * m, "src must have local_size * len(out) elements")
            if np.shares_memory(flat, dst):
                flat = flat.copy()  # out is written while the other ranks' blocks are still to be sent
        if self._solo():
            if flat is not None:
                np.copyto(dst, flat)
            return
        with self._call("scatter", dst, m, None, root, digest, deadline) as body:
            for lo, hi, parity, piece in self._pieces_for_peers(flat, dst.dtype, m, body, deadline):
                if flat is None:
                    np.copyto(dst[lo:hi], self._peer(root, dst.dtype).inputs[parity][me * piece : me * piece + hi - lo])
            if flat is not None:
                np.copyto(dst, flat[me * m : (me + 1) * m])

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

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- pieces and reductions -------------------------------------------------------------------

    def _own_pieces(
        self, flat: np.ndarray | None, dtype: np.dtype, m: int, piece: int, body: bytes, deadline: float
    ) -> Iterator[tuple[int, int, int]]:
        """Steps through a block of ``m`` elements of ``dtype``, ``piece`` at a time: copies this rank's
        piece of ``flat`` into the start of its slot (None: it publishes nothing), meets the peers
        (``body``: the call's descriptor, on the first step), and yields ``(lo, hi, parity)``: the
        piece's range and the slot parity it used, so the caller reads what the others published."""
        for index in range(max(1, -(-m // piece))):
            lo = index * piece
            hi = min(m, lo + piece)
            parity = self._parity()
            if flat is not None:
                np.copyto(self._own(dtype).inputs[parity][: hi - lo], flat[lo:hi])
            self._step(deadline, body if index == 0 else None)
            yield lo, hi, parity

    def _copy_peers_pieces(self, dst: np.ndarray, m: int, lo: int, hi: int, parity: int) -> None:
        """Copies the piece ``lo:hi`` that every other rank published with :meth:`_own_pieces` (slot
        parity ``parity``) into its block of ``dst`` (``local_size`` blocks of ``m`` elements)."""
        for rank in range(self._size):
            if rank != self._rank:
                np.copyto(dst[rank * m + lo : rank * m + hi], self._peer(rank, dst.dtype).inputs[parity][: hi - lo])

    def _pieces_for_peers(
        self, flat: np.ndarray | None, dtype: np.dtype, m: int, body: bytes, deadline: float
    ) -> Iterator[tuple[int, int, int, int]]:
        """Steps through ``flat``'s ``local_size`` blocks of ``m`` elements of ``dtype``, one piece of
        every block per step: copies the pieces of the other ranks' blocks into this rank's slot (rank
        ``r``'s at ``r * piece``; None: it publishes nothing), meets the peers (``body``: the call's
        descriptor, on the first step), and yields ``(lo, hi, parity, piece)``: the piece's range within
        a block, the slot parity it used, and the piece length, so the caller reads from each peer's
        slot what that peer left for it."""
        n, me = self._size, self._rank
        piece = max(1, self._chunk(dtype) // n)
        for index in range(max(1, -(-m // piece))):
            lo = index * piece
            hi = min(m, lo + piece)
            parity = self._parity()
            if flat is not None:
                slot = self._own(dtype).inputs[parity]
                for rank in range(n):
                    if rank != me:
                        np.copyto(slot[rank * piece : rank * piece + hi - lo], flat[rank * m + lo : rank * m + hi])
            self._step(deadline, body if index == 0 else None)
            yield lo, hi, parity, piece

    def _reduce(self, buf: np.ndarray, op: ReduceOp, root: int | None, deadline: float, body: bytes) -> None:
        n, me, total = self._size, self._rank, buf.size
        views = self._all_views(buf.dtype)
        gather = root is None or root == me
        if self._direct(total * buf.dtype.itemsize):
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
                self._hand_in(views, buf, lo, length, parity)
                current = (lo, length)
            self._step(deadline, body if index == 0 else None)
            if pending is not None and gather:
                lo, length = pending
                # all_reduce: ranks 0 and 1 have their own slice in buf already (see below)
                self._take_results(views, buf, lo, length, parity, me if root is None and me < 2 else None)
            if current is not None:
                lo, length = current
                a, z = self._share(length, me)
                own = buf[lo + a : lo + z]
                parts = [own if r == me else views[r].inputs[parity][a:z] for r in range(n)]
                result = views[me].results[1 - parity][: z - a]
                if root is not None:
                    _combine(op, result, parts, n)
                else:
                    # all_reduce: local ranks 0 and 1 reduce in place into their own slice of buf
                    # (reading two arrays and writing one of them costs about half of writing a third;
                    # _combine allows it for the first two parts), then publish the slice.
                    in_place = me < 2
                    _combine(op, own if in_place else result, parts, n)
                    if in_place:
                        result[:] = own
            pending = current

    def _exchanging_all_reduce(
        self, buf: np.ndarray, op: ReduceOp, deadline: float, body: bytes, exchange: Exchange
    ) -> None:
        """all_reduce whose reduced slices go through ``exchange`` (see :meth:`all_reduce`).

        A chunk's exchange runs while this rank hands in the next chunk and copies out the one before,
        so results lag one step more than in :meth:`_reduce`. In step ``g`` a rank publishes chunk
        ``g``'s inputs (parity ``g % 2``), meets the others, copies chunk ``g - 2``'s slices out of
        their result slots, finishes chunk ``g - 1``'s exchange and publishes its slice in its result
        slot of the other parity (read in step ``g + 1``, rewritten in step ``g + 2``), then reduces
        its slice of chunk ``g`` and starts that chunk's exchange: ``K`` chunks take ``K + 2`` steps.
        """
        n, me, total = self._size, self._rank, buf.size
        views = self._all_views(buf.dtype)
        chunk = self._chunk(buf.dtype)
        chunks = -(-total // chunk)

        def bounds(index: int) -> tuple[int, int, int, int]:
            lo = index * chunk
            length = min(chunk, total - lo)
            return lo, length, *self._share(length, me)

        finishing: Callable[[], None] | None = None  # waits for the exchange in flight
        try:
            for index in range(chunks + 2):
                parity = self._parity()
                if index < chunks:
                    lo, length, _, _ = bounds(index)
                    self._hand_in(views, buf, lo, length, parity)
                self._step(deadline, body if index == 0 else None)
                if index >= 2:
                    lo, length, _, _ = bounds(index - 2)
                    self._take_results(views, buf, lo, length, parity, me)
                if finishing is not None:
                    finish, finishing = finishing, None
                    self._exchanged(finish)
                    lo, _, a, z = bounds(index - 1)
                    views[me].results[1 - parity][: z - a] = buf[lo + a : lo + z]
                if index < chunks:
                    lo, length, a, z = bounds(index)
                    own = buf[lo + a : lo + z]
                    parts = [own if r == me else views[r].inputs[parity][a:z] for r in range(n)]
                    if me < 2:  # in place: _combine allows the first two parts as its output
                        _combine(op, own, parts, n)
                    else:  # through our input slot of the other parity: free until our next step
                        scratch = views[me].inputs[1 - parity][: z - a]
                        _combine(op, scratch, parts, n)
                        own[:] = scratch
                    finishing = self._exchanged(functools.partial(exchange, index, lo + a, lo + z))
        except BaseException:
            if finishing is not None:  # nothing may write into buf once the call has returned
                with contextlib.suppress(BaseException):  # the call fails with the first error
                    finishing()
            raise

    def _share(self, length: int, rank: int) -> tuple[int, int]:
        """The bounds of local rank ``rank``'s slice of a chunk of ``length`` elements."""
        return length * rank // self._size, length * (rank + 1) // self._size

    def _hand_in(self, views: list[SegmentViews], buf: np.ndarray, lo: int, length: int, parity: int) -> None:
        """Copies the chunk ``buf[lo:lo + length]`` into our input slot of ``parity``, but for our own
        slice, which we reduce straight from buf: only the others read it there."""
        a, z = self._share(length, self._rank)
        slot = views[self._rank].inputs[parity]
        np.copyto(slot[:a], buf[lo : lo + a])
        np.copyto(slot[z:length], buf[lo + z : lo + length])

    def _take_results(
        self, views: list[SegmentViews], buf: np.ndarray, lo: int, length: int, parity: int, skip: int | None
    ) -> None:
        """Copies every local rank's reduced slice of the chunk at ``buf[lo:]`` out of its result slot of
        ``parity`` into buf, but for rank ``skip`` (one whose slice is there already)."""
        for rank in range(self._size):
            if rank != skip:
                a, z = self._share(length, rank)
                np.copyto(buf[lo + a : lo + z], views[rank].results[parity][: z - a])

    def _exchanged(self, run: Callable[[], Any]) -> Any:
        """``run()`` (starting or finishing an exchange); what it raises leaves this rank out of step,
        even a mismatch found across hosts: the local peers are on to the next step."""
        try:
            return run()
        except BaseException as exc:
            self._left_step(exc)
            raise


def _combine(op: ReduceOp, out: np.ndarray, parts: list[np.ndarray], size: int) -> None:
    """``out = parts[0] OP parts[1] OP ...`` in this order; AVG divided by ``size`` once at the end.

    ``out`` may be ``parts[0]`` or ``parts[1]`` but no later part (it is overwritten first).
    """
    reduce_parts(op, out, parts)
    if op is ReduceOp.AVG:
        finish_average(out, size)
