"""all_reduce of sparse COO tensors (``nn.Embedding(sparse=True)`` gradients under DDP), as gloo does it.

Each rank's coalesced (indices, values) are all-gathered, padded to the longest rank's entry count,
and every rank sums the concatenation in rank order: the same entries in the same order everywhere,
so every rank gets the same result. The caller's tensor is replaced by the sum, in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from collsvc.torch._work import Finished
from collsvc.types import ReduceOp

if TYPE_CHECKING:  # imported by collsvc itself at run time, in its own order
    from collsvc.client.communicator import Communicator


def is_sparse(tensors: list[torch.Tensor]) -> bool:
    """Whether any tensor has a layout other than strided (dense)."""
    return any(t.layout != torch.strided for t in tensors)


def _padded(rows: torch.Tensor, length: int) -> torch.Tensor:
    if rows.shape[0] == length:
        return rows
    pad = rows.new_zeros((length - rows.shape[0], *rows.shape[1:]))
    return torch.cat([rows, pad])


def all_reduce(
    comm: Communicator, tensors: list[torch.Tensor], op: ReduceOp, factor: Any
) -> tuple[list[Any], list[torch.Tensor], None]:
    """Sums one sparse COO tensor across the group, in place (PREMUL_SUM scales it first).

    Runs on the caller's thread; the returned parts are already finished.

    Raises:
        ValueError: more than one tensor, another sparse layout, or an op other than SUM / PREMUL_SUM.
        CollsvcError: the gathers failed (a dead rank, a timeout, a mismatch).
    """
    if len(tensors) != 1:
        raise ValueError("a sparse all_reduce takes exactly one tensor")
    tensor = tensors[0]
    if tensor.layout != torch.sparse_coo:
        raise ValueError(f"the collsvc backend reduces dense and sparse COO tensors, not {tensor.layout}")
    if op is not ReduceOp.SUM:
        raise ValueError(f"a sparse all_reduce supports SUM and PREMUL_SUM, not {op.name} (as on gloo)")
    local = tensor.detach().coalesce()
    indices = local.indices().t().contiguous()  # (entries, sparse dims)
    values = local.values().contiguous()  # (entries, *dense dims)
    if factor is not None:
        values = values * factor
    counts = [int(c) for c in comm.all_gather(np.array([indices.shape[0]], np.int64))]
    longest = max(counts)
    if longest > 0:
        all_indices = torch.as_tensor(comm.all_gather(_padded(indices, longest)))
        all_values = torch.as_tensor(comm.all_gather(_padded(values, longest)))
        keep = torch.cat([torch.arange(r * longest, r * longest + c) for r, c in enumerate(counts)])
        # Checked: a rank whose tensor has another size sends indices out of this one's range.
        entries = (all_indices[keep].t(), all_values[keep], local.size())
        summed = torch.sparse_coo_tensor(*entries, check_invariants=True).coalesce()
    else:
        summed = local
    with torch.no_grad():
        tensor.copy_(summed)
    return [Finished(None)], [tensor], None
