"""Bagua's ``ByteGradAlgorithm``: gradients exchanged as 8-bit codes (Bagua's MinMaxUInt8).

The float gradients of each dtype are flattened and all-reduced with ``compression="minmax_uint8"``:
per chunk a min and a max, one uint8 code per value on the wire; an all_to_all of the codes (each rank
decompresses and sums the block it owns), then an all_gather of the recompressed sums, so every rank
gets the same gradients. Each element's error is at most half a code step, ``(max - min) / 510`` of
its chunk, per compression (two per exchange); docs/api.md has the bound.

collsvc compresses only the frames that cross hosts: within a host the reduction is exact (Bagua's
``hierarchical=True`` across hosts, and on one host nothing is compressed at all), so ``hierarchical``
is accepted and changes nothing. GPU gradients on the NCCL backend, which moves them exactly, are
reduced through host memory to be compressed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from collsvc import Communicator, ReduceOp
from collsvc.compat.bagua.algorithms.base import Algorithm, by_dtype


def compressed_all_reduce(flat: torch.Tensor, comm: Communicator, average: bool) -> torch.Tensor:
    """Sum (or mean) of ``flat`` (a float tensor) over ``comm``, exchanged across hosts as 8-bit codes."""
    host = flat.cpu() if flat.is_cuda and comm.backend == "nccl" else flat
    result: torch.Tensor = comm.all_reduce(host, ReduceOp.AVG if average else ReduceOp.SUM, compression="minmax_uint8")
    return result.to(flat.device)


class ByteGradAlgorithm(Algorithm):
    """8-bit compressed all-reduce of the gradients before each step (float gradients; others exact).

    Args:
        hierarchical: Bagua's switch between compressing among every rank or among one rank per host;
            collsvc always reduces exactly within a host and compresses between hosts.
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
            flat = compressed_all_reduce(torch.cat([g.reshape(-1) for g in bucket]), comm, self.average)
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
