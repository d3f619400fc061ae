"""The ring backend's collective algorithms: pure functions over a :class:`Channel` of one call.

Arrays are flat, contiguous numpy arrays of one of the dtypes in :data:`collsvc.types.DTYPE_CODES`;
ranks are group indices. Each function sends and receives the frames of exactly one call and leaves
``ch.flush()`` to the caller. Every rank must call the same function with the same lengths, dtype,
op, root and tuning arguments: the shape alone decides the algorithm, the block boundaries, the chunk
boundaries and the frame step ids (see ``algorithms_common`` for the step-id scheme), so ranks agree
without talking. AVG is reduced as SUM; the caller divides with
:func:`~collsvc.client.backends.reduction.finish_average`.

Which algorithm:

- ``all_reduce``: recursive doubling up to ``small_bytes``, else a pipelined ring reduce-scatter +
  all-gather. The small path sends the whole payload in each of ``log2 n`` (+2) rounds; the ring sends
  ``2(n-1)/n`` of it over ``2(n-1)`` rounds. With one gRPC frame costing ~0.1-0.7 ms and bulk bytes
  ~1 GB/s, the crossover sits where a payload costs about as much as a few round trips: tens of KiB.
  ``small_bytes`` defaults to 64 KiB by that reasoning; it is a parameter so the real transport's
  measurement can move it.
- ``broadcast`` / ``reduce``: binomial trees up to ``small_bytes``, else pipelined chains.
- ``reduce_scatter`` / ``all_gather``: ring. ``gather`` / ``scatter`` / ``all_to_all`` / ``send`` /
  ``recv``: direct messages.

Results are bit-identical on every rank: every element of a reduction is computed once (ring, chains,
trees) or by both partners from the same operands in the same order (recursive doubling).
"""

from __future__ import annotations

import numpy as np

from collsvc.client.backends.base import Channel
from collsvc.client.backends.reduction import check_reducible
from collsvc.client.backends.ring.algorithms_common import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_SMALL_BYTES,
    elements_per_chunk,
)
from collsvc.client.backends.ring.algorithms_direct import (
    direct_all_to_all,
    direct_gather,
    direct_recv,
    direct_scatter,
    direct_send,
    dissemination_barrier,
)
from collsvc.client.backends.ring.algorithms_ring import (
    chain_broadcast,
    chain_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from collsvc.client.backends.ring.algorithms_tree import doubling_all_reduce, tree_broadcast, tree_reduce
from collsvc.types import ReduceOp

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_SMALL_BYTES",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]


def _check_root(ch: Channel, root: int, what: str) -> None:
    if not 0 <= root < ch.size:
        raise ValueError(f"{what} must be a group index in [0, {ch.size}), got {root}")


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return a.nbytes == b.nbytes and (a.nbytes == 0 or a.ctypes.data == b.ctypes.data)


def all_reduce(
    ch: Channel,
    buf: np.ndarray,
    op: ReduceOp,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    small_bytes: int = DEFAULT_SMALL_BYTES,
) -> None:
    """Reduces ``buf`` elementwise across the group, in place, with the same bits on every rank.

    Args:
        ch: the call's channel.
        buf: this rank's contribution; holds the reduction on return.
        op: the reduction (AVG is reduced as SUM; divide afterwards).
        chunk_bytes: the most payload bytes per frame (rounded down to whole elements, at least one).
        small_bytes: payloads of at most this many bytes use recursive doubling, larger ones the ring.

    Raises:
        TypeError: ``op`` does not apply to ``buf``'s dtype.
        ValueError: ``chunk_bytes`` is not positive, or so small the call needs over 2**26 frames.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    check_reducible(op, buf.dtype)
    per_chunk = elements_per_chunk(buf.dtype, chunk_bytes)
    if ch.size == 1:
        return
    if buf.nbytes <= small_bytes:
        doubling_all_reduce(ch, buf, op, per_chunk)
    else:
        ring_all_reduce(ch, buf, op, per_chunk)


def reduce_scatter(
    ch: Channel, src: np.ndarray, out: np.ndarray, op: ReduceOp, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> None:
    """Rank ``r`` gets block ``r`` of the elementwise reduction of every rank's ``src``.

    Args:
        ch: the call's channel.
        src: ``size * len(out)`` elements; only read.
        out: receives this rank's block; may be exactly ``src``'s block ``rank``.
        op: the reduction (AVG is reduced as SUM).
        chunk_bytes: the most payload bytes per frame.

    Raises:
        TypeError: ``op`` does not apply to the dtype, or ``src`` and ``out`` dtypes differ.
        ValueError: the lengths do not match, or bad ``chunk_bytes``.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    check_reducible(op, out.dtype)
    _check_pair(src, out, src.shape[0] == ch.size * out.shape[0], "src must have size * len(out) elements")
    per_chunk = elements_per_chunk(out.dtype, chunk_bytes)
    width = out.shape[0]
    own = src[ch.rank * width : (ch.rank + 1) * width]
    if ch.size == 1:
        out[...] = src
        return
    if np.may_share_memory(src, out) and not _same_memory(own, out):
        src = src.copy()
    ring_reduce_scatter(ch, src, out, op, per_chunk)


def all_gather(ch: Channel, src: np.ndarray, out: np.ndarray, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """``out`` becomes the concatenation of every rank's ``src`` in rank order (ring).

    Args:
        ch: the call's channel.
        src: this rank's contribution (may be ``out``'s block ``rank``).
        out: ``size * len(src)`` elements.
        chunk_bytes: the most payload bytes per frame.

    Raises:
        TypeError: the dtypes differ.
        ValueError: the lengths do not match, or bad ``chunk_bytes``.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    _check_pair(src, out, out.shape[0] == ch.size * src.shape[0], "out must have size * len(src) elements")
    per_chunk = elements_per_chunk(out.dtype, chunk_bytes)
    width = src.shape[0]
    out[ch.rank * width : (ch.rank + 1) * width] = src
    if ch.size > 1:
        ring_all_gather(ch, out, per_chunk)


def broadcast(
    ch: Channel,
    buf: np.ndarray,
    root: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    small_bytes: int = DEFAULT_SMALL_BYTES,
) -> None:
    """Copies ``root``'s ``buf`` into ``buf`` on every rank, in place.

    Args:
        ch: the call's channel.
        buf: the data on ``root``; overwritten elsewhere.
        root: group index of the source.
        chunk_bytes: the most payload bytes per frame.
        small_bytes: payloads of at most this many bytes use a binomial tree, larger ones a chain.

    Raises:
        ValueError: ``root`` is out of range, or bad ``chunk_bytes``.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    _check_root(ch, root, "root")
    per_chunk = elements_per_chunk(buf.dtype, chunk_bytes)
    if ch.size == 1:
        return
    if buf.nbytes <= small_bytes:
        tree_broadcast(ch, buf, root, per_chunk)
    else:
        chain_broadcast(ch, buf, root, per_chunk)


def reduce(
    ch: Channel,
    buf: np.ndarray,
    op: ReduceOp,
    root: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    small_bytes: int = DEFAULT_SMALL_BYTES,
) -> None:
    """Leaves the elementwise reduction of every rank's ``buf`` in ``buf`` on ``root``.

    Args:
        ch: the call's channel.
        buf: this rank's contribution; on ``root`` the result, elsewhere clobbered as scratch.
        op: the reduction (AVG is reduced as SUM).
        root: group index that gets the result.
        chunk_bytes: the most payload bytes per frame.
        small_bytes: payloads of at most this many bytes use a binomial tree, larger ones a chain.

    Raises:
        TypeError: ``op`` does not apply to the dtype.
        ValueError: ``root`` is out of range, or bad ``chunk_bytes``.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    check_reducible(op, buf.dtype)
    _check_root(ch, root, "root")
    per_chunk = elements_per_chunk(buf.dtype, chunk_bytes)
    if ch.size == 1:
        return
    if buf.nbytes <= small_bytes:
        tree_reduce(ch, buf, op, root, per_chunk)
    else:
        chain_reduce(ch, buf, op, root, per_chunk)


def gather(
    ch: Channel, src: np.ndarray, out: np.ndarray | None, root: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> None:
    """``root``'s ``out`` becomes the concatenation of every rank's ``src`` in rank order.

    Args:
        ch: the call's channel.
        src: this rank's contribution.
        out: ``size * len(src)`` elements on ``root``; ignored (may be None) elsewhere.
        root: group index that gets the result.
        chunk_bytes: the most payload bytes per frame.

    Raises:
        TypeError: the dtypes differ.
        ValueError: ``root`` is out of range, ``out`` is missing or the wrong length on ``root``.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    _check_root(ch, root, "root")
    if ch.rank == root:
        if out is None:
            raise ValueError("gather needs an output array on the root")
        _check_pair(src, out, out.shape[0] == ch.size * src.shape[0], "out must have size * len(src) elements")
    direct_gather(ch, src, out, root, elements_per_chunk(src.dtype, chunk_bytes))


def scatter(
    ch: Channel, src: np.ndarray | None, out: np.ndarray, root: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> None:
    """Rank ``r``'s ``out`` becomes block ``r`` of ``root``'s ``src``.

    Args:
        ch: the call's channel.
        src: ``size * len(out)`` elements on ``root``; ignored (may be None) elsewhere.
        out: receives this rank's block.
        root: group index that holds the data.
        chunk_bytes: the most payload bytes per frame.

    Raises:
        TypeError: the dtypes differ.
        ValueError: ``root`` is out of range, ``src`` is missing or the wrong length on ``root``.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    _check_root(ch, root, "root")
    if ch.rank == root:
        if src is None:
            raise ValueError("scatter needs an input array on the root")
        _check_pair(src, out, src.shape[0] == ch.size * out.shape[0], "src must have size * len(out) elements")
    direct_scatter(ch, src, out, root, elements_per_chunk(out.dtype, chunk_bytes))


def all_to_all(ch: Channel, src: np.ndarray, out: np.ndarray, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Block ``j`` of rank ``i``'s ``src`` becomes block ``i`` of rank ``j``'s ``out``.

    Args:
        ch: the call's channel.
        src: ``size`` equal blocks (may overlap ``out``; it is then copied first).
        out: as long as ``src``.
        chunk_bytes: the most payload bytes per frame.

    Raises:
        TypeError: the dtypes differ.
        ValueError: the lengths differ or are not divisible by the group size.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    ok = src.shape[0] == out.shape[0] and src.shape[0] % ch.size == 0
    _check_pair(src, out, ok, "src and out must have the same length, divisible by the group size")
    direct_all_to_all(ch, src, out, elements_per_chunk(out.dtype, chunk_bytes))


def send(ch: Channel, buf: np.ndarray, dst: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Sends ``buf`` to group index ``dst`` (matched by one :func:`recv` there).

    Args:
        ch: the call's channel.
        buf: the data; free to reuse on return (the channel copied it).
        dst: the receiver's group index.
        chunk_bytes: the most payload bytes per frame.

    Raises:
        ValueError: ``dst`` is out of range, or bad ``chunk_bytes``.
    """
    _check_root(ch, dst, "dst")
    direct_send(ch, buf, dst, elements_per_chunk(buf.dtype, chunk_bytes))


def recv(ch: Channel, out: np.ndarray, src: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Receives into ``out`` what :func:`send` sent from group index ``src``.

    Args:
        ch: the call's channel.
        out: receives the data; its length must match the sender's.
        src: the sender's group index.
        chunk_bytes: the most payload bytes per frame (must equal the sender's).

    Raises:
        ValueError: ``src`` is out of range, or bad ``chunk_bytes``.
        CollectiveMismatchError: the sender's array has a different size.
        CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    _check_root(ch, src, "src")
    direct_recv(ch, out, src, elements_per_chunk(out.dtype, chunk_bytes))


def barrier(ch: Channel) -> None:
    """Returns once every member of ``ch`` entered (empty frames, ``ceil(log2 n)`` rounds).

    Raises:
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    dissemination_barrier(ch)


def _check_pair(src: np.ndarray, out: np.ndarray, lengths_ok: bool, message: str) -> None:
    if src.dtype != out.dtype:
        raise TypeError(f"src and out dtypes differ: {src.dtype} and {out.dtype}")
    if not lengths_ok:
        raise ValueError(f"{message} (got {src.shape[0]} and {out.shape[0]})")
