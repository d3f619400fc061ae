"""Object collectives: pickled bytes carried by array collectives.

Unpickling runs code chosen by the sender, so it happens only when peers are authenticated (a job
token or mutual TLS) or the user opted in with ``COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE=1``. The check is
local and identical on every rank, so all ranks refuse together before any data moves.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import numpy as np

from collsvc.errors import AuthenticationError, ResourceLimitError


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


def _check_lengths(lengths: np.ndarray, what: str) -> None:
    total = int(lengths.max(initial=0)) * lengths.size  # all_gather_object pads every row to the longest
    if int(lengths.min(initial=0)) < 0 or total > MAX_OBJECT_BYTES:
        raise ResourceLimitError(
            f"{what}: pickled objects of {lengths.tolist()} bytes exceed the limit of {MAX_OBJECT_BYTES} bytes "
            "(or a length is negative)"
        )


def _dumps(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def broadcast_object(comm: ArrayCollectives, obj: Any, src: int, *, allowed: bool) -> Any:
    """``src``'s object on every rank; ``allowed``: peers are authenticated or the user opted in.

    Raises:
        AuthenticationError: not ``allowed``.
        ResourceLimitError: an advertised length is negative or over :data:`MAX_OBJECT_BYTES`.
    """
    _check_allowed(allowed)
    payload = _dumps(obj) if comm.rank == src else np.empty(0, dtype=np.uint8)
    length = comm.broadcast(np.array([payload.size], dtype=np.int64), src)
    _check_lengths(length, "broadcast_object")
    if comm.rank != src:
        payload = np.empty(int(length[0]), dtype=np.uint8)
    data = comm.broadcast(payload, src)
    return obj if comm.rank == src else pickle.loads(data.tobytes())


def all_gather_object(comm: ArrayCollectives, obj: Any, *, allowed: bool) -> list[Any]:
    """Every rank's object in rank order; ``allowed`` as in :func:`broadcast_object`.

    Raises:
        AuthenticationError / ResourceLimitError: as :func:`broadcast_object`.
    """
    _check_allowed(allowed)
    payload = _dumps(obj)
    lengths = comm.all_gather(np.array([payload.size], dtype=np.int64))
    _check_lengths(lengths, "all_gather_object")
    width = int(lengths.max())
    padded = np.zeros(width, dtype=np.uint8)
    padded[: payload.size] = payload
    rows = comm.all_gather(padded).reshape(comm.size, width)
    return [obj if r == comm.rank else pickle.loads(rows[r, : int(lengths[r])].tobytes()) for r in range(comm.size)]
