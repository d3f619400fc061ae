"""Bagua's ``bagua.torch_api`` on collsvc: the communication functions of seed 002 and ``with_bagua``.

Follows seed 002 (``bagua.torch_api.communication``)::

    import collsvc.compat.bagua as bagua
    from collsvc.compat.bagua.algorithms import gradient_allreduce, bytegrad

    bagua.init_process_group()
    model = model.with_bagua([optimizer], gradient_allreduce.GradientAllReduceAlgorithm())

Importing it imports torch and gives every ``torch.nn.Module`` a ``with_bagua`` method (as importing
Bagua does): parameters and buffers are broadcast from rank 0, and each optimizer's ``step`` first
reduces the gradients with the algorithm. Works on CPU and CUDA tensors (Bagua itself was CUDA-only).

Left out, and why: Bagua's other algorithms (decentralized, QAdam, async model average) and its
autotuner, bucketing and overlap of communication with backward: the reduction runs as one fused
call per dtype just before the step, which gives the same gradients; ``stream=`` arguments are
accepted and ignored. Errors are collsvc's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from collsvc.compat.bagua import algorithms
from collsvc.compat.bagua.communication import *  # noqa: F403 - Bagua's torch_api re-exports them
from collsvc.compat.bagua.communication import BaguaProcessGroup, _get_default_group
from collsvc.compat.bagua.communication import __all__ as _communication_all

__all__ = [*_communication_all, "algorithms", "with_bagua"]


def with_bagua(
    self: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    algorithm: algorithms.Algorithm,
    process_group: BaguaProcessGroup | None = None,
    do_flatten: bool = True,
) -> torch.nn.Module:
    """Makes ``self`` train data-parallel with ``algorithm``; returns ``self``.

    Every rank's parameters and buffers start as rank 0's, and each of ``optimizers``' ``step`` reduces
    the gradients of its parameters across the group first.

    Raises:
        CollsvcError: ``init_process_group`` was not called. TypeError: ``algorithm`` is not one.
    """
    if not isinstance(algorithm, algorithms.Algorithm):
        raise TypeError(f"algorithm must be a Bagua algorithm, got {type(algorithm).__name__}")
    group = process_group or _get_default_group()
    comm = group._comm
    if comm is None:
        return self  # not a member of the group: trains alone, as in Bagua
    with torch.no_grad():
        tensors = [t for t in [*self.parameters(), *self.buffers()]]
        for bucket in algorithms.base.by_dtype(tensors):
            flats = [t.data.view(-1) if t.is_contiguous() else t.data for t in bucket]
            comm.broadcast(flats, 0, out=flats)
    for optimizer in optimizers:
        _reduce_before_step(optimizer, algorithm, comm)
    self.bagua_algorithm = algorithm  # type: ignore[assignment]
    return self


def _reduce_before_step(optimizer: torch.optim.Optimizer, algorithm: algorithms.Algorithm, comm: Any) -> None:
    step = optimizer.step

    def reduced_step(*args: Any, **kwargs: Any) -> Any:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            algorithm.reduce(grads, comm)
        return step(*args, **kwargs)

    optimizer.step = reduced_step  # type: ignore[method-assign]


torch.nn.Module.with_bagua = with_bagua  # type: ignore[attr-defined]
