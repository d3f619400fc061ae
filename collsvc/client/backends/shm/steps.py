"""The step engine under the shared-memory collectives: segments, barriers and failure of one group.

A :class:`StepEngine` maps every local rank's memfd segment and runs numbered barriers, through
words in the segments where the CPU allows (``board.py``), else over the doorbell sockets (see
``group.py`` for how the collectives use the two slot parities). The first
barrier of every call carries a descriptor; when descriptors differ, every rank takes one more step
in which each publishes its full call signature, so the mismatch error names each rank's call. A
failure, a departure (through the :meth:`~StepEngine.watch` check) or a deadline ends any wait.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import time
from collections.abc import Callable

import numpy as np

from collsvc.client.backends.shm.board import ArrivalBoard, memory_barriers_supported
from collsvc.client.backends.shm.descriptor import encode as encode_call
from collsvc.client.backends.shm.descriptor import mismatch as describe_mismatch
from collsvc.client.backends.shm.doorbell import Doorbell
from collsvc.client.backends.shm.segment import Layout, Segment, SegmentViews
from collsvc.client.backends.shm.spin import spin_seconds
from collsvc.config import SHM_BARRIER_KINDS, shm_barriers
from collsvc.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CollsvcError,
    RendezvousError,
)
from collsvc.types import ReduceOp

logger = logging.getLogger(__name__)

_HELLO = struct.Struct("<IQ?")  # local_size, slot_bytes, memory barriers
# After a mismatch, each rank publishes up to this many bytes of its full call signature.
_LABEL_BYTES = 1024
_LABEL_LENGTH = struct.Struct("<I")


# A call as a mismatch error describes this rank's side: (collective, dtype, element count, op, root).
CallDescription = tuple[str, np.dtype, int, ReduceOp | None, int | None]


class StepEngine:
    """Segments, barriers and failure state of one shared-memory group (the base of ``LocalGroup``).

    :meth:`fail`, :meth:`wake` and :meth:`watch` may be called from any thread.
    """

    def __init__(
        self,
        namespace: str,
        local_rank: int,
        local_size: int,
        *,
        slot_bytes: int = 4 << 20,
        timeout: float | None,
        spin: float | None = None,
        barriers: str | None = None,
    ) -> None:
        """Binds this rank's wake-up socket; with ``timeout``, also connects (see :meth:`connect`).

        Args:
            namespace: unique per (job instance, group); every local rank passes the same.
            local_rank: this rank's index among the group's ranks on this host.
            local_size: how many of the group's ranks live on this host.
            slot_bytes: bytes per chunk; larger arrays are processed in rounds. Equal on every rank.
            timeout: seconds to wait for the other local ranks; None leaves :meth:`connect` to the
                caller, who can then wake (:meth:`fail`, :meth:`wake`) a rank waiting for its peers.
            spin: seconds a barrier polls before it sleeps; None: ``spin.spin_seconds``'s budget.
            barriers: ``memory`` (words in the segments, x86-64), ``sockets`` (datagrams) or ``auto``
                (memory where supported); None: ``config.shm_barriers()``. Equal on every rank.

        Raises:
            ValueError: bad rank, size, slot_bytes or barriers.
            BackendUnavailableError: not Linux (memfd and abstract sockets are Linux-only), or
                ``memory`` barriers on a CPU without total store order.
            RendezvousError: the namespace is in use, or local ranks disagree on size, slot_bytes or
                barriers.
            CollectiveTimeoutError: some local ranks did not join in time (``waiting_on`` names them).
        """
        if not 0 <= local_rank < local_size:
            raise ValueError(f"local_rank {local_rank} is outside 0..{local_size - 1}")
        self._rank, self._size = local_rank, local_size
        self._layout = Layout.for_group(slot_bytes, local_size)
        self._name = f"shm group {namespace[:16]} local rank {local_rank}/{local_size}"
        self._error: BaseException | None = None
        self._watch: Callable[[], None] | None = None
        self._label: Callable[[], bytes] = bytes
        self._closed = False
        self._generation = 0
        self._segments: list[Segment] = []
        self._views: dict[np.dtype, list[SegmentViews]] = {}
        self._bell: Doorbell | None = None
        self._board: ArrivalBoard | None = None
        self._memory_barriers = _memory_barriers(shm_barriers() if barriers is None else barriers)
        self.spin_seconds = spin_seconds(local_size, memory_barriers=self._memory_barriers) if spin is None else spin
        self._descriptions: CallDescription | None = None
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
            RendezvousError: local ranks disagree on size, slot_bytes or barriers.
            CollectiveTimeoutError: some local ranks did not join by ``deadline`` (``waiting_on`` names them).
            BaseException: the error given to :meth:`fail`, or what the :meth:`watch` check raises.
        """
        bell = self._bell
        if bell is None or self._segments:
            return  # a group of one, or connected already
        own, fd = Segment.create(self._layout)
        segments: dict[int, Segment] = {self._rank: own}
        try:
            hello = _HELLO.pack(self._size, self._layout.slot_bytes, self._memory_barriers)
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
                            f"{self._name}: local rank {peer} has (local_size, slot_bytes, memory barriers) "
                            f"{_HELLO.unpack(body) if len(body) == _HELLO.size else body!r}, ours "
                            f"{(self._size, self._layout.slot_bytes, self._memory_barriers)}"
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
        if self._memory_barriers:
            self._board = ArrivalBoard(self._segments, self._rank, bell)
        logger.debug("%s: joined", self._name)

    @property
    def rank(self) -> int:
        """This rank's local rank."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of local ranks."""
        return self._size

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

    def label(self, signature: Callable[[], bytes]) -> None:
        """Sets how to get the caller's full call signature (JSON) for the next calls: after a mismatch,
        ranks exchange these, so the error names each rank's shape, not only its element count. Called
        only then: a call that agrees pays nothing for it."""
        self._label = signature

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
        self._board = None
        for segment in self._segments:
            segment.close()
        self._segments = []
        if self._bell is not None:
            self._bell.close()
            self._bell = None

    # -- the step engine -------------------------------------------------------------------------

    def _polling(self, spin: float | None) -> PollingScope:
        """``with self._polling(spin)``: the waits inside poll ``spin`` seconds (None: the group's budget)."""
        return PollingScope(self, spin)

    def _call(
        self,
        collective: str,
        array: np.ndarray,
        count: int,
        op: ReduceOp | None,
        root: int | None,
        digest: int,
        deadline: float,
    ) -> CallScope:
        """The scope of one call: ``with self._call(...) as body`` (``body``: the first step's descriptor)."""
        body = encode_call(collective, array.dtype, count, op, root, digest)
        self._descriptions = (collective, array.dtype, count, op, root)
        return CallScope(self, body)

    def _step(self, deadline: float, body: bytes | None) -> None:
        """Barrier ``generation + 1``; with ``body`` (first step of a call), also checks descriptors.
        A step that raises anything but an agreed mismatch leaves the group out of step
        (:meth:`_call_ended_in`, as :class:`CallScope` does for a whole call: a prepared call is one step)."""
        try:
            bell = self._bell
            assert bell is not None  # only groups of two or more step
            generation = self._generation + 1
            board = self._board
            if board is not None:
                arrived = board.barrier(generation, body or b"", deadline, self._check_failed, self.spin_seconds)
            else:
                self._segments[self._rank].reached[0] = generation
                arrived = bell.barrier(generation, body or b"", deadline, self._check_failed, self.spin_seconds)
            if not arrived:
                # Every rank records the step it reached in its segment: enough to name the late ones.
                missing = [r for r, seg in enumerate(self._segments) if int(seg.reached[0]) < generation]
                for rank in missing:
                    bell.poke(rank)  # finds the ranks whose inbox is gone
                gone = sorted(bell.gone)
                note = f" (local ranks {gone} closed their sockets: exited or closed the group)" if gone else ""
                raise CollectiveTimeoutError(
                    f"{self._name}: local ranks {missing} did not reach step {generation} in time{note}",
                    [{"rank": r} for r in missing],
                )
            self._generation = generation
            if body is not None and not (board is not None and board.agree(generation)):
                bodies = board.bodies(generation) if board is not None else list(bell.bodies[generation % 2])
                if bodies.count(body) != len(bodies):
                    assert self._descriptions is not None  # set by _call, which gives the body
                    collective, dtype, count, op, root = self._descriptions
                    mine = f"{collective} {dtype} x{count} op={op.name if op else '-'} root={root}"
                    raise describe_mismatch(self._name, bodies, mine, self._exchange_labels(deadline))
        except BaseException as exc:
            self._call_ended_in(exc)
            raise

    def _exchange_labels(self, deadline: float) -> list[bytes]:
        """One more step, taken by every rank after the same mismatched barrier: each publishes its
        label (full signature), so the error can name every rank's call. Empty labels if it fails."""
        parity = self._parity()
        limit = min(self._layout.slot_bytes, _LABEL_BYTES) - _LABEL_LENGTH.size
        mine = self._label()[:limit]
        slot = self._own(np.dtype(np.uint8)).inputs[parity]
        slot[: _LABEL_LENGTH.size] = np.frombuffer(_LABEL_LENGTH.pack(len(mine)), np.uint8)
        slot[_LABEL_LENGTH.size : _LABEL_LENGTH.size + len(mine)] = np.frombuffer(mine, np.uint8)
        try:
            self._step(deadline, None)
        except CollsvcError as exc:
            self._error = self._error or exc  # out of step with the peers now
            return [b""] * self._size
        labels = []
        for rank in range(self._size):
            view = self._peer(rank, np.dtype(np.uint8)).inputs[parity]
            (length,) = _LABEL_LENGTH.unpack(view[: _LABEL_LENGTH.size].tobytes())
            labels.append(view[_LABEL_LENGTH.size : _LABEL_LENGTH.size + min(length, limit)].tobytes())
        return labels

    def _call_ended_in(self, exc: BaseException) -> None:
        """A call of this group raised ``exc``: unless it is an agreed mismatch (every rank raised after
        the same barrier, still in step), ranks are out of step now and no later call may use the slots."""
        if not isinstance(exc, CollectiveMismatchError):
            self._left_step(exc)

    def _left_step(self, exc: BaseException) -> None:
        """This rank left a call midway on ``exc`` (whatever it is): its peers are out of step with it,
        so this call and every later one raise (``exc`` where it is a CollsvcError)."""
        if self._error is None:
            self._error = exc if isinstance(exc, CollsvcError) else CollsvcError(f"{self._name}: {exc!r}")

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


def _memory_barriers(kind: str) -> bool:
    """Whether barriers go through the segments' words, for ``kind`` (see ``config.shm_barriers``).

    Raises:
        ValueError: an unknown kind.
        BackendUnavailableError: ``memory`` on a CPU without total store order.
    """
    if kind not in SHM_BARRIER_KINDS:
        raise ValueError(f"barriers must be auto, memory or sockets, got {kind!r}")
    if kind == "memory" and not memory_barriers_supported():
        raise BackendUnavailableError("shared-memory barriers through memory words need an x86-64 CPU")
    return kind == "memory" or (kind == "auto" and memory_barriers_supported())


class CallScope:
    """Marks a group out of step when a call ends in anything but an agreed mismatch (see ``_call``)."""

    __slots__ = ("_engine", "_body")

    def __init__(self, engine: StepEngine, body: bytes) -> None:
        self._engine, self._body = engine, body

    def __enter__(self) -> bytes:
        return self._body

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self._engine._call_ended_in(exc)


class PollingScope:
    """Sets a group's polling budget (``spin_seconds``) for one call and restores it after."""

    __slots__ = ("_engine", "_spin", "_budget")

    def __init__(self, engine: StepEngine, spin: float | None) -> None:
        self._engine, self._spin, self._budget = engine, spin, engine.spin_seconds

    def __enter__(self) -> None:
        if self._spin is not None:
            self._engine.spin_seconds = self._spin

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._engine.spin_seconds = self._budget
