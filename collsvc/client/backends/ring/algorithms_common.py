"""Shared pieces of the ring algorithms: frame step ids, block and chunk geometry, typed send/recv.

Step ids
--------
A step id labels one frame of one call between one (src, dst) pair; it must be unique per pair within
the call and both ends must compute it identically. Every algorithm uses::

    step = phase << 26 | round * chunks_per_round + chunk

``phase`` (6 bits, the ``PHASE_*`` constants) names the algorithm or stage, so ranks that somehow chose
different algorithms time out with a clear picture instead of reducing each other's garbage;
``round`` is the algorithm's round (ring round, tree level, or peer index); ``chunks_per_round`` is
the largest chunk count any block of the call has, computed from the shape alone. The whole id stays
below 2**32 (the frame header's u32); :func:`check_steps` rejects a call that would overflow it.

Chunks
------
Payloads are cut in whole elements, ``max(1, chunk_bytes // itemsize)`` per frame, so no element is
split across frames. An empty segment still travels as one empty frame: the receiver's transport
checks the sender's signature on it, so a size mismatch is reported instead of waited on.
"""

from __future__ import annotations

import numpy as np

from collsvc.client.backends.base import Channel, as_bytes_view
from collsvc.errors import CollectiveMismatchError

PHASE_RING = 1
PHASE_DOUBLING_FOLD = 2
PHASE_DOUBLING = 3
PHASE_DOUBLING_UNFOLD = 4
PHASE_BCAST_TREE = 5
PHASE_BCAST_CHAIN = 6
PHASE_REDUCE_TREE = 7
PHASE_REDUCE_CHAIN = 8
PHASE_GATHER = 9
PHASE_SCATTER = 10
PHASE_ALL_TO_ALL = 11
PHASE_P2P = 12
PHASE_BARRIER = 13

_INDEX_BITS = 26
_INDEX_LIMIT = 1 << _INDEX_BITS

# Payload bytes per frame of the pipelined algorithms. Frames cost per-frame work on both ends (a
# header, a wake-up, a reduction call), so fewer frames cost less CPU, while more of them overlap
# transfer and reduction better. Measured between two ranks over the bulk lane (all_reduce, float32,
# process CPU per call and p50 of `benchmarks/cross_host.py` at one rank per host, alternating):
# 1 MiB frames 10.1-10.4 ms CPU at 16 MiB and 16.5-19.1 ms p50, 2 MiB 7.6-7.9 ms and 13.5-13.7 ms,
# 4 MiB 7.1-7.6 ms CPU; at 64 MiB 1 MiB 58-68 ms p50, 2 MiB 55-63 ms. Shared-memory frame rings hold
# two frames of this size (``local_frames.RING_BYTES``).
DEFAULT_CHUNK_BYTES = 2 << 20
# Up to this many bytes, all_reduce/broadcast/reduce use the latency-friendly algorithms (recursive
# doubling, binomial trees) instead of the pipelined ring/chain. Measured over gRPC on loopback
# (COLLSVC_SHM=0 COLLSVC_RING_SMALL_BYTES=0 vs 1 GiB, `collsvc bench --op all_reduce`, float32):
#   2 ranks: doubling wins at every size 16 KiB..16 MiB (same bytes per rank, half the steps);
#   4 ranks: doubling 25.1 ms vs ring 34.6 ms at 1 MiB, ring 70.8 ms vs 85.1 ms at 4 MiB.
# Per-message overhead dominates below the crossover, so it sits between 1 and 4 MiB: 2 MiB.
DEFAULT_SMALL_BYTES = 2 << 20


def step_id(phase: int, index: int) -> int:
    """The frame step for ``index`` (``round * chunks_per_round + chunk``) in ``phase``."""
    return phase << _INDEX_BITS | index


def check_steps(rounds: int, chunks_per_round: int) -> None:
    """Raises ValueError when a call would need more step ids than a frame header can carry.

    Raises:
        ValueError: ``rounds * chunks_per_round`` does not fit in 26 bits; a larger ``chunk_bytes``
            fixes it.
    """
    if rounds * chunks_per_round > _INDEX_LIMIT:
        raise ValueError(
            f"{rounds} rounds of {chunks_per_round} chunks exceed the {_INDEX_LIMIT} frame steps of one "
            "call; use a larger chunk size"
        )


def elements_per_chunk(dtype: np.dtype, chunk_bytes: int) -> int:
    """Whole elements per frame for ``chunk_bytes`` (at least one).

    Raises:
        ValueError: ``chunk_bytes`` is not positive.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return max(1, chunk_bytes // dtype.itemsize)


def chunk_count(length: int, per_chunk: int) -> int:
    """Frames needed for ``length`` elements: at least one, so an empty segment still sends a frame."""
    return max(1, -(-length // per_chunk))


def block_bounds(total: int, parts: int) -> list[int]:
    """``parts + 1`` offsets splitting ``total`` elements like ``numpy.array_split``.

    The first ``total % parts`` blocks are one element longer; every rank computes the same bounds.
    """
    base, extra = divmod(total, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def chunk_slice(lo: int, hi: int, chunk: int, per_chunk: int) -> slice:
    """Elements of chunk ``chunk`` of the segment ``[lo, hi)``."""
    start = min(hi, lo + chunk * per_chunk)
    return slice(start, min(hi, start + per_chunk))


def send_array(ch: Channel, dst: int, step: int, array: np.ndarray) -> None:
    """Sends a contiguous array's bytes as one frame (the channel copies them out)."""
    ch.send(dst, step, as_bytes_view(array))


def recv_array(ch: Channel, src: int, step: int, dtype: np.dtype, count: int) -> np.ndarray:
    """Receives one frame as a read-only array of ``count`` elements of ``dtype``, without copying.

    Raises:
        CollectiveMismatchError: the frame does not hold exactly ``count`` elements although the calls
            agree (an internal fault: the signatures, shapes included, were checked first).
        CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    view = ch.recv(src, step)
    expected = count * dtype.itemsize
    if view.nbytes != expected:
        raise CollectiveMismatchError(
            f"internal fault: frame {step:#x} from group index {src} to {ch.rank} carries {view.nbytes} bytes, "
            f"expected {expected}, although the ranks' calls agree (every frame carries its sender's call "
            "signature, checked before its bytes): a fault in collsvc, not in your program; please report it"
        )
    return np.frombuffer(view, dtype=dtype, count=count)


def land_into(ch: Channel, src: int, step: int, out: np.ndarray) -> None:
    """Declares that frame ``step`` from ``src`` belongs in the contiguous ``out`` (``Channel.land``):
    only for memory this rank does not read before it receives that frame with :func:`recv_into`."""
    ch.land(src, step, as_bytes_view(out))


def recv_into(ch: Channel, src: int, step: int, out: np.ndarray) -> None:
    """Receives one frame into the contiguous 1-D ``out``: nothing to copy where it landed there.

    Raises:
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: as
            :func:`recv_array`.
    """
    incoming = recv_array(ch, src, step, out.dtype, out.shape[0])
    if incoming.__array_interface__["data"][0] != out.__array_interface__["data"][0]:
        out[...] = incoming


def send_chunked(ch: Channel, dst: int, phase: int, array: np.ndarray, per_chunk: int) -> None:
    """Sends ``array`` in frames of ``per_chunk`` elements, steps ``phase``/0..n-1."""
    length = array.shape[0]
    for chunk in range(chunk_count(length, per_chunk)):
        send_array(ch, dst, step_id(phase, chunk), array[chunk_slice(0, length, chunk, per_chunk)])


def recv_chunked(ch: Channel, src: int, phase: int, out: np.ndarray, per_chunk: int) -> None:
    """Receives what :func:`send_chunked` sent into ``out``.

    Raises:
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: as
            :func:`recv_array`.
    """
    length = out.shape[0]
    for chunk in range(chunk_count(length, per_chunk)):
        part = chunk_slice(0, length, chunk, per_chunk)
        width = part.stop - part.start
        out[part] = recv_array(ch, src, step_id(phase, chunk), out.dtype, width)
