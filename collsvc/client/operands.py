"""A user's array, adapted once at the edge, with the buffer state of one collective.

An :class:`Operand` is what a collective works on: the caller's array (``x``), where its result goes
(``out``, ``out is x`` for in place, or None for a new array), and whether the work happens on the GPU
(CuPy, when the job's backend is NCCL and the array lives there) or on the host (numpy; CUDA arrays are
staged). Work buffers are flat and contiguous. A :class:`Buffer` says whether it *is* the caller's
``out`` memory, in which case nothing is copied back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from collsvc.arrays import (
    Adapted,
    adapt,
    check_out_shape,
    from_device,
    from_host,
    is_writable,
    to_host,
    write_into,
)
from collsvc.types import numpy_dtype


def empty(shape: tuple[int, ...], dtype: str, on_device: bool) -> Any:
    """A new array of ``shape`` and ``dtype``, on the GPU (CuPy) or the host (numpy)."""
    if on_device:
        import cupy

        return cupy.empty(shape, dtype=np.uint16 if dtype == "bfloat16" else numpy_dtype(dtype))
    return np.empty(shape, dtype=numpy_dtype(dtype))


def _contiguous(array: Any, on_device: bool) -> Any:
    if on_device:
        import cupy

        return cupy.ascontiguousarray(array)
    return np.ascontiguousarray(array)


def _copy(array: Any, on_device: bool) -> Any:
    if on_device:
        import cupy

        return cupy.array(array, copy=True, order="C")
    return np.array(array, copy=True, order="C")


@dataclass(frozen=True)
class Buffer:
    """A flat work buffer; ``is_out``: it is the caller's ``out`` memory (the result is already there)."""

    array: Any
    is_out: bool = False


def check_writable(target: Adapted, name: str = "out") -> None:
    """Refuses a read-only ``out`` before anything is sent, rather than after the exchange.

    Raises:
        ValueError: ``out`` is a host array whose ``writeable`` flag is off, or a numpy scalar.
    """
    if isinstance(target.source, np.generic):
        raise ValueError(f"{name} is a numpy scalar, which cannot be written: pass a 0-d array (np.array(x)) as {name}")
    if not target.on_gpu and not target.array.flags.writeable:
        raise ValueError(
            f"{name} is read-only (its writeable flag is False): pass a writable array as {name}, "
            f"or leave {name} out to get a new array"
        )


class Operand:
    """The caller's ``x`` (adapted), its ``out``, and where the work happens.

    Attributes:
        adapted: ``x`` adapted once (:func:`collsvc.arrays.adapt`); ``out_adapted`` likewise ``out``.
        x: the caller's array, as given (``out is x`` means in place).
        out: where the result goes, or None for a new array of ``x``'s kind.
        on_device: the work runs on the GPU (NCCL); else on host copies or views.
        shape / dtype: ``x``'s shape and logical dtype name.
    """

    __slots__ = ("adapted", "x", "out", "on_device", "out_adapted", "shape", "dtype")

    def __init__(self, adapted: Adapted, x: Any, out: Any, on_device: bool, out_adapted: Adapted | None = None) -> None:
        self.adapted = adapted
        self.x = x
        self.out = out
        self.on_device = on_device
        self.out_adapted = out_adapted  # ``out`` adapted, when it is another array than ``x``
        self.shape: tuple[int, ...] = adapted.shape
        self.dtype: str = adapted.dtype

    @classmethod
    def of(cls, adapted: Adapted, x: Any, out: Any, on_device: bool) -> Operand:
        """An operand with ``out`` adapted once, here.

        Raises:
            TypeError: ``out`` is not a supported array.
        """
        out_adapted = adapt(out, name="out") if out is not None and out is not x else None
        return cls(adapted, x, out, on_device, out_adapted)

    @property
    def size(self) -> int:
        return int(self.adapted.array.size)

    @property
    def target(self) -> Adapted | None:
        """``out`` adapted, or None without ``out``."""
        if self.out is None:
            return None
        return self.adapted if self.out is self.x else self.out_adapted

    def check_out(self, shape: tuple[int, ...], *, in_place_allowed: bool) -> None:
        """Validates ``out`` against a result of ``shape`` before anything is sent.

        Raises:
            ValueError: wrong shape, or ``out`` is read-only.
            TypeError: wrong dtype or unsupported kind.
        """
        out = self.out
        if out is None:
            return
        if out is not self.x or not in_place_allowed:
            check_writable(check_out_shape(out, shape, self.dtype, adapted=self.target))
            return
        target = self.adapted
        if target.shape != shape:
            raise ValueError(f"out is x, but the result has shape {shape}, not {tuple(target.shape)}")
        check_writable(target)

    def source(self) -> Any:
        """``x``'s data where the work happens: the GPU array itself, or a host array (staged if needed)."""
        return self.adapted.array if self.on_device else to_host(self.adapted)

    def flat(self) -> Any:
        """A flat contiguous view of the input, for reading (copied only when not contiguous)."""
        return _contiguous(self.source(), self.on_device).reshape(-1)

    def _usable_in_place(self, array: Any, adapted: Adapted) -> bool:
        return (self.on_device or not adapted.on_gpu) and bool(array.flags.c_contiguous) and is_writable(array)

    def work_buffer(self) -> Buffer:
        """A flat buffer holding the input that the backend may overwrite with the result.

        ``out is x`` works in place; another contiguous ``out`` of the same kind receives a copy of the
        input and is worked on in place (no temporary, no second copy); otherwise a fresh copy.
        """
        array = self.source()
        if self.out is not None and self.out is self.x and self._usable_in_place(array, self.adapted):
            return Buffer(array.reshape(-1), is_out=True)
        if self.out is not None and self.out is not self.x:
            target = self.target
            assert target is not None  # out is set
            dest = target.array if self.on_device else to_host(target)
            if target.on_gpu == self.adapted.on_gpu and self._usable_in_place(dest, target):
                dest[...] = array
                return Buffer(dest.reshape(-1), is_out=True)
        return Buffer(_copy(array, self.on_device).reshape(-1))

    def landing_buffer(self, shape: tuple[int, ...]) -> Buffer:
        """A flat buffer for a result of ``shape`` that overwrites everything and reads no input
        (broadcast and scatter on non-source ranks): the caller's ``out`` (or ``x`` when ``out is x``)
        when usable, else a fresh array of ``shape``; nothing is copied in."""
        target = self.target
        if target is not None:
            dest = target.array if self.on_device else to_host(target)
            if target.on_gpu == self.adapted.on_gpu and self._usable_in_place(dest, target):
                return Buffer(dest.reshape(-1), is_out=True)
        return Buffer(self.empty(shape).reshape(-1))

    def result_buffer(self, shape: tuple[int, ...]) -> Buffer:
        """A flat buffer for a result of ``shape`` that the backend writes while it still reads the
        input (all_gather, reduce_scatter, gather, all_to_all): the caller's host ``out`` when usable
        and apart from the input (no temporary, no copy afterwards), else a fresh array."""
        target = self.target
        if target is not None and not self.on_device and not target.on_gpu:
            dest = to_host(target)
            if self._usable_in_place(dest, target) and not np.may_share_memory(dest, self.source()):
                return Buffer(dest.reshape(-1), is_out=True)
        return Buffer(self.empty(shape).reshape(-1))

    def empty(self, shape: tuple[int, ...]) -> Any:
        """A new array of ``shape`` and this operand's dtype, where the work happens."""
        return empty(shape, self.dtype, self.on_device)

    def finish(self, result: Any, *, is_out: bool = False, like: Adapted | None = None) -> Any:
        """The value the caller gets: ``out`` (filled with ``result`` unless ``is_out``), else ``result``
        as an array of the caller's kind (``like``'s, default ``x``'s)."""
        if self.out is not None:
            if not is_out:
                write_into(self.out, result)
            return self.out
        kind = like or self.adapted
        return from_device(result, kind) if self.on_device else from_host(result, kind)

    def finish_buffer(self, buffer: Buffer, shape: tuple[int, ...], *, like: Adapted | None = None) -> Any:
        """:meth:`finish` for a work, landing or result buffer, reshaped to ``shape``."""
        return self.finish(buffer.array.reshape(shape), is_out=buffer.is_out, like=like)
