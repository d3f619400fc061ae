"""Latency-friendly algorithms for small payloads: recursive doubling and binomial trees.

They take ``O(log n)`` rounds where the ring takes ``2(n - 1)``, at the price of sending the whole
payload in each round, which is the right trade below a few tens of KiB (see ``algorithms.py``).
"""

from __future__ import annotations

import numpy as np

from collsvc.client.backends.base import Channel
from collsvc.client.backends.reduction import reduce_into, reduce_to
from collsvc.client.backends.ring.algorithms_common import (
    PHASE_BCAST_TREE,
    PHASE_DOUBLING,
    PHASE_DOUBLING_FOLD,
    PHASE_DOUBLING_UNFOLD,
    PHASE_REDUCE_TREE,
    check_steps,
    chunk_count,
    chunk_slice,
    recv_array,
    recv_chunked,
    send_array,
    send_chunked,
    step_id,
)
from collsvc.types import ReduceOp


def _combine(ch: Channel, peer: int, step: int, buf: np.ndarray, where: slice, op: ReduceOp, lower: bool) -> None:
    """Receives the peer's chunk and reduces it into ``buf`` as (lower rank's) OP (higher rank's).

    Both partners hold the same two operands and apply them in the same order, so they compute the
    same bits: this is what makes recursive doubling give identical results on every rank.
    """
    incoming = recv_array(ch, peer, step, buf.dtype, where.stop - where.start)
    mine = buf[where]
    if lower:
        reduce_to(op, mine, mine, incoming)
    else:
        reduce_to(op, mine, incoming, mine)


def doubling_all_reduce(ch: Channel, buf: np.ndarray, op: ReduceOp, per_chunk: int) -> None:
    """In-place all-reduce by recursive doubling, bit-identical on every rank.

    With ``p`` the largest power of two not above ``n``, ranks ``p..n-1`` first fold their data into
    ranks ``0..n-p-1`` and get the result back at the end; the ``p`` others exchange with the partner
    ``rank ^ mask`` for each bit of ``mask``, ``log2(p)`` rounds.

    Raises:
        ValueError: the call would need more frame steps than fit in a frame header.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    n, r = ch.size, ch.rank
    length = buf.shape[0]
    chunks = chunk_count(length, per_chunk)
    power = 1 << (n.bit_length() - 1)
    levels = power.bit_length() - 1
    check_steps(max(levels, 1), chunks)
    if r >= power:
        send_chunked(ch, r - power, PHASE_DOUBLING_FOLD, buf, per_chunk)
        recv_chunked(ch, r - power, PHASE_DOUBLING_UNFOLD, buf, per_chunk)
        return
    if r < n - power:
        for c in range(chunks):
            where = chunk_slice(0, length, c, per_chunk)
            _combine(ch, r + power, step_id(PHASE_DOUBLING_FOLD, c), buf, where, op, lower=True)
    for level in range(levels):
        partner = r ^ (1 << level)
        for c in range(chunks):
            where = chunk_slice(0, length, c, per_chunk)
            step = step_id(PHASE_DOUBLING, level * chunks + c)
            # The channel copies the chunk out before the reduction below overwrites it.
            send_array(ch, partner, step, buf[where])
            _combine(ch, partner, step, buf, where, op, lower=r < partner)
    if r < n - power:
        send_chunked(ch, r + power, PHASE_DOUBLING_UNFOLD, buf, per_chunk)


def tree_broadcast(ch: Channel, buf: np.ndarray, root: int, per_chunk: int) -> None:
    """Binomial-tree broadcast from ``root``: ``ceil(log2 n)`` rounds.

    Raises:
        ValueError, CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: as
            :func:`doubling_all_reduce`.
    """
    n, r = ch.size, ch.rank
    check_steps(1, chunk_count(buf.shape[0], per_chunk))
    virtual = (r - root) % n
    mask = 1
    while mask < n:
        if virtual & mask:
            recv_chunked(ch, (r - mask) % n, PHASE_BCAST_TREE, buf, per_chunk)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if virtual + mask < n:
            send_chunked(ch, (r + mask) % n, PHASE_BCAST_TREE, buf, per_chunk)
        mask >>= 1


def tree_reduce(ch: Channel, buf: np.ndarray, op: ReduceOp, root: int, per_chunk: int) -> None:
    """Binomial-tree reduction to ``root``; ``buf`` elsewhere is left holding a partial result.

    Raises:
        ValueError, CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: as
            :func:`doubling_all_reduce`.
    """
    n, r = ch.size, ch.rank
    length = buf.shape[0]
    chunks = chunk_count(length, per_chunk)
    check_steps(1, chunks)
    virtual = (r - root) % n
    mask = 1
    while mask < n:
        if virtual & mask:
            send_chunked(ch, (r - mask) % n, PHASE_REDUCE_TREE, buf, per_chunk)
            return
        if virtual + mask < n:
            child = (r + mask) % n
            for c in range(chunks):
                where = chunk_slice(0, length, c, per_chunk)
                incoming = recv_array(ch, child, step_id(PHASE_REDUCE_TREE, c), buf.dtype, where.stop - where.start)
                reduce_into(op, buf[where], incoming)
        mask <<= 1
