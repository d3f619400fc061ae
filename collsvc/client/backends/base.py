"""The seams between the Communicator, its backends, and the byte transports under the ring backend.

The Communicator validates arguments, numbers each collective, builds a :class:`Call` and hands
contiguous, flat (1-D) *native* arrays to a :class:`Backend` (numpy arrays for ``ring``, CuPy arrays for
``nccl``). Backends move bytes and never talk to the coordinator.

The ring backend runs pure algorithms (``ring/algorithms.py``) over a :class:`Channel`: point-to-point
frames among the members of one group for one call. Channels come from a transport: gRPC between hosts,
shared memory within a host, or the in-memory twin used by unit tests.

Repeated calls meet the general path here too: once a call took the general path, the Communicator's
fast path (``client/fast_path.py``) asks the backend to prepare later calls like it
(:meth:`Backend.prepare`). A backend with a faster road for them (the ring backend's shared-memory
groups, ``backends/shm/repeated.py``) returns a :class:`PreparedCall`, which does the general path's
bookkeeping itself through the :class:`CallHooks` the call runner (``client/calls.py``) gives it; one
without returns None, and such calls keep the general path.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from collsvc.config import debug_enabled
from collsvc.errors import CollectiveMismatchError, CollsvcError
from collsvc.types import ReduceOp


@dataclass(frozen=True)
class Signature:
    """What a rank called at one sequence number; equal on every rank or it is a mismatch.

    ``root`` is None for rootless collectives; ``reduce_op`` is "" where no reduction applies;
    ``compression`` names the lossy wire of a reduction that asked for one ("" for an exact wire).
    """

    op: str
    dtype: str
    shape: tuple[int, ...]
    reduce_op: str = ""
    root: int | None = None
    compression: str = ""

    def describe(self) -> dict[str, Any]:
        """The signature as a JSON-able dict (used in CollectiveMismatchError.details); ``compression``
        only where a call asked for one, so exact calls keep the digests they always had."""
        described: dict[str, Any] = {
            "op": self.op,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "reduce_op": self.reduce_op,
            "root": self.root,
        }
        if self.compression:
            described["compression"] = self.compression
        return described

    def encode(self) -> bytes:
        """Compact JSON bytes, sent with a call's frames so a receiver can name the difference."""
        return self._encoded

    @functools.cached_property
    def _encoded(self) -> bytes:
        return json.dumps(self.describe(), separators=(",", ":")).encode()

    @functools.cached_property
    def text(self) -> str:
        """The call as people read it in logs, status, errors and timelines: ``all_reduce(float32[8], SUM)``."""
        return _call_text(self.op, self.dtype, f"{list(self.shape)}", self.reduce_op, self.root, self.compression)

    def __hash__(self) -> int:
        # The generated hash would hash every field on each call; signatures are dictionary keys on
        # every call's path, and equal signatures have equal digests.
        return self.digest

    @functools.cached_property
    def digest(self) -> int:
        """A 64-bit digest carried in every frame header (the mismatch check compares it)."""
        return int.from_bytes(hashlib.blake2b(self._encoded, digest_size=8).digest(), "little")

    @classmethod
    def of(
        cls,
        op: str,
        dtype: str,
        shape: tuple[int, ...],
        reduce_op: str = "",
        root: int | None = None,
        compression: str = "",
    ) -> Signature:
        """The signature, shared with earlier calls that had the same one: a training loop repeats a few
        signatures, so its encoding, digest and text are computed once, not per call."""
        key = (op, dtype, shape, reduce_op, root, compression)
        known = _INTERNED.get(key)
        if known is None:
            if len(_INTERNED) >= _INTERNED_LIMIT:
                _INTERNED.clear()
            known = _INTERNED[key] = cls(op, dtype, shape, reduce_op, root, compression)
        return known


# The signatures Signature.of handed out most recently (bounded: a job with ever-changing shapes
# starts over rather than growing).
_INTERNED: dict[tuple[str, str, tuple[int, ...], str, int | None, str], Signature] = {}
_INTERNED_LIMIT = 1024


@dataclass(frozen=True)
class GroupSpec:
    """A communicator's members: ``ranks`` are global ranks in group order; ``index`` is ours."""

    name: str
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Call:
    """One collective call as the backend sees it.

    ``key`` names the stream of calls the sequence number counts in: the group name for collectives,
    ``"<group>/p2p/<src>-<dst>/<tag>"`` for point-to-point. ``deadline`` is ``time.monotonic()`` based;
    ``timeout`` is the number of seconds it stands for (None: the job's timeout), for error messages.

    A backend may split a call into sub-calls over parts of the group (hierarchical all_reduce); those
    keep ``stream`` (the key the call's progress is recorded under) and ``members`` (every member of
    the original call: if one of them left before finishing it, the call can never complete).
    """

    group: GroupSpec
    key: str
    seq: int
    signature: Signature
    deadline: float
    timeout: float | None = None
    stream: str = ""
    members: tuple[int, ...] = ()

    @property
    def progress_stream(self) -> str:
        return self.stream or self.key

    @property
    def all_members(self) -> tuple[int, ...]:
        return self.members or self.group.ranks

    @property
    def point_to_point(self) -> bool:
        """A message between two ranks (its stream is not the group's own)."""
        return self.progress_stream != self.group.name

    def title(self) -> str:
        """The call as errors name it: ``all_reduce #3``, or for a message ``message #3 from rank 0 to
        rank 1 with tag 2`` (a p2p stream is named ``<group>/p2p/<src>-<dst>/<tag>`` in global ranks)."""
        if not self.point_to_point:
            return f"{self.signature.op} #{self.seq}"
        pair, _, tag = self.progress_stream.rpartition("/")
        source, _, destination = pair.rpartition("/")[2].partition("-")
        return f"message #{self.seq} from rank {source} to rank {destination} with tag {tag}"


class Channel(Protocol):
    """Frames among the members of one group for one call.

    Ranks here are *group indices* (0..size-1), not global ranks.
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def send(self, dst: int, step: int, payload: memoryview | bytes) -> None:
        """Sends ``payload`` to group index ``dst`` as frame ``step`` of this call.

        Never waits for the receiver to call ``recv`` (frames are buffered on arrival), so ring steps
        that send before receiving cannot deadlock. Returns once ``payload`` was copied out: the caller
        may reuse the buffer. Delivery errors surface on a later ``recv`` or ``flush``.
        """
        ...

    def recv(self, src: int, step: int) -> memoryview:
        """Blocks until frame ``step`` from group index ``src`` arrives and returns its payload.

        Raises:
            CollectiveTimeoutError: the call's deadline passed first (``waiting_on`` names ``src``).
            CollectiveMismatchError: the sender's signature differs from ours.
            RankFailedError / AbortedError: the job failed or was aborted while waiting.
        """
        ...

    def land(self, src: int, step: int, into: memoryview) -> None:
        """Declares that frame ``step`` from group index ``src`` belongs in ``into`` (exactly its size).

        A transport may then read the frame straight into ``into``; ``recv`` of that frame returns a
        view of ``into``'s memory when it did, the frame's own buffer otherwise (the caller copies).
        Call it before this call's first send, and only for memory nothing reads before that frame's
        ``recv``: the bytes may land any time until then. Nothing is written into ``into`` after
        :meth:`close` returned.
        """
        ...

    def flush(self) -> None:
        """Waits until every frame this channel sent was delivered; raises as ``recv`` does."""
        ...

    def close(self) -> None:
        """Ends the call's use of the channel (also after it failed): withdraws what :meth:`land`
        declared, so no transport writes into those arrays any more."""
        ...


class StreamRecorder(Protocol):
    """Records the progress of one stream's calls, run in order by one thread (``progress.StreamProgress``)."""

    def start(self, seq: int, op: str, now: float) -> Any:
        """Call ``seq``, doing ``op``, started at ``now`` (``time.time()``): its record."""
        ...

    def finish(self, record: Any, now: float) -> None:
        """``record``'s call ended well at ``now``."""
        ...


class CallCounter(Protocol):
    """Counts calls of one signature in one group (``stats.RepeatedCallCounter``)."""

    def add(self, seconds: float) -> None:
        """One call that ended well after ``seconds``."""
        ...


class CallHooks(Protocol):
    """What a prepared call of one stream records through, given by the call runner.

    Attributes:
        stream: the stream the calls are numbered in (the Communicator's group name).
        limit: seconds a call may take unless told otherwise (the job's timeout).
    """

    stream: str
    limit: float

    @property
    def recording_timeline(self) -> bool:
        """Whether the job records a timeline now (per-call phases only the general path measures)."""
        ...

    def progress(self) -> StreamRecorder:
        """The stream's progress recorder (bind it once, when the call is prepared)."""
        ...

    def counter(self, signature: Signature, group: GroupSpec) -> CallCounter | None:
        """The statistics' counter of ``signature`` in ``group`` (None when they keep no more)."""
        ...

    def failed(self, call: Call, record: Any, span: Any, error: CollsvcError) -> CollsvcError:
        """Records the failed ``call`` (its progress ``record`` and ``(call, started_ns, 0)`` span) as
        the general path does, and returns the error its caller raises."""
        ...


class PreparedCall(Protocol):
    """Later calls of one (collective, dtype, shape, op or root) of one Communicator, worked out once."""

    def accepts(self, x: Any, out: Any) -> bool:
        """Whether a call of C-contiguous ``x`` with ``out`` may take this road."""
        ...

    def run(self, seq: int, x: Any, out: Any, limit: float | None = None) -> Any:
        """Runs call ``seq`` of the stream with ``x`` and ``out`` (which it :meth:`accepts`); ``limit``:
        seconds it may take (default: the hooks' limit).

        Returns:
            The result, written into ``out`` when given, else a new array (a barrier: None).

        Raises:
            CollectiveMismatchError / CollectiveTimeoutError / RankFailedError / AbortedError: as the
                general path raises them, recorded and reported the same way.
        """
        ...


class Backend(Protocol):
    """Moves the bytes of collectives. Arrays are flat, contiguous and of the backend's native kind.

    In-place methods write their result into ``buf``. Methods return when the result is ready to read
    (for stream-ordered GPU backends: ordered on the caller's current stream).
    """

    name: str

    def all_reduce(self, call: Call, buf: Any, op: ReduceOp) -> None: ...

    def reduce(self, call: Call, buf: Any, op: ReduceOp, root: int) -> None:
        """Result in ``buf`` on group index ``root``; ``buf`` on other ranks becomes scratch."""
        ...

    def broadcast(self, call: Call, buf: Any, root: int) -> None: ...

    def all_gather(self, call: Call, src: Any, out: Any) -> None:
        """``out`` has ``size * len(src)`` elements, blocks in group order."""
        ...

    def reduce_scatter(self, call: Call, src: Any, out: Any, op: ReduceOp) -> None:
        """``src`` has ``size * len(out)`` elements; this rank gets block ``index`` of the reduction."""
        ...

    def gather(self, call: Call, src: Any, out: Any | None, root: int) -> None: ...

    def scatter(self, call: Call, src: Any | None, out: Any, root: int) -> None: ...

    def all_to_all(self, call: Call, src: Any, out: Any) -> None: ...

    def send(self, call: Call, buf: Any, dst: int) -> None: ...

    def recv(self, call: Call, out: Any, src: int) -> None: ...

    def barrier(self, call: Call) -> bool:
        """Runs a barrier of ``call``'s group in the data plane, where this backend can.

        Returns:
            True once every member arrived; False, at once, when the backend has no data-plane barrier
            for this group (the caller then uses the coordinator's).
        """
        ...

    def prepare(
        self, kind: str, signature: Signature, group: GroupSpec, hooks: CallHooks, like: Any = None
    ) -> PreparedCall | None:
        """Later synchronous calls of ``group`` like one that just took the general path with
        ``signature`` (``kind``: "all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"
        or "barrier"; ``like``: that call's array, None for a barrier), run without the general layers
        and recording through ``hooks``; None where this backend has no faster road for them (or its
        group failed meanwhile: the general path then raises that).

        Raises:
            TypeError / ValueError: a bad op or root (which the general path raised first).
        """
        ...

    def close(self) -> None: ...

    def abort(self, error: BaseException) -> None:
        """Fails every pending and future operation with ``error`` (called from another thread)."""
        ...


def _call_text(op: str, dtype: str, shape: str, reduce_op: str, root: int | None, compression: str = "") -> str:
    if not dtype:
        return op
    options = (
        reduce_op or None,
        None if root is None else f"root={root}",
        compression and f"compression={compression}",
    )
    extras = [e for e in options if e]
    return f"{op}({dtype}{shape}{''.join(', ' + e for e in extras)})"


def describe_call(call: Mapping[str, Any] | str) -> str:
    """A call as people read it: ``all_reduce(float32[2, 3], SUM)``, from :meth:`Signature.describe`
    (or from a shared-memory descriptor, which knows the element count but not the shape)."""
    if not isinstance(call, Mapping):
        return str(call)
    shape = f"{list(call['shape'])}" if "shape" in call else f" x{call.get('count', '?')}"
    return _call_text(
        str(call.get("op", "?")),
        call.get("dtype", ""),
        shape,
        call.get("reduce_op", ""),
        call.get("root"),
        str(call.get("compression", "")),
    )


def mismatch_error(call: Call, calls: Mapping[int, Any]) -> CollectiveMismatchError:
    """The error for ranks that called different things at ``call``'s sequence number.

    Args:
        call: this rank's call.
        calls: global rank -> what it called (a :meth:`Signature.describe` dict where known).
    """
    if call.point_to_point:  # group.ranks of a message: (sender, receiver)
        verbs = {call.group.ranks[0]: "sends", call.group.ranks[-1]: "receives into"}
        described = "; ".join(
            f"rank {rank} {verbs.get(rank, 'called')} {describe_call(value).removeprefix('p2p(').removesuffix(')')}"
            for rank, value in sorted(calls.items())
        )
        kind = "size or dtype mismatch"
    else:
        texts = {rank: describe_call(value) for rank, value in sorted(calls.items())}
        if len(texts) > 1 and len(set(texts.values())) == 1:
            return _internal_fault(call, next(iter(texts.values())), calls)
        described = "; ".join(f"rank {rank} called {text}" for rank, text in texts.items())
        kind = "collective mismatch"
    return CollectiveMismatchError(f"{kind} at {call.title()} in group '{call.group.name}': {described}", dict(calls))


def differing_fields(calls: Mapping[int, Any]) -> dict[str, dict[int, Any]]:
    """The fields of the ranks' call records (dicts) whose values are not the same on every rank:
    field -> rank -> value. Fields only some ranks' records carry are left out."""
    records = {rank: value for rank, value in calls.items() if isinstance(value, Mapping)}
    if len(records) < 2:
        return {}
    common = set.intersection(*(set(record) for record in records.values()))
    return {
        name: {rank: records[rank][name] for rank in sorted(records)}
        for name in sorted(common)
        if len({json.dumps(record[name], sort_keys=True, default=str) for record in records.values()}) > 1
    }


def _internal_fault(call: Call, called: str, calls: Mapping[int, Any]) -> CollectiveMismatchError:
    """The error for ranks whose calls agree but whose buffers or descriptors do not: collsvc's fault,
    never the program's, so it must not read as "rank 0 called X; rank 1 called X"."""
    fields = differing_fields(calls)
    shown = {name: values for name, values in fields.items() if name != "digest"} or fields
    if shown:
        differed = "; ".join(
            f"{name}: " + ", ".join(f"rank {rank} {value}" for rank, value in values.items())
            for name, values in shown.items()
        )
    else:
        differed = "records that show no difference"
    records = f" Each rank's record: {dict(sorted(calls.items()))}." if debug_enabled() else ""
    return CollectiveMismatchError(
        f"internal fault at {call.title()} in group '{call.group.name}': every rank called {called}, yet "
        f"their buffers differ ({differed}). The calls agree, so this is a fault in collsvc, not in your "
        f"program; please report it (COLLSVC_DEBUG=1 adds each rank's full record).{records}",
        dict(calls),
    )


def last_finished(progress: Mapping[str, int], stream: str) -> int:
    """The last sequence number a member finished in ``stream``, from its final progress (0: none).

    Sub-calls (``"world/leaders/3"``) count under the stream their call was recorded in (``"world"``).
    """
    name = stream
    while name not in progress and "/" in name:
        name = name.rsplit("/", 1)[0]
    return progress.get(name, 0)


def as_bytes_view(array: np.ndarray) -> memoryview:
    """A flat unsigned-byte view of a contiguous numpy array, without copying."""
    return memoryview(array.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
