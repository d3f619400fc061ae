"""A numpy-backed ``Tensor`` with MindSpore's constructor, ``asnumpy()`` and printing."""

from __future__ import annotations

from typing import Any

import numpy as np

bool_ = np.bool_
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8 = np.uint8
float16, float32, float64 = np.float16, np.float32, np.float64


class Tensor:
    """MindSpore's ``Tensor(input_data, dtype=None)`` over a numpy array.

    ``str()`` is the values (as ``print(tensor)`` shows them in MindSpore's PyNative mode), ``repr()``
    MindSpore's ``Tensor(shape=[...], dtype=..., value=...)``.
    """

    def __init__(self, input_data: Any = None, dtype: Any = None) -> None:
        if isinstance(input_data, Tensor):
            input_data = input_data.asnumpy()
        self._array = np.array(input_data, dtype=dtype)

    def asnumpy(self) -> np.ndarray[Any, Any]:
        """The values as a numpy array (the same memory)."""
        return self._array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def dtype(self) -> Any:
        return self._array.dtype

    def __str__(self) -> str:
        return str(self._array)

    def __repr__(self) -> str:
        name = self._array.dtype.name.capitalize().replace("Bool", "Bool")
        return f"Tensor(shape={list(self._array.shape)}, dtype={name}, value=\n{self._array})"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        return self._array if dtype is None else self._array.astype(dtype)

    def __eq__(self, other: object) -> Any:
        return Tensor(self._array == np.asarray(other))

    __hash__ = None  # type: ignore[assignment]
