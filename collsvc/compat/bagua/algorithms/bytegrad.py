"""Bagua's ``ByteGradAlgorithm``: gradients exchanged as 8-bit codes (Bagua's MinMaxUInt8).

The flattened gradients are cut into one chunk per rank. Each chunk is compressed with its own min and
max: ``scale = 255 / (max - min + eps)``, ``upper = round(max * scale)``, ``lower = upper - 255``,
``code = clamp(round(x * scale), lower, upper) - lower`` as uint8; decompressed as
``(code + lower) / scale``. A reduce-scatter of the codes (an all_to_all of the compressed chunks, each
rank decompressing and summing the chunk it owns), then an all-gather of the recompressed sums, gives
every rank the same gradients. Each element's error is at most about half a step, (max - min) / 510,
per compression, of its chunk's range (two compressions per exchange).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from collsvc import Communicator, ReduceOp
from collsvc.compat.bagua.algorithms.base import Algorithm, by_dtype

EPS = 1e-7
HEADER = 8  # bytes: the chunk's min and max as float32


def compress(rows: torch.Tensor) -> torch.Tensor:
    """MinMaxUInt8 of each row of a float32 ``(k, c)`` tensor: ``(k, 8 + c)`` uint8 (min, max, codes)."""
    low = rows.min(dim=1).values
    high = rows.max(dim=1).values
    scale = 255.0 / (high - low + EPS)
    upper = torch.round(high * scale)
    lower = upper - 255.0
    level = torch.round(rows * scale[:, None]).clamp(lower[:, None], upper[:, None])
    codes = (level - lower[:, None]).to(torch.uint8)
    header = torch.stack([low, high], dim=1).contiguous().view(torch.uint8)
    return torch.cat([header, codes], dim=1)


def decompress(packed: torch.Tensor) -> torch.Tensor:
    """The float32 ``(k, c)`` values of :func:`compress`'s ``(k, 8 + c)`` output."""
    header = packed[:, :HEADER].contiguous().view(torch.float32)
    low, high = header[:, 0], header[:, 1]
    scale = 255.0 / (high - low + EPS)
    lower = torch.round(high * scale) - 255.0
    return (packed[:, HEADER:].to(torch.float32) + lower[:, None]) / scale[:, None]


def compressed_all_reduce(flat: torch.Tensor, comm: Communicator, average: bool) -> torch.Tensor:
    """Sum (or mean) of ``flat`` (float32, 1-d) over ``comm``, exchanged as 8-bit codes."""
    n = comm.size
    length = flat.numel()
    chunk = max(1, -(-length // n))
    padded = torch.zeros(n * chunk, dtype=torch.float32, device=flat.device)
    padded[:length] = flat
    mine = comm.all_to_all(compress(padded.view(n, chunk)))  # row j: rank j's codes of my chunk
    total = decompress(mine).sum(dim=0, keepdim=True)
    if average:
        total /= n
    everyone = comm.all_gather(compress(total))
    return decompress(everyone).reshape(-1)[:length]


class ByteGradAlgorithm(Algorithm):
    """8-bit compressed all-reduce of the gradients before each step (float gradients; others exact).

    Args:
        hierarchical: across hosts, reduce exactly on each host first and compress only between one
            rank per host (Bagua's default). On one host there is nothing to compress between, so the
            ranks of the host exchange codes as with ``hierarchical=False``.
        average: average (True) or sum the gradients.
    """

    def __init__(self, hierarchical: bool = True, average: bool = True) -> None:
        self.hierarchical = hierarchical
        self.average = average

    def reduce(self, grads: Sequence[torch.Tensor], comm: Communicator) -> None:
        for bucket in by_dtype(grads):
            if not bucket[0].is_floating_point():
                comm.all_reduce(bucket, ReduceOp.AVG if self.average else ReduceOp.SUM, out=bucket)
                continue
            flat = torch.cat([g.reshape(-1).to(torch.float32) for g in bucket])
            if self.hierarchical and comm.num_nodes > 1:
                intra = comm.intra_node
                intra.all_reduce(flat, ReduceOp.SUM, out=flat)
                if intra.rank == 0:
                    flat = compressed_all_reduce(flat, comm.inter_node, average=False)
                intra.broadcast(flat, 0, out=flat)
                if self.average:
                    flat /= comm.size
            else:
                flat = compressed_all_reduce(flat, comm, self.average)
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
