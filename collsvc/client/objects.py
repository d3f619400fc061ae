"""Object collectives: pickled bytes carried by array collectives.

Unpickling runs code chosen by the sender, so it happens only when peers are authenticated (a job
token or mutual TLS) or the user opted in with ``COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE=1``. The check is
local and identical on every rank, so all ranks refuse together before any data moves.

A rank whose object cannot be pickled still takes part: it sends, in place of a length, a negative
number that says "failed, and here is why in that many bytes", then the text of its error in place of
the object. Every rank then raises (the failing one its own pickling error; the others a
:class:`CollsvcError` naming it and that error), all at the same call, so the group stays in step and
usable.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import numpy as np

from collsvc.errors import AuthenticationError, CollsvcError, ResourceLimitError


class ArrayCollectives(Protocol):
    """What object collectives need of a communicator (the Communicator is one)."""

    rank: int
    size: int

    def broadcast(self, x: Any, src: int = ..., *, out: Any = ..., async_op: bool = ...) -> Any: ...

    def all_gather(self, x: Any, *, out: Any = ..., async_op: bool = ...) -> Any: ...


def _check_allowed(allowed: bool) -> None:
    if allowed:
        return
    raise AuthenticationError(
        "object collectives unpickle only data from authenticated peers, and this job has neither a token nor "
        "TLS: set COLLSVC_TOKEN (or init(token=...)), or set COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE=1 to accept "
        "the risk"
    )


# Receivers allocate what the senders advertise, so every advertised length is checked first: a forged or
# corrupt length must not make each rank allocate it (the lengths are the same on every rank, so all
# ranks refuse together).
MAX_OBJECT_BYTES = 1 << 30


# The longest error text a rank that failed to pickle sends (its message, cut).
MAX_ERROR_BYTES = 4096


def _sizes(lengths: np.ndarray, what: str) -> np.ndarray:
    """The byte count each rank sends: a length as is; a failure ``-1 - n`` as its ``n`` bytes of text.

    Raises:
        ResourceLimitError: a size is over the limits (a forged or corrupt length).
    """
    sizes = np.where(lengths < 0, -1 - lengths, lengths)
    total = int(sizes.max(initial=0)) * sizes.size  # all_gather_object pads every row to the longest
    failed_too_long = bool(((lengths < 0) & (sizes > MAX_ERROR_BYTES)).any())
    if total > MAX_OBJECT_BYTES or failed_too_long:
        raise ResourceLimitError(
            f"{what}: pickled objects of {lengths.tolist()} bytes exceed the limit of {MAX_OBJECT_BYTES} bytes "
            f"(or a failure's text is over {MAX_ERROR_BYTES} bytes)"
        )
    return sizes


class _Payload:
    """What one rank sends: its pickled object, or the text of the error pickling raised."""

    def __init__(self, obj: Any) -> None:
        self.error: BaseException | None = None
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - whatever pickling raises, the others must hear of it
            self.error = exc
            data = f"{type(exc).__name__}: {exc}".encode(errors="replace")[:MAX_ERROR_BYTES]
        self.bytes = np.frombuffer(data, dtype=np.uint8)

    @property
    def length(self) -> int:
        """The length to announce: the byte count, or ``-1 - n`` for ``n`` bytes of error text."""
        return self.bytes.size if self.error is None else -1 - self.bytes.size


def _failed(what: str, rank: int, text: bytes) -> CollsvcError:
    return CollsvcError(f"{what}: rank {rank} could not pickle its object ({text.decode(errors='replace')})")


def broadcast_object(comm: ArrayCollectives, obj: Any, src: int, *, allowed: bool) -> Any:
    """``src``'s object on every rank; ``allowed``: peers are authenticated or the user opted in.

    Raises:
        AuthenticationError: not ``allowed``.
        ResourceLimitError: an advertised length is over :data:`MAX_OBJECT_BYTES`.
        CollsvcError: on the other ranks, ``src`` could not pickle its object (the message names it
            and its error); on ``src`` itself, pickle's own error (``TypeError``, ``PicklingError`` ...).
    """
    _check_allowed(allowed)
    sent = _Payload(obj) if comm.rank == src else None
    length = comm.broadcast(np.array([sent.length if sent else 0], dtype=np.int64), src)
    size = int(_sizes(length, "broadcast_object")[0])
    payload = sent.bytes if sent is not None else np.empty(size, dtype=np.uint8)
    data = comm.broadcast(payload, src)
    if sent is not None:
        if sent.error is not None:
            raise sent.error
        return obj
    if int(length[0]) < 0:
        raise _failed("broadcast_object", src, data.tobytes())
    return pickle.loads(data.tobytes())


def all_gather_object(comm: ArrayCollectives, obj: Any, *, allowed: bool) -> list[Any]:
    """Every rank's object in rank order; ``allowed`` as in :func:`broadcast_object`.

    Raises:
        AuthenticationError / ResourceLimitError: as :func:`broadcast_object`.
        CollsvcError: some rank could not pickle its object (the message names the first and its
            error); on that rank itself, pickle's own error.
    """
    _check_allowed(allowed)
    sent = _Payload(obj)
    lengths = comm.all_gather(np.array([sent.length], dtype=np.int64))
    sizes = _sizes(lengths, "all_gather_object")
    width = int(sizes.max())
    padded = np.zeros(width, dtype=np.uint8)
    padded[: sent.bytes.size] = sent.bytes
    rows = comm.all_gather(padded).reshape(comm.size, width)
    if sent.error is not None:
        raise sent.error
    for r in range(comm.size):
        if int(lengths[r]) < 0:
            raise _failed("all_gather_object", r, rows[r, : int(sizes[r])].tobytes())
    return [obj if r == comm.rank else pickle.loads(rows[r, : int(sizes[r])].tobytes()) for r in range(comm.size)]
