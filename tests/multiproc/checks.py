"""Rank-side checks shared by the multi-process tests: inputs every rank can recompute for every
other rank, numpy references, and tolerances per dtype."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

import collsvc
from collsvc.types import BFLOAT16, DTYPE_CODES, ReduceOp

DTYPES = list(DTYPE_CODES)  # every dtype collsvc supports


def np_dtype(name: str) -> np.dtype:
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def allowed(op: ReduceOp, dtype: str) -> bool:
    kind = np_dtype(dtype).kind
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return kind in "biu"
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return kind != "c"
    if op is ReduceOp.AVG:
        return kind not in "biu"
    return True


def make(rank: int, dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Deterministic input of ``rank`` (any rank can recompute any other's)."""
    rng = np.random.default_rng([seed, rank, len(shape), sum(shape), len(dtype)])
    dt = np_dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind == "u":
        return rng.integers(0, 4, size=shape).astype(dt)
    if dt.kind == "i":
        return rng.integers(-3, 4, size=shape).astype(dt)
    if dt.kind == "c":
        return (rng.uniform(-1, 1, size=shape) + 1j * rng.uniform(-1, 1, size=shape)).astype(dt)
    return rng.uniform(-1, 1, size=shape).astype(np.float32).astype(dt)


def reference(op: ReduceOp, inputs: list[np.ndarray]) -> np.ndarray:
    """The reduction computed in float64/complex128 for floats, in the dtype itself for integers."""
    dt = inputs[0].dtype
    exact = dt.kind in "biu"
    work = [x.copy() if exact else x.astype(np.complex128 if dt.kind == "c" else np.float64) for x in inputs]
    acc = work[0].copy()
    for x in work[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc = np.logical_or(acc, x) if dt.kind == "b" else acc + x
        elif op is ReduceOp.PRODUCT:
            acc = np.logical_and(acc, x) if dt.kind == "b" else acc * x
        elif op is ReduceOp.MIN:
            acc = np.minimum(acc, x)
        elif op is ReduceOp.MAX:
            acc = np.maximum(acc, x)
        elif op is ReduceOp.BAND:
            acc = acc & x
        elif op is ReduceOp.BOR:
            acc = acc | x
        elif op is ReduceOp.BXOR:
            acc = acc ^ x
    if op is ReduceOp.AVG:
        acc = acc / len(inputs)
    return acc


def assert_close(got: np.ndarray, expected: np.ndarray, dtype: str, what: str, size: int = 1) -> None:
    assert got.shape == expected.shape, f"{what}: shape {got.shape} != {expected.shape}"
    kind = np_dtype(dtype).kind
    if kind in "biu":
        assert np.array_equal(got, expected), f"{what}: {got} != {expected}"
        return
    tol = {"float16": 2e-2, "bfloat16": 8e-2, "float32": 1e-5, "complex64": 1e-5}.get(dtype, 1e-12)
    g = got.astype(np.complex128 if kind == "c" else np.float64)
    assert np.allclose(g, expected, rtol=tol, atol=tol * size), f"{what}: max error {np.max(np.abs(g - expected))}"


def digest(array: Any) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(array)).view(np.uint8).tobytes()).hexdigest()


def assert_identical_everywhere(comm: collsvc.Communicator, array: np.ndarray, what: str) -> None:
    digests = comm.all_gather(np.frombuffer(bytes.fromhex(digest(array)), dtype=np.uint8).copy())
    rows = digests.reshape(comm.size, -1)
    assert all(np.array_equal(rows[0], row) for row in rows), f"{what}: results differ between ranks"
