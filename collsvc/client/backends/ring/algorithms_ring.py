"""Bandwidth-optimal pipelined algorithms: ring all-reduce, reduce-scatter and all-gather, and the
chains that broadcast from and reduce to a root.

Every loop runs chunk by chunk so a chunk moves on to the next rank as soon as it was reduced here,
and a rank never waits for a whole block. Sends never block (the channel buffers frames), so each rank
may send its round-0 chunks before receiving anything and no ordering of ranks can deadlock.
Reductions write into the destination array through ``out=``; nothing is allocated per chunk.

Each block of a reduction is reduced exactly once, along the ring, and then copied, so every rank ends
with the same bits.
"""

from __future__ import annotations

import numpy as np

from collsvc.client.backends.base import Channel
from collsvc.client.backends.reduction import reduce_into, reduce_to
from collsvc.client.backends.ring.algorithms_common import (
    PHASE_BCAST_CHAIN,
    PHASE_REDUCE_CHAIN,
    PHASE_RING,
    block_bounds,
    check_steps,
    chunk_count,
    chunk_slice,
    land_into,
    recv_array,
    recv_into,
    send_array,
    step_id,
)
from collsvc.types import ReduceOp


def ring_pass(
    ch: Channel,
    buf: np.ndarray,
    op: ReduceOp | None,
    reduce_rounds: int,
    copy_rounds: int,
    per_chunk: int,
) -> None:
    """The shared ring loop over ``size`` blocks of ``buf`` (``numpy.array_split`` boundaries).

    In round ``k`` rank ``r`` sends block ``(r - k) % n`` to its right neighbour and receives block
    ``(r - k - 1) % n`` from its left one; the first ``reduce_rounds`` rounds reduce what arrives into
    ``buf`` (own OP incoming; ``op`` is None only when there are none), the following ``copy_rounds``
    rounds copy it. The block received in
    round ``k`` is the one sent in round ``k + 1``, chunk by chunk (frames of ``per_chunk`` elements).

    Raises:
        ValueError: the call would need more frame steps than fit in a frame header.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    n, r = ch.size, ch.rank
    rounds = reduce_rounds + copy_rounds
    bounds = block_bounds(buf.shape[0], n)
    counts = [chunk_count(bounds[b + 1] - bounds[b], per_chunk) for b in range(n)]
    per_round = max(counts)
    check_steps(rounds, per_round)
    right, left = (r + 1) % n, (r - 1) % n
    dtype = buf.dtype

    def part(block: int, chunk: int) -> slice:
        return chunk_slice(bounds[block], bounds[block + 1], chunk, per_chunk)

    # A copy round's block is final where it arrives, and this rank last read its own version of that
    # block before sending it on in an earlier round, which the arriving bytes causally follow: the
    # transport may read those frames straight into ``buf``.
    for k in range(reduce_rounds, rounds):
        incoming_block = (r - k - 1) % n
        for c in range(counts[incoming_block]):
            land_into(ch, left, step_id(PHASE_RING, k * per_round + c), buf[part(incoming_block, c)])
    for k in range(rounds):
        incoming_block = (r - k - 1) % n
        for c in range(per_round):
            if k == 0 and c < counts[r]:
                send_array(ch, right, step_id(PHASE_RING, c), buf[part(r, c)])
            if c >= counts[incoming_block]:
                continue
            where = part(incoming_block, c)
            step = step_id(PHASE_RING, k * per_round + c)
            if k < reduce_rounds and op is not None:
                reduce_into(op, buf[where], recv_array(ch, left, step, dtype, where.stop - where.start))
            else:
                recv_into(ch, left, step, buf[where])
            if k + 1 < rounds:
                send_array(ch, right, step_id(PHASE_RING, (k + 1) * per_round + c), buf[where])


def ring_all_reduce(ch: Channel, buf: np.ndarray, op: ReduceOp, per_chunk: int) -> None:
    """In-place all-reduce: ring reduce-scatter then ring all-gather, pipelined by chunk.

    Raises:
        ValueError, CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: as
            :func:`ring_pass`.
    """
    ring_pass(ch, buf, op, ch.size - 1, ch.size - 1, per_chunk)


def ring_all_gather(ch: Channel, out: np.ndarray, per_chunk: int) -> None:
    """Ring all-gather within ``out``, whose block ``rank`` already holds this rank's contribution.

    Raises:
        ValueError, CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: as
            :func:`ring_pass`.
    """
    ring_pass(ch, out, None, 0, ch.size - 1, per_chunk)


def ring_reduce_scatter(ch: Channel, src: np.ndarray, out: np.ndarray, op: ReduceOp, per_chunk: int) -> None:
    """Ring reduce-scatter: ``out`` gets block ``rank`` of the reduction of every rank's ``src``.

    ``src`` is only read. In round ``k`` rank ``r`` sends the partial of block ``(r - k - 1) % n``
    and receives that of block ``(r - k - 2) % n``, so after ``n - 1`` rounds it holds block ``r``.
    Partials live in one chunk of scratch: a chunk is reduced and sent on before the next arrives.
    ``out`` may be exactly ``src``'s block ``rank`` (that block is read only in the last round).

    Raises:
        ValueError, CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: as
            :func:`ring_pass`.
    """
    n, r = ch.size, ch.rank
    width = out.shape[0]
    rounds = n - 1
    per_round = chunk_count(width, per_chunk)
    check_steps(rounds, per_round)
    right, left = (r + 1) % n, (r - 1) % n
    scratch = np.empty(min(per_chunk, width), dtype=out.dtype)

    def part(block: int, chunk: int) -> slice:
        return chunk_slice(block * width, (block + 1) * width, chunk, per_chunk)

    first = (r - 1) % n
    for k in range(rounds):
        block = (r - k - 2) % n
        for c in range(per_round):
            if k == 0:
                send_array(ch, right, step_id(PHASE_RING, c), src[part(first, c)])
            where = part(block, c)
            size = where.stop - where.start
            incoming = recv_array(ch, left, step_id(PHASE_RING, k * per_round + c), out.dtype, size)
            if k + 1 < rounds:
                partial = scratch[:size]
                reduce_to(op, partial, src[where], incoming)
                send_array(ch, right, step_id(PHASE_RING, (k + 1) * per_round + c), partial)
            else:
                mine = chunk_slice(0, width, c, per_chunk)
                reduce_to(op, out[mine], src[where], incoming)


def chain_broadcast(ch: Channel, buf: np.ndarray, root: int, per_chunk: int) -> None:
    """Pipelined chain from ``root`` around the ring: each rank forwards a chunk once it arrived.

    Raises:
        ValueError, CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: as
            :func:`ring_pass`.
    """
    n, r = ch.size, ch.rank
    virtual = (r - root) % n
    length = buf.shape[0]
    chunks = chunk_count(length, per_chunk)
    check_steps(1, chunks)
    right, left = (r + 1) % n, (r - 1) % n
    if virtual > 0:  # every chunk arrives before this rank reads it (to pass it on)
        for c in range(chunks):
            land_into(ch, left, step_id(PHASE_BCAST_CHAIN, c), buf[chunk_slice(0, length, c, per_chunk)])
    for c in range(chunks):
        where = chunk_slice(0, length, c, per_chunk)
        if virtual > 0:
            recv_into(ch, left, step_id(PHASE_BCAST_CHAIN, c), buf[where])
        if virtual < n - 1:
            send_array(ch, right, step_id(PHASE_BCAST_CHAIN, c), buf[where])


def chain_reduce(ch: Channel, buf: np.ndarray, op: ReduceOp, root: int, per_chunk: int) -> None:
    """Pipelined chain towards ``root``: the rank before ``root`` starts, each adds its own and passes on.

    ``buf`` on every rank but ``root`` is left holding a partial result.

    Raises:
        ValueError, CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: as
            :func:`ring_pass`.
    """
    n, r = ch.size, ch.rank
    virtual = (r - root) % n
    length = buf.shape[0]
    chunks = chunk_count(length, per_chunk)
    check_steps(1, chunks)
    toward, away = (r - 1) % n, (r + 1) % n
    for c in range(chunks):
        where = chunk_slice(0, length, c, per_chunk)
        if virtual < n - 1:
            step = step_id(PHASE_REDUCE_CHAIN, c)
            reduce_into(op, buf[where], recv_array(ch, away, step, buf.dtype, where.stop - where.start))
        if virtual > 0:
            send_array(ch, toward, step_id(PHASE_REDUCE_CHAIN, c), buf[where])
