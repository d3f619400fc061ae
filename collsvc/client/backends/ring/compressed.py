"""all_reduce and reduce_scatter with a lossy wire (``compression=``): pure functions over a Channel.

The ring backend runs these among the members whose frames cross hosts: the host leaders of a
hierarchical all_reduce (the reduce and broadcast within each host stay exact), or every member of a
flat group over several hosts. One algorithm serves every codec (``compression.py``), and each value
is quantized exactly twice whatever the number of members, so the error bound does not grow with it:

1. scale by ``1 / world`` (the whole group's size), as torch's fp16/bf16 compress hooks do: the sum of
   scaled values cannot overflow where the mean does not;
2. encode each of the ``n`` blocks and all_to_all them: member ``b`` gets every member's block ``b``;
3. decode and sum them in the working dtype (float32, float64 for float64 arrays) in member order;
4. encode that sum; all_gather the encoded sums; every member decodes every block, its own included,
   so every member holds the same bits;
5. multiply by ``world`` again for SUM (AVG keeps the mean).

reduce_scatter stops after step 3: its block becomes ``decode(encode(sum))``, what every member would
hold of it after an all_gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from collsvc.client.backends.base import Channel
from collsvc.client.backends.ring import algorithms
from collsvc.client.backends.ring.compression import Codec, working_dtype


@dataclass(frozen=True)
class Wire:
    """How a call's cross-host frames are compressed: the codec, the whole group's size (the scale),
    and whether the call averages (AVG) rather than sums."""

    codec: Codec
    world: int
    average: bool

    @property
    def unscale(self) -> float:
        return 1.0 if self.average else float(self.world)


def _scaled_blocks(src: np.ndarray, n: int, width: int, world: int) -> np.ndarray:
    """``src`` in the working dtype, divided by ``world``, zero-padded to ``n`` blocks of ``width``."""
    work = np.empty(n * width, working_dtype(src.dtype))
    count = src.shape[0]
    work[count:] = 0
    if src.dtype == work.dtype:  # one pass over the (large) payload
        np.multiply(src, 1.0 / world, out=work[:count])
    else:
        work[:count] = src
        work[:count] *= 1.0 / world
    return work


def _unscaled_into(result: np.ndarray, out: np.ndarray, wire: Wire) -> None:
    """``out`` becomes ``result`` (working dtype) times ``wire.unscale``, in ``out``'s dtype."""
    if out.dtype == result.dtype:
        np.multiply(result, wire.unscale, out=out)
        return
    if wire.unscale != 1.0:
        result *= wire.unscale
    out[...] = result


def _reduce_own_block(ch: Channel, work: np.ndarray, width: int, wire: Wire) -> np.ndarray:
    """Steps 2-3: every member's block ``ch.rank`` of ``work``, decoded and summed in member order."""
    n, codec = ch.size, wire.codec
    size = codec.encoded_bytes(width, work.dtype)
    sent = np.empty(n * size, np.uint8)
    for b in range(n):
        codec.encode(work[b * width : (b + 1) * width], sent[b * size : (b + 1) * size])
    got = np.empty_like(sent)
    algorithms.all_to_all(ch, sent, got)
    total = np.empty(width, work.dtype)
    part = np.empty(width, work.dtype)
    codec.decode(got[:size], total)
    for b in range(1, n):
        codec.decode(got[b * size : (b + 1) * size], part)
        total += part
    return total


def all_reduce(ch: Channel, buf: np.ndarray, wire: Wire) -> None:
    """The sum (or mean, ``wire.average``) of every member's ``buf``, in place, over a lossy wire.

    ``buf`` holds this member's contribution scaled as the whole group's: the host sum of a
    hierarchical all_reduce, divided like every other by ``wire.world``.

    Raises:
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    n, codec = ch.size, wire.codec
    width = -(-buf.shape[0] // n)
    work = _scaled_blocks(buf, n, width, wire.world)
    total = _reduce_own_block(ch, work, width, wire)
    size = codec.encoded_bytes(width, work.dtype)
    gathered = np.empty(n * size, np.uint8)
    mine = gathered[ch.rank * size : (ch.rank + 1) * size]
    codec.encode(total, mine)
    algorithms.all_gather(ch, mine, gathered)
    for b in range(n):
        codec.decode(gathered[b * size : (b + 1) * size], work[b * width : (b + 1) * width])
    _unscaled_into(work[: buf.shape[0]], buf, wire)


def reduce_scatter(ch: Channel, src: np.ndarray, out: np.ndarray, wire: Wire) -> None:
    """Block ``ch.rank`` of the sum (or mean) of every member's ``src`` into ``out``, over a lossy wire.

    Raises:
        ValueError: ``src`` is not ``ch.size`` blocks of ``len(out)``.
        CollectiveMismatchError, CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    n, codec, width = ch.size, wire.codec, out.shape[0]
    if src.shape[0] != n * width:
        raise ValueError(f"src must have size * len(out) elements (got {src.shape[0]} and {width})")
    work = _scaled_blocks(src, n, width, wire.world)
    total = _reduce_own_block(ch, work, width, wire)
    encoded = np.empty(codec.encoded_bytes(width, work.dtype), np.uint8)
    codec.encode(total, encoded)
    codec.decode(encoded, total)
    _unscaled_into(total, out, wire)
