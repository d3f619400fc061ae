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


def flat_host_arrays(input: torch.Tensor, output: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:  # noqa: A002
    """Flat :func:`host_array` views of a collective's input and output tensors, or None unless both have
    one (then the collective goes the DLPack way)."""
    host_input = host_array(input)
    if host_input is None:
        return None
    host_output = host_array(output)
    return None if host_output is None else (host_input.reshape(-1), host_output.reshape(-1))
