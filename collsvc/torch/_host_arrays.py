"""CPU tensors as numpy arrays, for the collectives whose numpy path is faster than DLPack's."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np
import torch

from collsvc.arrays import torch_cpu_view

# How many tensors' views each thread keeps for calls that hold their tensors (then it starts over).
_KEPT_VIEWS = 32


class _RecentViews(threading.local):
    """Per thread: id(tensor) -> (a weak reference to it, its address, shape, strides, dtype, and a
    view that does not keep it alive). A training loop passes the same few tensors over and over;
    making a view costs ~5 us a call, checking a kept one under 1 us."""

    def __init__(self) -> None:
        self.views: dict[int, tuple[Any, int, Any, Any, Any, np.ndarray]] = {}


_recent = _RecentViews()


def host_array(tensor: torch.Tensor, *, held: bool = False) -> np.ndarray | None:
    """A numpy view of a dense, C-contiguous CPU tensor of a dtype numpy has (no copy; detached from
    autograd, as the collectives' tensors are), else None: repeated collectives of numpy arrays take the
    Communicator's fast path (``client/fast_path.py``).

    ``held``: the caller holds ``tensor`` until the collective using the view has finished (a call run
    on the caller's thread), so the view may be one kept from an earlier call of the same tensor, which
    does not keep the tensor alive. The kept view is used only while the tensor is the same object at
    the same address with the same shape, strides and dtype.
    """
    views = _recent.views
    if held:
        kept = views.get(id(tensor))
        if kept is not None:
            ref, address, shape, strides, dtype, view = kept
            if (
                ref() is tensor
                and tensor.data_ptr() == address
                and tensor.shape == shape
                and tensor.stride() == strides
                and tensor.dtype is dtype
            ):
                return view
    made = torch_cpu_view(tensor.detach() if tensor.requires_grad else tensor, owning=not held)
    if made is None or not made.flags.c_contiguous:
        return None
    if held:
        if len(views) >= _KEPT_VIEWS:
            views.clear()
        views[id(tensor)] = (weakref.ref(tensor), tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, made)
    return made


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
