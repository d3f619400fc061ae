"""CPU tensors as numpy arrays, for the collectives whose numpy path is faster than DLPack's."""

from __future__ import annotations

from typing import Any

import torch


def host_array(tensor: torch.Tensor) -> Any:
    """A numpy view of a dense, contiguous CPU tensor of a dtype numpy has (no copy), else the tensor:
    repeated collectives of numpy arrays take the Communicator's fast path (``client/fast_path.py``)."""
    if (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and tensor.dtype in _NUMPY_DTYPES
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    ):
        return tensor.numpy()
    return tensor


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
