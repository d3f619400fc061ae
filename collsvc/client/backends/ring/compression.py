"""Lossy wire codecs for the frames of a reduction that cross hosts: pure numpy, no channel.

A codec turns a block of values of the *working dtype* (float64 for float64 arrays, float32 for every
other float dtype: the dtype sums are taken in) into bytes and back. Encoding is deterministic, and so
is decoding: every rank that decodes the same bytes gets the same values, bit for bit.

- ``bf16`` / ``fp16``: each value rounded to nearest (even) bfloat16 or float16, as torch's
  ``bf16_compress_hook`` / ``fp16_compress_hook`` cast. Relative error at most 2**-8 (bfloat16: 8
  significant bits) or 2**-11 (float16: 11) of the value; float16 also overflows to inf above 65504 and
  loses relative precision below 2**-14 (subnormals, absolute error at most 2**-25). inf and nan stay
  what they are, element by element.
- ``minmax_uint8``: Bagua's MinMaxUInt8. Per chunk of :data:`CHUNK` values, the chunk's min and max
  (as the working dtype) and one uint8 code per value, ``round((x - min) / step)`` with ``step =
  (max - min) / 255``; decoded as ``min + code * step``. Error at most ``(max - min) / 510`` of the
  value's chunk, plus a few units in the last place of the chunk's largest magnitude. A chunk whose
  values are all equal decodes exactly. A chunk that holds inf or nan (or whose range overflows the
  working dtype) decodes as nan on every one of its elements. Bagua aligns its codes to multiples of
  the step and adds 1e-7 to the range; codes offset from the min keep its bound and make constant
  chunks exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from collsvc.types import BFLOAT16

# Values per MinMaxUInt8 chunk: a min and a max per 4096 codes cost 0.2 % (float32) more bytes and keep
# the quantization step local; the last chunk of a block may be shorter.
CHUNK = 4096


def working_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a compressed reduction sums in: float64 for float64 arrays, else float32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


class Codec(Protocol):
    """One wire format. ``values`` and ``out`` of :meth:`decode` are 1-D, contiguous, of a working dtype."""

    @property
    def name(self) -> str: ...

    def encoded_bytes(self, count: int, dtype: np.dtype) -> int:
        """Bytes :meth:`encode` writes for ``count`` values of working dtype ``dtype``."""
        ...

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        """Writes ``values`` into ``out`` (uint8, :meth:`encoded_bytes` long)."""
        ...

    def decode(self, data: np.ndarray, out: np.ndarray) -> None:
        """Writes the values ``data`` (uint8, from :meth:`encode`) stands for into ``out``."""
        ...


@dataclass(frozen=True)
class Cast:
    """Values rounded to a narrower float (``wire``: float16 or bfloat16)."""

    name: str
    wire: np.dtype

    def encoded_bytes(self, count: int, dtype: np.dtype) -> int:
        return count * self.wire.itemsize

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        narrow = out.view(self.wire)
        with np.errstate(over="ignore"):  # float16 overflows to inf, as torch's fp16 hook does
            narrow[...] = values

    def decode(self, data: np.ndarray, out: np.ndarray) -> None:
        out[...] = data.view(self.wire)


@dataclass(frozen=True)
class MinMaxUInt8:
    """Bagua's MinMaxUInt8: per chunk of ``chunk`` values a min and a max, then a uint8 code per value.

    Layout of a block of ``count`` values in ``k = ceil(count / chunk)`` chunks: ``k`` (min, max) pairs
    of the working dtype, then ``count`` codes.
    """

    name: str = "minmax_uint8"
    chunk: int = CHUNK

    def _chunks(self, count: int) -> int:
        return -(-count // self.chunk)

    def encoded_bytes(self, count: int, dtype: np.dtype) -> int:
        return self._chunks(count) * 2 * dtype.itemsize + count

    def _split(self, data: np.ndarray, count: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        head = self._chunks(count) * 2 * dtype.itemsize
        return data[:head].view(dtype).reshape(-1, 2), data[head : head + count]

    def _rows(self, array: np.ndarray) -> list[tuple[slice, np.ndarray]]:
        """``array`` as (chunk range, 2-D view) pieces: the full chunks, then the shorter last one."""
        full = array.shape[0] // self.chunk * self.chunk
        pieces = []
        if full:
            pieces.append((slice(0, full // self.chunk), array[:full].reshape(-1, self.chunk)))
        if full < array.shape[0]:
            pieces.append((slice(full // self.chunk, None), array[full:].reshape(1, -1)))
        return pieces

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        count = values.shape[0]
        bounds, codes = self._split(out, count, values.dtype)
        for where, rows in self._rows(values):
            bounds[where, 0] = rows.min(axis=1)
            bounds[where, 1] = rows.max(axis=1)
        low, high = bounds[:, 0], bounds[:, 1]
        with np.errstate(over="ignore", invalid="ignore"):
            step = (high - low) / 255
            usable = np.isfinite(step)
            inverse = np.zeros_like(step)
            np.divide(1, step, out=inverse, where=usable & (step > 0))
        low[~usable] = np.nan
        high[~usable] = np.nan
        offset = np.where(usable, low, 0)
        for where, rows in self._rows(values):
            with np.errstate(over="ignore", invalid="ignore"):  # unusable chunks: their codes become 0
                scaled = rows - offset[where, None]
                scaled *= inverse[where, None]
            scaled += 0.5  # round half up: the values are >= 0, so truncation below rounds them
            np.clip(scaled, 0, 255, out=scaled)
            scaled[~usable[where]] = 0
            target = codes[where.start * self.chunk : where.start * self.chunk + rows.size]
            target[...] = scaled.reshape(-1)  # float -> uint8 truncates: the rounding above

    def decode(self, data: np.ndarray, out: np.ndarray) -> None:
        count = out.shape[0]
        bounds, codes = self._split(data, count, out.dtype)
        low, high = bounds[:, 0], bounds[:, 1]
        step = (high - low) / 255
        for where, rows in self._rows(out):
            start = where.start * self.chunk
            rows[...] = codes[start : start + rows.size].reshape(rows.shape)
            rows *= step[where, None]
            rows += low[where, None]


def codec(name: str) -> Codec:
    """The codec of a compression name (one of :data:`collsvc.types.COMPRESSIONS`).

    Raises:
        ValueError: an unknown name. TypeError: "bf16" without ml_dtypes.
    """
    if name == "fp16":
        return Cast("fp16", np.dtype(np.float16))
    if name == "bf16":
        if BFLOAT16 is None:
            raise TypeError("compression='bf16' needs the ml_dtypes package: pip install ml_dtypes")
        return Cast("bf16", BFLOAT16)
    if name == "minmax_uint8":
        return MinMaxUInt8()
    raise ValueError(f"unknown compression {name!r}")
