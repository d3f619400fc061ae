"""The in-memory twin of the byte transports: ranks are threads of one process.

A testing transport: the library never imports it. Unit tests run the ring algorithms (and the
RingBackend) over it with no sockets. It keeps the contract of
:class:`~collsvc.client.backends.base.Channel` that the algorithms rely on: ``send`` copies the payload
and never waits for the receiver, ``recv`` waits until the call's deadline and then raises
:class:`~collsvc.errors.CollectiveTimeoutError` naming the silent rank, and frames carry the sender's
signature so a mismatched call raises :class:`~collsvc.errors.CollectiveMismatchError`.

Typical use::

    hub = MemoryHub(size=4, timeout=5.0)
    def body(rank):
        ch = hub.channel(hub.call(rank, seq=1, signature=Signature("all_reduce", "float32", (8,))))
        algorithms.all_reduce(ch, buf, ReduceOp.SUM)
        ch.flush()

Faults: :meth:`MemoryHub.silence` drops every frame a rank sends from then on (a frozen peer), and
:meth:`MemoryHub.fail` wakes every waiter with an error (a dead job or an abort).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from collsvc.client.backends.base import Call, GroupSpec, Signature, mismatch_error
from collsvc.errors import CollectiveTimeoutError

_FrameKey = tuple[str, int, int, int]  # (call key, sequence, step, source global rank)


@dataclass(frozen=True)
class _Frame:
    signature: Signature
    payload: bytes | memoryview  # memoryview: the receiver's own array, where the frame landed


class _Box:
    """Frames waiting for one rank."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.frames: dict[_FrameKey, _Frame] = {}


class MemoryHub:
    """The shared "network" of a set of thread ranks (global ranks ``0..size-1``).

    Args:
        size: the number of ranks.
        timeout: seconds from :meth:`call` to the deadline of the calls it builds.

    Raises:
        ValueError: ``size`` or ``timeout`` is not positive.
    """

    def __init__(self, size: int, timeout: float = 10.0) -> None:
        if size <= 0 or timeout <= 0:
            raise ValueError(f"size and timeout must be positive, got {size} and {timeout}")
        self.size = size
        self.timeout = timeout
        self._boxes = [_Box() for _ in range(size)]
        self._lock = threading.Lock()
        self._silenced: set[int] = set()
        self._failure: BaseException | None = None
        self._landings: dict[tuple[int, _FrameKey], tuple[memoryview, Signature]] = {}  # (dst, key) -> where
        self.frames_sent = 0
        self.frames_landed = 0
        self.bytes_sent = 0

    def transport(self, rank: int) -> MemoryTransport:
        """The transport of global ``rank``.

        Raises:
            ValueError: ``rank`` is out of range.
        """
        self._check_rank(rank)
        return MemoryTransport(self, rank)

    def channel(self, call: Call) -> MemoryChannel:
        """The channel of ``call`` for the rank ``call.group`` says is ours."""
        return MemoryChannel(self, call)

    def call(
        self,
        rank: int,
        seq: int,
        signature: Signature | None = None,
        *,
        ranks: tuple[int, ...] | None = None,
        key: str | None = None,
        timeout: float | None = None,
    ) -> Call:
        """A :class:`Call` for global ``rank`` in the group ``ranks`` (default: every rank).

        Raises:
            ValueError: ``rank`` is not in ``ranks``.
        """
        members = tuple(range(self.size)) if ranks is None else ranks
        if rank not in members:
            raise ValueError(f"rank {rank} is not a member of {members}")
        name = "world" if ranks is None else "group" + "-".join(map(str, members))
        group = GroupSpec(name, members, members.index(rank))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        return Call(group, key or name, seq, signature or Signature("test", "uint8", (0,)), deadline)

    def silence(self, rank: int) -> None:
        """Drops every frame global ``rank`` sends from now on, as if it froze before sending."""
        self._check_rank(rank)
        with self._lock:
            self._silenced.add(rank)

    def fail(self, error: BaseException) -> None:
        """Wakes every waiting ``recv`` with ``error``; frames already delivered are still handed out."""
        with self._lock:
            if self._failure is None:
                self._failure = error
        for box in self._boxes:
            with box.cond:
                box.cond.notify_all()

    def pending(self) -> int:
        """Frames delivered but never received (0 after a clean run)."""
        total = 0
        for box in self._boxes:
            with box.cond:
                total += len(box.frames)
        return total

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is out of range for {self.size} ranks")

    def _deliver(self, src: int, dst: int, key: _FrameKey, frame: _Frame) -> None:
        with self._lock:
            if src in self._silenced:
                return
            self.frames_sent += 1
            self.bytes_sent += len(frame.payload)
            into = self._landings.pop((dst, key), None)
        if into is not None and into[0].nbytes == len(frame.payload) and into[1] == frame.signature:
            into[0][:] = frame.payload  # as a lane reads it: straight into the receiver's array
            frame = _Frame(frame.signature, into[0])
            with self._lock:
                self.frames_landed += 1
        box = self._boxes[dst]
        with box.cond:
            box.frames[key] = frame
            box.cond.notify_all()

    def _land(self, dst: int, key: _FrameKey, into: memoryview, signature: Signature) -> None:
        with self._lock:
            self._landings[(dst, key)] = (into, signature)

    def _withdraw(self, dst: int, keys: list[_FrameKey]) -> None:
        with self._lock:
            for key in keys:
                self._landings.pop((dst, key), None)

    def _take(self, dst: int, key: _FrameKey, deadline: float) -> _Frame | None:
        box = self._boxes[dst]
        with box.cond:
            while True:
                frame = box.frames.pop(key, None)
                if frame is not None:
                    return frame
                if self._failure is not None:
                    raise self._failure
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                box.cond.wait(remaining)


class MemoryTransport:
    """One rank's end of a :class:`MemoryHub`; ``channel`` fits ``RingBackend(channel_for=...)``."""

    def __init__(self, hub: MemoryHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank

    def channel(self, call: Call) -> MemoryChannel:
        """The channel of ``call``.

        Raises:
            ValueError: ``call`` belongs to another rank.
        """
        own = call.group.ranks[call.group.index]
        if own != self.rank:
            raise ValueError(f"call for global rank {own} given to the transport of rank {self.rank}")
        return MemoryChannel(self.hub, call)


class MemoryChannel:
    """The frames of one call among the members of its group, through a :class:`MemoryHub`."""

    def __init__(self, hub: MemoryHub, call: Call) -> None:
        self._hub = hub
        self._call = call
        self._ranks = call.group.ranks
        self._me = call.group.ranks[call.group.index]
        self._landing: list[_FrameKey] = []

    @property
    def rank(self) -> int:
        return self._call.group.index

    @property
    def size(self) -> int:
        return self._call.group.size

    def send(self, dst: int, step: int, payload: memoryview | bytes) -> None:
        """Delivers a copy of ``payload`` to group index ``dst``'s mailbox; never waits."""
        if not 0 <= step < 1 << 32:
            raise ValueError(f"step {step} does not fit the frame header's 32 bits")
        key = (self._call.key, self._call.seq, step, self._me)
        self._hub._deliver(self._me, self._ranks[dst], key, _Frame(self._call.signature, bytes(payload)))

    def recv(self, src: int, step: int) -> memoryview:
        """Waits for frame ``step`` from group index ``src`` until the call's deadline.

        Raises:
            CollectiveTimeoutError: the deadline passed first; ``waiting_on`` names ``src``'s global rank.
            CollectiveMismatchError: the sender's signature differs from ours.
            BaseException: the error given to :meth:`MemoryHub.fail`.
        """
        src_rank = self._ranks[src]
        key = (self._call.key, self._call.seq, step, src_rank)
        frame = self._hub._take(self._me, key, self._call.deadline)
        if frame is None:
            raise CollectiveTimeoutError(
                f"{self._call.signature.op} #{self._call.seq} in group '{self._call.group.name}': "
                f"rank {self._me} got no frame {step:#x} from rank {src_rank} before the timeout",
                [{"rank": src_rank, "step": step}],
            )
        if frame.signature != self._call.signature:
            calls = {self._me: self._call.signature.describe(), src_rank: frame.signature.describe()}
            raise mismatch_error(self._call, calls)
        return memoryview(frame.payload)

    def land(self, src: int, step: int, into: memoryview) -> None:
        """The frame is copied straight into ``into`` when it is sent (as a lane reads it)."""
        key = (self._call.key, self._call.seq, step, self._ranks[src])
        self._landing.append(key)
        self._hub._land(self._me, key, into, self._call.signature)

    def flush(self) -> None:
        """Nothing to wait for: frames were delivered by ``send``."""

    def close(self) -> None:
        """Withdraws what :meth:`land` declared and no frame filled."""
        landing, self._landing = self._landing, []
        self._hub._withdraw(self._me, landing)
