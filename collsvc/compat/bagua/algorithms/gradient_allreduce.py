"""Bagua's ``GradientAllReduceAlgorithm``: gradients summed (or averaged) over every rank."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from collsvc import Communicator, ReduceOp
from collsvc.compat.bagua.algorithms.base import Algorithm, by_dtype


class GradientAllReduceAlgorithm(Algorithm):
    """All-reduce of the gradients before each step.

    Args:
        hierarchical: reduce on each host first, then across one rank per host, then broadcast on
            each host (Bagua's hierarchical mode).
        average: average (True) or sum the gradients.
    """

    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        self.hierarchical = hierarchical
        self.average = average

    def reduce(self, grads: Sequence[torch.Tensor], comm: Communicator) -> None:
        for bucket in by_dtype(grads):
            if not self.hierarchical or comm.num_nodes == 1:
                comm.all_reduce(bucket, ReduceOp.AVG if self.average else ReduceOp.SUM, out=bucket)
                continue
            intra = comm.intra_node
            intra.all_reduce(bucket, ReduceOp.SUM, out=bucket)
            if intra.rank == 0:
                comm.inter_node.all_reduce(bucket, ReduceOp.SUM, out=bucket)
            intra.broadcast(bucket, 0, out=bucket)
            if self.average:
                for grad in bucket:
                    grad.div_(comm.size)
