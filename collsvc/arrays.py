"""Adapting user arrays (numpy, CuPy, anything with ``__dlpack__``) to working arrays and back.

A collective works on an :class:`Adapted` array: a numpy array (CPU, or a CUDA array staged to the
host for the ring backend) or a CuPy array (for NCCL), with the *logical* dtype name the signature
uses. bfloat16 travels as ml_dtypes' numpy bfloat16, or as a 16-bit view where the array library has
no bfloat16 (CuPy). Results go back as the caller's kind, on the caller's device, zero-copy where the
producer allows.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from collsvc.types import BFLOAT16, dtype_name

_DL_CPU = 1
_DL_CUDA = 2


@dataclass(frozen=True)
class Adapted:
    """A user's array as collsvc works on it.

    Attributes:
        array: numpy or CuPy array (same shape as the input; bfloat16 on CuPy as a uint16 view).
        dtype: logical dtype name ("float32", "bfloat16", ...).
        kind: "numpy", "cupy" or the DLPack producer's top-level module name (e.g. "torch").
        on_gpu: the user's array lives on a CUDA device.
        source: the user's object.
        shape: ``array``'s shape (a tuple of ints).
    """

    array: Any
    dtype: str
    kind: str
    on_gpu: bool
    source: Any
    shape: tuple[int, ...]


def _module_of(obj: Any) -> str:
    return type(obj).__module__.split(".", 1)[0]


def _is_cupy(obj: Any) -> bool:
    return _module_of(obj) == "cupy" and type(obj).__name__ == "ndarray"


def _torch_bf16(obj: Any) -> bool:
    return _module_of(obj) == "torch" and str(getattr(obj, "dtype", "")) == "torch.bfloat16"


def adapt(x: Any, *, name: str = "array") -> Adapted:
    """Wraps ``x`` for a collective without copying where possible.

    Raises:
        TypeError: ``x`` is not a numpy/CuPy array or a DLPack producer, or its dtype is unsupported.
    """
    if isinstance(x, np.ndarray):
        return Adapted(x, dtype_name(x.dtype), "numpy", False, x, x.shape)
    if isinstance(x, np.generic):
        arr = np.asarray(x)
        arr.flags.writeable = False  # a numpy scalar is immutable: as out, it is refused, not silently dropped
        return Adapted(arr, dtype_name(arr.dtype), "numpy", False, x, arr.shape)
    if _is_cupy(x):
        return Adapted(x, _cupy_dtype_name(x), "cupy", True, x, tuple(x.shape))
    if _module_of(x) == "torch":
        host = torch_cpu_view(x)
        if host is not None:
            return Adapted(host, dtype_name(host.dtype), "torch", False, x, host.shape)
        device_view = _torch_cuda_view(x)
        if device_view is not None:
            name = "bfloat16" if _torch_bf16(x) else _cupy_dtype_name(device_view)
            return Adapted(device_view, name, "torch", True, x, tuple(device_view.shape))
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type = int(x.__dlpack_device__()[0])
        bf16 = _torch_bf16(x)
        producer = x
        if bf16:
            import torch  # the caller's own array library; present because x is a torch tensor

            producer = x.view(torch.int16)
        if device_type == _DL_CPU:
            arr = np.from_dlpack(producer)
            if bf16:
                if BFLOAT16 is None:
                    raise TypeError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes")
                arr = arr.view(BFLOAT16)
            return Adapted(arr, dtype_name(arr.dtype), _module_of(x), False, x, arr.shape)
        if device_type == _DL_CUDA:
            import cupy

            arr = cupy.from_dlpack(producer)
            return Adapted(arr, "bfloat16" if bf16 else _cupy_dtype_name(arr), _module_of(x), True, x, tuple(arr.shape))
        raise TypeError(f"{name}: DLPack device type {device_type} is not supported (CPU and CUDA are)")
    raise TypeError(
        f"{name} must be a numpy array, a CuPy array or an object with __dlpack__ (a torch tensor, say); "
        f"got {type(x).__name__}"
    )


# The CPU torch dtypes numpy has (bfloat16 and the quantized and bit-packed ones it lacks), by name.
_TORCH_HOST_DTYPE_NAMES = (
    "float16", "float32", "float64", "complex64", "complex128", "bool",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
)  # fmt: skip
# The same by torch's dtype object -> numpy's, and torch's strided layout: filled from the first tensor
# seen (this module never imports torch itself).
_TORCH_HOST_DTYPES: dict[Any, np.dtype] = {}
_TORCH_STRIDED: list[Any] = []


def _learn_torch(x: Any) -> None:
    torch = sys.modules[type(x).__module__.split(".", 1)[0]]
    for name in _TORCH_HOST_DTYPE_NAMES:
        if hasattr(torch, name):
            _TORCH_HOST_DTYPES[getattr(torch, name)] = np.dtype(name)
    _TORCH_STRIDED.append(torch.strided)


class _TensorMemory:
    """A CPU tensor's memory as numpy's array interface, holding the tensor: the base of a view made by
    :func:`torch_cpu_view`, which keeps the tensor alive as long as the view."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, interface: dict[str, Any], tensor: Any) -> None:
        self.__array_interface__ = interface
        self.tensor = tensor


def torch_cpu_view(x: Any, *, owning: bool = True) -> np.ndarray | None:
    """A numpy view of a CPU torch tensor's memory (no copy), or None where that does not apply: CUDA,
    bfloat16 or another dtype numpy lacks, autograd, conjugate or negated views, sparse layouts.

    The view is made from the tensor's address, shape and strides through numpy's array interface,
    not with ``Tensor.numpy()``: that marks the tensor's storage as never resizable again (so a
    collective would break ``resize_`` and the storage freeing FSDP does, which gloo leaves alone), and
    costs twice as much. It keeps the tensor alive, unless ``owning`` is False: then whoever uses the
    view must hold the tensor meanwhile (a cache of views that must not keep tensors alive).
    """
    if not _TORCH_STRIDED:
        _learn_torch(x)
    dtype = _TORCH_HOST_DTYPES.get(x.dtype)
    if dtype is None or not x.is_cpu or x.requires_grad or x.layout is not _TORCH_STRIDED[0]:
        return None
    if x.is_conj() or x.is_neg():
        return None
    try:
        address = x.data_ptr()  # raises for tensor subclasses without storage of their own
    except RuntimeError:
        return None
    itemsize = dtype.itemsize
    interface = {
        "data": (address, False),
        "shape": tuple(x.shape),
        "strides": tuple(stride * itemsize for stride in x.stride()),
        "typestr": dtype.str,
        "version": 3,
    }
    view: np.ndarray = np.asarray(_TensorMemory(interface, x if owning else None))
    return view


# How many tensors' views each thread keeps for :func:`kept_torch_view` (then it starts over).
_KEPT_VIEWS = 32


class _KeptViews(threading.local):
    """Per thread: id(tensor) -> (a weak reference to it, its address, shape, strides, dtype, and a
    view that does not keep it alive). A training loop passes the same few tensors over and over:
    making a view costs ~5 us a call, checking a kept one under 1 us."""

    def __init__(self) -> None:
        self.views: dict[int, tuple[Any, int, Any, Any, Any, np.ndarray]] = {}


_kept = _KeptViews()


def kept_torch_view(x: Any, *, detach: bool = False) -> np.ndarray | None:
    """A C-contiguous numpy view of the CPU torch tensor ``x`` (as :func:`torch_cpu_view` makes it), kept
    from an earlier call on this thread while ``x`` is the same object at the same address with the same
    shape, strides and dtype; None for anything else (not a torch tensor, CUDA, a dtype numpy lacks, not
    C-contiguous, autograd unless ``detach``).

    The view does not keep ``x`` alive: the caller holds ``x`` while it uses the view (a synchronous call).
    ``detach``: a tensor that requires grad is viewed through its detached alias (the torch backend's
    collectives work on data, as torch's own backends do).
    """
    views = _kept.views
    kept = views.get(id(x))
    if kept is not None:
        ref, address, shape, strides, dtype, view = kept
        if ref() is x and x.data_ptr() == address and x.shape == shape and x.stride() == strides and x.dtype is dtype:
            return view
    if _module_of(x) != "torch":
        return None
    made = torch_cpu_view(x.detach() if detach and x.requires_grad else x, owning=False)
    if made is None or not made.flags.c_contiguous:
        return None
    if len(views) >= _KEPT_VIEWS:
        views.clear()
    views[id(x)] = (weakref.ref(x), x.data_ptr(), x.shape, x.stride(), x.dtype, made)
    return made


def as_torch_like(result: np.ndarray, like: Any) -> Any:
    """A new host ``result`` as a tensor of ``like``'s library (a torch CPU tensor, no copy): what the
    general path's ``from_host`` returns for it."""
    return sys.modules[_module_of(like)].from_numpy(result)


# torch dtypes a CUDA tensor may be viewed as directly, as the CuPy dtype of the view (bfloat16: its bits).
_TORCH_CUDA_VIEW_DTYPES = {
    "torch.float32": "float32", "torch.float64": "float64", "torch.float16": "float16", "torch.bfloat16": "int16",
    "torch.int8": "int8", "torch.uint8": "uint8", "torch.int16": "int16", "torch.int32": "int32",
    "torch.int64": "int64", "torch.bool": "bool", "torch.complex64": "complex64", "torch.complex128": "complex128",
}  # fmt: skip


def _torch_cuda_view(x: Any) -> Any:
    """A CuPy array over a contiguous CUDA torch tensor's memory, made directly, or None where DLPack must
    make it: another layout or dtype, autograd, a conjugate view, no elements, or torch's current stream
    (or device) is not CuPy's.

    DLPack's import costs ~50 us a call in torch's Python ``__dlpack__``, most of a small GPU collective.
    What DLPack adds beyond the pointer is ordering: it makes the consumer's stream wait for torch's
    current one. When the two are the same stream (as the torch backend arranges, and as both libraries'
    default streams are) there is nothing to order, so the direct view is exact.
    """
    if x.device.type != "cuda" or x.requires_grad or not x.is_contiguous() or x.numel() == 0 or x.is_conj():
        return None
    dtype = _TORCH_CUDA_VIEW_DTYPES.get(str(x.dtype))
    torch_c = getattr(sys.modules.get("torch"), "_C", None)
    raw_stream = getattr(torch_c, "_cuda_getCurrentRawStream", None)
    if dtype is None or raw_stream is None:
        return None
    import cupy

    device = int(x.device.index)
    if cupy.cuda.runtime.getDevice() != device or int(raw_stream(device)) != cupy.cuda.get_current_stream().ptr:
        return None
    memory = cupy.cuda.UnownedMemory(x.data_ptr(), x.numel() * x.element_size(), x, device)
    return cupy.ndarray(tuple(x.shape), dtype, cupy.cuda.MemoryPointer(memory, 0))


def _cupy_dtype_name(arr: Any) -> str:
    return dtype_name(np.dtype(arr.dtype))


def is_writable(array: Any) -> bool:
    """Whether the backends may write into ``array`` (numpy's ``writeable`` flag; CuPy arrays have no
    read-only mode, and CuPy's flags object has no such attribute)."""
    return bool(getattr(array.flags, "writeable", True))


def to_host(a: Adapted) -> np.ndarray:
    """The array as numpy with its logical dtype (a copy to the host for GPU arrays)."""
    if not a.on_gpu:
        return np.asarray(a.array)
    import cupy

    host = cupy.asnumpy(a.array)
    if a.dtype == "bfloat16" and BFLOAT16 is not None:
        host = host.view(BFLOAT16)
    return np.asarray(host)


def from_host(result: np.ndarray, like: Adapted) -> Any:
    """``result`` (numpy) as the kind and device of ``like``.

    Raises:
        TypeError: the producer's library cannot take a DLPack array back.
    """
    if like.kind == "numpy":
        return result
    if like.on_gpu:
        import cupy

        raw = result.view(np.uint16) if like.dtype == "bfloat16" else result
        device_result = cupy.asarray(raw)
        return device_result if like.kind == "cupy" else _to_producer(device_result, like)
    raw = result.view(np.int16) if like.dtype == "bfloat16" else result
    return _to_producer(raw, like)


def from_device(result: Any, like: Adapted) -> Any:
    """A CuPy ``result`` as the kind of ``like`` (a CUDA array of the caller's library)."""
    if like.kind == "cupy":
        return result
    return _to_producer(result, like)


def _to_producer(raw: Any, like: Adapted) -> Any:
    module = sys.modules.get(like.kind)
    converter = getattr(module, "from_dlpack", None) if module is not None else None
    if converter is None:
        raise TypeError(f"cannot return the result as a {like.kind} array: {like.kind}.from_dlpack is missing")
    out = converter(raw)
    if like.dtype == "bfloat16" and like.kind == "torch":
        import torch

        out = out.view(torch.bfloat16)
    return out


def write_into(out: Any, result: Any, *, name: str = "out") -> None:
    """Copies ``result`` (numpy or CuPy) into the user's ``out`` array.

    Raises:
        ValueError: ``out`` has a different shape than the result.
        TypeError: ``out`` has a different dtype, or is not a supported array.
    """
    target = adapt(out, name=name)
    if target.shape != tuple(result.shape):
        raise ValueError(f"{name} has shape {target.shape}, the result has shape {tuple(result.shape)}")
    result_dtype = "bfloat16" if BFLOAT16 is not None and result.dtype == BFLOAT16 else str(result.dtype)
    if target.dtype != result_dtype and not (target.dtype == "bfloat16" and result_dtype in ("uint16", "int16")):
        raise TypeError(f"{name} has dtype {target.dtype}, the result has dtype {result_dtype}")
    if target.on_gpu:
        import cupy

        src = (
            result
            if _is_cupy(result)
            else cupy.asarray(result.view(np.uint16) if result_dtype == "bfloat16" else result)
        )
        target.array[...] = src.view(target.array.dtype)
        return
    if isinstance(result, np.ndarray):
        host = result
    else:
        host = to_host(Adapted(result, target.dtype, "cupy", True, result, tuple(result.shape)))
    np.copyto(target.array, host.view(target.array.dtype) if host.dtype != target.array.dtype else host)


def check_out_shape(
    out: Any, shape: tuple[int, ...], dtype: str, *, name: str = "out", adapted: Adapted | None = None
) -> Adapted:
    """Validates ``out`` against the result's shape and dtype before anything is sent (``adapted``:
    ``out`` already adapted, if the caller has it).

    Raises:
        ValueError: wrong shape.
        TypeError: wrong dtype or unsupported kind.
    """
    target = adapted if adapted is not None else adapt(out, name=name)
    if target.shape != shape:
        raise ValueError(f"{name} has shape {target.shape}, the result needs shape {shape}")
    if target.dtype != dtype:
        raise TypeError(f"{name} has dtype {target.dtype}, the result has dtype {dtype}")
    return target
