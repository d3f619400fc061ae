"""CPU tensors as numpy arrays, for the collectives whose numpy path is faster than DLPack's."""

from __future__ import annotations

import numpy as np
import torch


def host_array(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a dense, C-contiguous CPU tensor of a dtype numpy has (no copy; detached from
    autograd, as the collectives' tensors are), else None: repeated collectives of numpy arrays take the
    Communicator's fast path (``client/fast_path.py``)."""
    if not tensor.is_cpu or tensor.dtype not in _NUMPY_DTYPES or tensor.layout != torch.strided:
        return None
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_neg() or (tensor.dtype in _COMPLEX and tensor.is_conj()):
        return None  # lazily negated or conjugated views: their memory does not hold their values
    array = tensor.numpy()
    return array if array.flags.c_contiguous else None


# torch dtypes whose CPU tensors Tensor.numpy() views (bfloat16 has no numpy dtype).
_NUMPY_DTYPES = frozenset(
    {
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
_COMPLEX = frozenset({torch.complex64, torch.complex128})
