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

import contextlib
import logging
import os
import struct
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np

from collsvc.client.backends.ring.reduction import finish_average, reduce_into, reduce_to
from collsvc.client.backends.shm import descriptor
from collsvc.client.backends.shm.doorbell import Doorbell
from collsvc.client.backends.shm.segment import Layout, Segment, SegmentViews
from collsvc.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CollsvcError,
    RendezvousError,
)
from collsvc.types import ReduceOp, check_op_dtype

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<IQ")  # local_size, slot_bytes
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


class LocalGroup:
    """Collectives among the ranks of one group that live on this host, through shared memory.

    One collective at a time per group (the Communicator serializes calls); :meth:`fail` may be called
    from any thread. Arrays are contiguous numpy arrays of any dtype, used flat.
    """

    #: Seconds a wait polls before it blocks; 0 because spinning starves peers sharing a core.
    spin_seconds = 0.0

    def __init__(
        self,
        namespace: str,
        local_rank: int,
        local_size: int,
        *,
        slot_bytes: int = 4 << 20,
        timeout: float | None,
    ) -> None:
        """Binds this rank's wake-up socket; with ``timeout``, also connects (see :meth:`connect`).

        Args:
            namespace: unique per (job instance, group); every local rank passes the same.
            local_rank: this rank's index among the group's ranks on this host.
            local_size: how many of the group's ranks live on this host.
            slot_bytes: bytes per chunk; larger arrays are processed in rounds. Equal on every rank.
            timeout: seconds to wait for the other local ranks; None leaves :meth:`connect` to the
                caller, who can then wake (:meth:`fail`, :meth:`wake`) a rank waiting for its peers.

        Raises:
            ValueError: bad rank, size or slot_bytes.
            BackendUnavailableError: not Linux (memfd and abstract sockets are Linux-only).
            RendezvousError: the namespace is in use, or local ranks disagree on size or slot_bytes.
            CollectiveTimeoutError: some local ranks did not join in time (``waiting_on`` names them).
        """
        if not 0 <= local_rank < local_size:
            raise ValueError(f"local_rank {local_rank} is outside 0..{local_size - 1}")
        self._rank, self._size = local_rank, local_size
        self._layout = Layout.for_group(slot_bytes, local_size)
        self._name = f"shm group {namespace[:16]} local rank {local_rank}/{local_size}"
        self._error: BaseException | None = None
        self._watch: Callable[[], None] | None = None
        self._closed = False
        self._generation = 0
        self._segments: list[Segment] = []
        self._views: dict[np.dtype, list[SegmentViews]] = {}
        self._bell: Doorbell | None = None
        self._descriptions = ""
        if local_size == 1:
            return
        if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
            raise BackendUnavailableError("shared-memory collectives need Linux (memfd, abstract sockets)")
        try:
            self._bell = Doorbell(namespace, self._rank, self._size)
        except OSError as exc:
            raise RendezvousError(f"{self._name}: namespace already in use here: {exc}") from exc
        if timeout is not None:
            self.connect(time.monotonic() + timeout)

    def connect(self, deadline: float) -> None:
        """Exchanges segments with every other local rank; returns once all are mapped.

        Raises:
            RendezvousError: local ranks disagree on size or slot_bytes.
            CollectiveTimeoutError: some local ranks did not join by ``deadline`` (``waiting_on`` names them).
            BaseException: the error given to :meth:`fail`, or what the :meth:`watch` check raises.
        """
        bell = self._bell
        if bell is None or self._segments:
            return  # a group of one, or connected already
        own, fd = Segment.create(self._layout)
        segments: dict[int, Segment] = {self._rank: own}
        try:
            hello = _HELLO.pack(self._size, self._layout.slot_bytes)
            if not bell.exchange(fd, hello, deadline, self._check_failed):
                missing = [p for p in range(self._size) if p != self._rank and p not in bell.hellos]
                raise CollectiveTimeoutError(
                    f"{self._name}: local ranks {missing} did not join the shared-memory group in time",
                    [{"rank": p} for p in missing],
                )
            for peer in sorted(bell.hellos):
                peer_fd, body = bell.hellos.pop(peer)
                try:
                    if body != hello:
                        raise RendezvousError(
                            f"{self._name}: local rank {peer} has (local_size, slot_bytes) "
                            f"{_HELLO.unpack(body) if len(body) == _HELLO.size else body!r}, ours "
                            f"{(self._size, self._layout.slot_bytes)}"
                        )
                    segments[peer] = Segment.attach(peer_fd, self._layout)
                finally:
                    os.close(peer_fd)
        except BaseException:
            for segment in segments.values():
                segment.close()
            self.close()
            raise
        finally:
            os.close(fd)
        self._segments = [segments[r] for r in range(self._size)]
        logger.debug("%s: joined", self._name)

    @property
    def rank(self) -> int:
        """This rank's local rank."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of local ranks."""
        return self._size

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

    def fail(self, error: BaseException) -> None:
        """Makes the pending call (woken now) and every later call raise ``error``; any thread."""
        if self._error is None:
            self._error = error
        self.wake()

    def watch(self, check: Callable[[], None] | None) -> None:
        """Runs ``check`` whenever a wait of this group wakes up without its data; what it raises fails
        the pending call (and, since ranks are then out of step, every later one).

        The owner sets it per call, for conditions that depend on the call (a member that left
        before finishing it), and calls :meth:`wake` when the condition may have changed.
        """
        self._watch = check

    def wake(self) -> None:
        """Makes a blocked wait look at its data, its failure and its check again; any thread."""
        bell = self._bell
        if bell is not None and not self._closed:
            bell.wake()

    def close(self) -> None:
        """Unmaps the segments and closes the sockets; idempotent. Peers waiting on this rank time out."""
        if self._closed:
            return
        self._closed = True
        self._views.clear()
        for segment in self._segments:
            segment.close()
        self._segments = []
        if self._bell is not None:
            self._bell.close()
            self._bell = None

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the step engine -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _call(
        self,
        collective: str,
        array: np.ndarray,
        count: int,
        op: ReduceOp | None,
        root: int | None,
        digest: int,
        deadline: float,
    ) -> Iterator[bytes]:
        body = descriptor.encode(collective, array.dtype, count, op, root, digest)
        self._descriptions = f"{collective} {array.dtype} x{count} op={op.name if op else '-'} root={root}"
        try:
            yield body
        except CollectiveMismatchError:
            raise  # every rank raised after the same barrier: still in step
        except BaseException as exc:
            # Ranks are out of step now: no later call may use the slots.
            if self._error is None:
                self._error = exc if isinstance(exc, CollsvcError) else CollsvcError(f"{self._name}: {exc!r}")
            raise

    def _step(self, deadline: float, body: bytes | None) -> None:
        """Barrier ``generation + 1``; with ``body`` (first step of a call), also checks descriptors."""
        bell = self._bell
        assert bell is not None  # only groups of two or more step
        generation = self._generation + 1
        self._segments[self._rank].reached[0] = generation
        if not bell.barrier(generation, body or b"", deadline, self._check_failed, self.spin_seconds):
            # Every rank records the step it reached in its segment: enough to name the late ones.
            missing = [r for r, seg in enumerate(self._segments) if int(seg.reached[0]) < generation]
            gone = sorted(bell.gone)
            note = f" (local ranks {gone} closed their sockets: exited or closed the group)" if gone else ""
            raise CollectiveTimeoutError(
                f"{self._name}: local ranks {missing} did not reach step {generation} in time{note}",
                [{"rank": r} for r in missing],
            )
        self._generation = generation
        if body is not None:
            bodies = bell.bodies[generation % 2]
            if any(b != body for b in bodies):
                raise descriptor.mismatch(self._name, bodies, self._descriptions)

    def _solo(self) -> bool:
        """Raises if the group failed or closed; True when there are no peers (nothing to exchange)."""
        self._check_failed()
        if self._closed:
            raise CollsvcError(f"{self._name}: the group is closed")
        return self._size == 1

    def _check_failed(self) -> None:
        if self._error is not None:
            raise self._error
        if self._watch is not None:
            self._watch()

    def _parity(self) -> int:
        return (self._generation + 1) % 2

    def _chunk(self, dtype: np.dtype) -> int:
        return self._layout.slot_bytes // dtype.itemsize

    def _all_views(self, dtype: np.dtype) -> list[SegmentViews]:
        views = self._views.get(dtype)
        if views is None:
            views = self._views[dtype] = [segment.views(dtype) for segment in self._segments]
        return views

    def _own(self, dtype: np.dtype) -> SegmentViews:
        return self._all_views(dtype)[self._rank]

    def _peer(self, rank: int, dtype: np.dtype) -> SegmentViews:
        return self._all_views(dtype)[rank]

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self._size:
            raise ValueError(f"root {root} is outside 0..{self._size - 1}")

    def _check_sizes(self, src: np.ndarray, out: np.ndarray, ok: bool, message: str) -> None:
        if src.dtype != out.dtype:
            raise TypeError(f"src and out dtypes differ: {src.dtype} vs {out.dtype}")
        if not ok:
            raise ValueError(f"{message}: src has {src.size}, out {out.size}, local_size {self._size}")

    # -- reductions ------------------------------------------------------------------------------

    def _reduce(self, buf: np.ndarray, op: ReduceOp, root: int | None, deadline: float, body: bytes) -> None:
        n, me, total = self._size, self._rank, buf.size
        views = self._all_views(buf.dtype)
        gather = root is None or root == me
        if total * buf.dtype.itemsize <= min(_DIRECT_BYTES, self._layout.slot_bytes):
            parity = self._parity()
            np.copyto(views[me].inputs[parity][:total], buf)
            self._step(deadline, body)
            if gather:
                # Reduce into our slot of the other parity (free until the next step, see the module
                # docstring), not into buf: SIMD loops may round differently for different alignments,
                # and the slots sit at the same offsets on every rank.
                scratch = views[me].inputs[1 - parity][:total]
                _combine(op, scratch, [v.inputs[parity][:total] for v in views], n)
                np.copyto(buf, scratch)
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


def _combine(op: ReduceOp, out: np.ndarray, parts: list[np.ndarray], size: int) -> None:
    """``out = parts[0] OP parts[1] OP ...`` in this order; AVG divided by ``size`` once at the end.

    ``out`` may be ``parts[0]`` or ``parts[1]`` but no later part (it is overwritten first).
    """
    reduce_to(op, out, parts[0], parts[1])
    for part in parts[2:]:
        reduce_into(op, out, part)
    if op is ReduceOp.AVG:
        finish_average(out, size)
