"""CPU tensors as numpy arrays, for the collectives whose numpy path is faster than DLPack's."""

from __future__ import annotations

import numpy as np
import torch

from collsvc.arrays import torch_cpu_view


def host_array(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a dense, C-contiguous CPU tensor of a dtype numpy has (no copy; detached from
    autograd, as the collectives' tensors are), else None: repeated collectives of numpy arrays take the
    Communicator's fast path (``client/fast_path.py``)."""
    view = torch_cpu_view(tensor.detach() if tensor.requires_grad else tensor)
    return view if view is not None and view.flags.c_contiguous else None
