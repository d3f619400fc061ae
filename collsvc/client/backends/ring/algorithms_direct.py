"""Direct algorithms, where every byte has exactly one destination: gather, scatter, all-to-all and
point-to-point. Each message goes straight from its owner to its reader, chunked.
"""

from __future__ import annotations

import numpy as np

from collsvc.client.backends.base import Channel
from collsvc.client.backends.ring.algorithms_common import (
    PHASE_ALL_TO_ALL,
    PHASE_BARRIER,
    PHASE_GATHER,
    PHASE_P2P,
    PHASE_SCATTER,
    check_steps,
    chunk_count,
    chunk_slice,
    recv_array,
    recv_chunked,
    send_array,
    send_chunked,
    step_id,
)


def direct_gather(ch: Channel, src: np.ndarray, out: np.ndarray | None, root: int, per_chunk: int) -> None:
    """Every rank sends ``src`` to ``root``, which stores rank ``i``'s in block ``i`` of ``out``.

    Raises:
        ValueError: ``out`` is None on ``root``, or too many frame steps.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    width = src.shape[0]
    check_steps(1, chunk_count(width, per_chunk))
    if ch.rank != root:
        send_chunked(ch, root, PHASE_GATHER, src, per_chunk)
        return
    if out is None:
        raise ValueError("gather needs an output array on the root")
    out[root * width : (root + 1) * width] = src
    for peer in range(ch.size):
        if peer != root:
            recv_chunked(ch, peer, PHASE_GATHER, out[peer * width : (peer + 1) * width], per_chunk)


def direct_scatter(ch: Channel, src: np.ndarray | None, out: np.ndarray, root: int, per_chunk: int) -> None:
    """``root`` sends block ``i`` of ``src`` to rank ``i``; every rank receives its block into ``out``.

    Raises:
        ValueError: ``src`` is None on ``root``, or too many frame steps.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    width = out.shape[0]
    check_steps(1, chunk_count(width, per_chunk))
    if ch.rank != root:
        recv_chunked(ch, root, PHASE_SCATTER, out, per_chunk)
        return
    if src is None:
        raise ValueError("scatter needs an input array on the root")
    for peer in range(ch.size):
        if peer != root:
            send_chunked(ch, peer, PHASE_SCATTER, src[peer * width : (peer + 1) * width], per_chunk)
    out[...] = src[root * width : (root + 1) * width]


def direct_all_to_all(ch: Channel, src: np.ndarray, out: np.ndarray, per_chunk: int) -> None:
    """Block ``j`` of this rank's ``src`` goes to rank ``j``; block ``i`` of ``out`` comes from rank ``i``.

    Peers are visited in shifted order (send to ``r + k``, receive from ``r - k``) so that in each
    round every rank both sends and receives one block, chunk by chunk.

    Raises:
        ValueError: too many frame steps.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    n, r = ch.size, ch.rank
    width = out.shape[0] // n
    chunks = chunk_count(width, per_chunk)
    check_steps(1, chunks)
    if np.may_share_memory(src, out):
        src = src.copy()  # an in-place all-to-all would receive over blocks not yet sent
    out[r * width : (r + 1) * width] = src[r * width : (r + 1) * width]
    for k in range(1, n):
        dst, peer = (r + k) % n, (r - k) % n
        for c in range(chunks):
            step = step_id(PHASE_ALL_TO_ALL, c)
            send_array(ch, dst, step, src[chunk_slice(dst * width, (dst + 1) * width, c, per_chunk)])
            where = chunk_slice(peer * width, (peer + 1) * width, c, per_chunk)
            out[where] = recv_array(ch, peer, step, out.dtype, where.stop - where.start)


def direct_send(ch: Channel, buf: np.ndarray, dst: int, per_chunk: int) -> None:
    """Sends ``buf`` to group index ``dst`` in chunks.

    Raises:
        ValueError: too many frame steps.
    """
    check_steps(1, chunk_count(buf.shape[0], per_chunk))
    send_chunked(ch, dst, PHASE_P2P, buf, per_chunk)


def direct_recv(ch: Channel, out: np.ndarray, src: int, per_chunk: int) -> None:
    """Receives what :func:`direct_send` sent into ``out``.

    Raises:
        ValueError: too many frame steps.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    check_steps(1, chunk_count(out.shape[0], per_chunk))
    recv_chunked(ch, src, PHASE_P2P, out, per_chunk)


def dissemination_barrier(ch: Channel) -> None:
    """Returns once every member entered: in round ``k`` member ``r`` sends an empty frame to
    ``r + 2**k`` and waits for the one from ``r - 2**k`` (mod n), so after ``ceil(log2 n)`` rounds
    each has heard, directly or not, from every other (Hensgen, Finkel and Manber's dissemination
    barrier). Every frame carries the call's signature: a member in another call is a mismatch.

    Raises:
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    n, r = ch.size, ch.rank
    empty = np.empty(0, np.uint8)
    distance, round_ = 1, 0
    while distance < n:
        send_array(ch, (r + distance) % n, step_id(PHASE_BARRIER, round_), empty)
        recv_array(ch, (r - distance) % n, step_id(PHASE_BARRIER, round_), empty.dtype, 0)
        distance, round_ = distance * 2, round_ + 1
