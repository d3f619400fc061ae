"""Threads as ranks over the in-memory transport, with a channel wrapper that checks the frame rules."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np

from collsvc.client.backends.base import Signature
from collsvc.client.backends.ring.memory import MemoryChannel, MemoryHub
from collsvc.types import DTYPE_CODES, ReduceOp, check_op_dtype, numpy_dtype

ALL_DTYPES: tuple[np.dtype, ...] = tuple(numpy_dtype(name) for name in DTYPE_CODES)
BF16 = np.dtype(ml_dtypes.bfloat16)
REDUCING_OPS = tuple(op for op in ReduceOp if op is not ReduceOp.AVG)

# One pool for the whole session: spawning threads per case would dominate the run time.
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rank")


def ops_for(dtype: np.dtype) -> list[ReduceOp]:
    """The ops API.md allows on ``dtype`` (AVG left out: it is SUM plus finish_average)."""
    allowed = []
    for op in REDUCING_OPS:
        try:
            check_op_dtype(op, dtype)
        except TypeError:
            continue
        allowed.append(op)
    return allowed


class CheckedChannel:
    """A MemoryChannel that asserts each frame's step is unique per (src, dst) pair, fits 32 bits,
    carries whole elements and at most ``max_payload`` bytes."""

    def __init__(self, inner: MemoryChannel, itemsize: int, max_payload: int | None) -> None:
        self._inner = inner
        self._itemsize = itemsize
        self._max_payload = max_payload
        self._sent: set[tuple[int, int]] = set()
        self._received: set[tuple[int, int]] = set()
        self.frames = 0

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def size(self) -> int:
        return self._inner.size

    def send(self, dst: int, step: int, payload: memoryview | bytes) -> None:
        nbytes = memoryview(payload).nbytes
        assert 0 <= step < 1 << 32, step
        assert (dst, step) not in self._sent, f"step {step:#x} sent twice to {dst}"
        assert nbytes % self._itemsize == 0, f"frame of {nbytes} bytes splits an element"
        if self._max_payload is not None:
            assert nbytes <= max(self._max_payload, self._itemsize), nbytes
        self._sent.add((dst, step))
        self.frames += 1
        self._inner.send(dst, step, payload)

    def recv(self, src: int, step: int) -> memoryview:
        assert (src, step) not in self._received, f"step {step:#x} received twice from {src}"
        self._received.add((src, step))
        return self._inner.recv(src, step)

    def land(self, src: int, step: int, into: memoryview) -> None:
        assert (src, step) not in self._received, f"step {step:#x} from {src} declared after it was received"
        self._inner.land(src, step, into)

    def flush(self) -> None:
        self._inner.flush()

    def close(self) -> None:
        self._inner.close()


def run_ranks(
    size: int,
    body: Callable[[int, Callable[..., CheckedChannel]], Any],
    *,
    timeout: float = 10.0,
    hub: MemoryHub | None = None,
) -> list[Any]:
    """Runs ``body(rank, channel_for)`` on ``size`` threads; returns each rank's result.

    ``channel_for(seq, itemsize=1, max_payload=None, signature=None)`` makes the channel of call
    ``seq``. The first rank to raise fails the hub so no other rank waits out its timeout; the first
    error is re-raised here.
    """
    hub = hub or MemoryHub(size, timeout)

    def channel_for(
        rank: int,
        seq: int,
        itemsize: int = 1,
        max_payload: int | None = None,
        signature: Signature | None = None,
    ) -> CheckedChannel:
        return CheckedChannel(hub.channel(hub.call(rank, seq, signature)), itemsize, max_payload)

    def wrapped(rank: int) -> Any:
        try:
            return body(rank, functools.partial(channel_for, rank))
        except BaseException as exc:
            hub.fail(exc)
            raise

    futures = [_POOL.submit(wrapped, rank) for rank in range(size)]
    results: list[Any] = []
    errors: list[BaseException] = []
    for future in futures:
        try:
            results.append(future.result(timeout=timeout + 10))
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    assert hub.pending() == 0, "frames were sent that nobody received"
    return results


def assert_identical(results: Sequence[np.ndarray], what: str) -> None:
    """Every rank's array has the same bytes."""
    first = results[0].tobytes()
    for rank, result in enumerate(results[1:], start=1):
        assert result.tobytes() == first, f"{what}: rank {rank} differs from rank 0"


def assert_equal_values(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Same values (bit-exact for integers; for floats -0.0 equals 0.0, which operand order decides)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    if got.dtype.kind in "biu":
        assert got.tobytes() == expected.tobytes(), what
    else:
        wide = np.complex128 if got.dtype.kind == "c" else np.float64
        assert np.array_equal(got.astype(wide), expected.astype(wide)), what


def exact_inputs(rng: np.random.Generator, dtype: np.dtype, op: ReduceOp, size: int, length: int) -> np.ndarray:
    """``size`` rows of inputs whose reduction every dtype represents exactly, whatever the order."""
    if dtype.kind == "b":
        return rng.integers(0, 2, (size, length)).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, (size, length), dtype=dtype, endpoint=True)
    choices = np.array([-2.0, -1.0, 1.0, 2.0]) if op is ReduceOp.PRODUCT else np.arange(-3.0, 4.0)
    values = rng.choice(choices, (size, length))
    if dtype.kind == "c":
        values = values + 1j * rng.choice(choices, (size, length))
    return values.astype(dtype)


def reference(op: ReduceOp, rows: np.ndarray) -> np.ndarray:
    """The reduction of ``rows`` along axis 0: exact for integers (wrapping), float64 for floats."""
    dtype = rows.dtype
    if dtype.kind == "b":
        table = {
            ReduceOp.SUM: np.logical_or,
            ReduceOp.MAX: np.logical_or,
            ReduceOp.BOR: np.logical_or,
            ReduceOp.PRODUCT: np.logical_and,
            ReduceOp.MIN: np.logical_and,
            ReduceOp.BAND: np.logical_and,
            ReduceOp.BXOR: np.logical_xor,
        }
        return np.asarray(table[op].reduce(rows, axis=0), dtype=bool)
    ufunc = {
        ReduceOp.SUM: np.add,
        ReduceOp.AVG: np.add,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.MIN: np.minimum,
        ReduceOp.MAX: np.maximum,
        ReduceOp.BAND: np.bitwise_and,
        ReduceOp.BOR: np.bitwise_or,
        ReduceOp.BXOR: np.bitwise_xor,
    }[op]
    if dtype.kind in "iu":
        return np.asarray(ufunc.reduce(rows, axis=0, dtype=dtype))
    wide = np.complex128 if dtype.kind == "c" else np.float64
    return np.asarray(ufunc.reduce(rows.astype(wide), axis=0)).astype(dtype)
