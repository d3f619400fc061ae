"""The NCCL backend on a real GPU at world size 1, against numpy; skipped without CuPy, NCCL and a GPU.

Run with ``pytest -m gpu tests/gpu``. World size 1 needs no peers, so an in-process key/value store and
barrier stand in for the coordinator; multi-process GPU tests go through the real communicator.
"""

from __future__ import annotations

import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from collsvc.client.backends.base import Call, GroupSpec, Signature
from collsvc.client.devices import cupy_available
from collsvc.types import ReduceOp
from tests.unit.test_nccl_fake import CASES, KV, Barriers, Failure, assert_same, host_values, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy with NCCL and a CUDA GPU"),
]


@pytest.fixture
def backend() -> Any:
    from collsvc.client.backends.nccl.backend import NcclBackend

    b = NcclBackend(0, 1, KV(), Barriers(1), 30.0, Failure())
    yield b
    b.close()


_seq = iter(range(1, 1 << 30))


def call(op: str, dtype: str, shape: tuple[int, ...], reduce_op: str = "") -> Call:
    group = GroupSpec("world", (0,), 0)
    return Call(group, "world", next(_seq), Signature(op, dtype, shape, reduce_op), time.monotonic() + 30.0)


def to_device(host: np.ndarray) -> Any:
    import cupy

    if host.dtype == np.dtype(ml_dtypes.bfloat16):
        host = host.view(np.uint16)
    return cupy.asarray(host.copy())


def to_host(dev: Any, dtype: str) -> np.ndarray:
    import cupy

    out = cupy.asnumpy(dev)
    return out.view(ml_dtypes.bfloat16) if dtype == "bfloat16" else out


@pytest.mark.parametrize(("op", "dtype"), CASES, ids=[f"{o.name}-{d}" for o, d in CASES])
def test_reductions(backend: Any, op: ReduceOp, dtype: str) -> None:
    import cupy

    x = host_values(dtype, 0, 1000)
    want = reference(op, [x])
    buf = to_device(x)
    backend.all_reduce(call("all_reduce", dtype, (1000,), op.value), buf, op)
    assert_same(to_host(buf, dtype), want)
    buf = to_device(x)
    backend.reduce(call("reduce", dtype, (1000,), op.value), buf, op, 0)
    assert_same(to_host(buf, dtype), want)
    out = cupy.empty_like(to_device(x))
    backend.reduce_scatter(call("reduce_scatter", dtype, (1000,), op.value), to_device(x), out, op)
    assert_same(to_host(out, dtype), want)


@pytest.mark.parametrize("dtype", ["bool", "int16", "uint16", "bfloat16", "float32", "complex128"])
def test_data_movement(backend: Any, dtype: str) -> None:
    import cupy

    x = host_values(dtype, 0, 257)
    buf = to_device(x)
    backend.broadcast(call("broadcast", dtype, (257,)), buf, 0)
    assert (to_host(buf, dtype) == x).all()
    for name in ("all_gather", "gather", "scatter", "all_to_all"):
        out = cupy.zeros_like(to_device(x))
        src = to_device(x)
        c = call(name, dtype, (257,))
        if name == "all_gather":
            backend.all_gather(c, src, out)
        elif name == "gather":
            backend.gather(c, src, out, 0)
        elif name == "scatter":
            backend.scatter(c, src, out, 0)
        else:
            backend.all_to_all(c, src, out)
        assert (to_host(out, dtype) == x).all(), name


def test_results_are_ordered_on_the_callers_stream(backend: Any) -> None:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        buf = cupy.arange(1 << 20, dtype=cupy.float32)
        buf *= 2  # queued on the caller's stream; NCCL must see it
        backend.all_reduce(call("all_reduce", "float32", (1 << 20,), "sum"), buf, ReduceOp.SUM)
        total = float(buf.sum())
    assert total == float(np.arange(1 << 20, dtype=np.float64).sum() * 2)


def test_a_call_returns_once_enqueued_and_synchronize_waits_for_it(backend: Any) -> None:
    """Return after enqueue on real NCCL: with milliseconds of kernels queued before it on the caller's
    stream, the all_reduce returns while its completion event has not fired; synchronize() waits for
    it; the result is ordered on the caller's stream."""
    import cupy

    buf = cupy.ones(64 << 20, dtype=cupy.float32)  # 256 MiB
    backend.all_reduce(call("all_reduce", "float32", (64 << 20,), "sum"), buf, ReduceOp.SUM)  # the communicator
    cupy.cuda.get_current_stream().synchronize()
    for _ in range(20):
        buf *= 1.0  # ~milliseconds of work the collective must wait for
    backend.all_reduce(call("all_reduce", "float32", (64 << 20,), "sum"), buf, ReduceOp.SUM)
    assert any(not p.done() for p in backend._watchdog.unfinished()), "the call waited for the GPU"
    backend.synchronize()
    assert all(p.done() for p in backend._watchdog.unfinished())
    assert float(buf[:4].sum()) == 4.0


def test_blocking_mode_waits_on_the_host() -> None:
    from collsvc.client.backends.nccl.backend import NcclBackend

    b = NcclBackend(0, 1, KV(), Barriers(1), 30.0, Failure(), blocking=True)
    try:
        import cupy

        buf = cupy.ones(1 << 20, dtype=cupy.float32)
        for _ in range(2):
            b.all_reduce(call("all_reduce", "float32", (1 << 20,), "sum"), buf, ReduceOp.SUM)
            assert all(p.done() for p in b._watchdog.unfinished())
    finally:
        b.close()
