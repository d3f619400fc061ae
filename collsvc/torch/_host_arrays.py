"""CPU tensors as numpy arrays, for the collectives whose numpy path is faster than DLPack's."""

from __future__ import annotations

import numpy as np
import torch

from collsvc.arrays import kept_torch_view, torch_cpu_view


def host_array(tensor: torch.Tensor, *, held: bool = False) -> np.ndarray | None:
    """A numpy view of a dense, C-contiguous CPU tensor of a dtype numpy has (no copy; detached from
    autograd, as the collectives' tensors are), else None: repeated collectives of numpy arrays take the
    Communicator's fast path (``client/fast_path.py``).

    ``held``: the caller holds ``tensor`` until the collective using the view has finished (a call run
    on the caller's thread), so the view may be one kept from an earlier call of the same tensor, which
    does not keep the tensor alive. The kept view is used only while the tensor is the same object at
    the same address with the same shape, strides and dtype.
    """
    if held:
        return kept_torch_view(tensor, detach=True)
    made = torch_cpu_view(tensor.detach() if tensor.requires_grad else tensor)
    return made if made is not None and made.flags.c_contiguous else None


def flat_host_arrays(
    input: torch.Tensor,  # noqa: A002 - torch's name
    output: torch.Tensor,
    *,
    held: bool = False,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Flat :func:`host_array` views of a collective's input and output tensors (``held`` as there), or
    None unless both have one (then the collective goes the DLPack way)."""
    host_input = host_array(input, held=held)
    if host_input is None:
        return None
    host_output = host_array(output, held=held)
    return None if host_output is None else (host_input.reshape(-1), host_output.reshape(-1))
