"""Compressed all_reduce and reduce_scatter through the ring backend's topology paths, with threads as
ranks (real shared-memory groups within a "host", the in-memory transport between hosts): every rank
gets the same bits, within the documented bound of the exact result; one host stays exact. (Ranks
that disagree on the compression are tested with real processes, tests/multiproc/test_compression.py:
the in-memory twin finds a mismatch only in frames a rank waits for.)"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from collsvc.client.backends.base import Signature
from collsvc.client.backends.ring.backend import RingBackend
from collsvc.client.backends.ring.memory import MemoryHub
from collsvc.client.backends.shm.groups import LocalGroups
from collsvc.types import COMPRESSIONS, ReduceOp

LAYOUTS = {"1+1": ["a", "b"], "2x2": ["a", "a", "b", "b"], "1+1+1": ["a", "b", "c"], "3+1": ["a", "a", "a", "b"]}


def error_bound(name: str, inputs: list[np.ndarray]) -> np.ndarray:
    """docs/api.md's bound on |compressed - exact| for each element (float32 working dtype)."""
    n = len(inputs)
    total_abs = sum(np.abs(x.astype(np.float64)) for x in inputs)
    assert isinstance(total_abs, np.ndarray)
    summing = n * 2.0**-23 * total_abs  # the working dtype's own rounding of the sums
    if name == "bf16":
        return 2 * 2.0**-8 * total_abs + summing
    if name == "fp16":
        return 2 * 2.0**-11 * total_abs + summing + (n + 1) * n * 2.0**-25
    largest = sum(np.abs(x.astype(np.float64)).max() for x in inputs)
    return np.full_like(total_abs, 2 * largest / 255) + summing


def run(
    hosts: list[str],
    kind: str,
    compressions: list[str],
    inputs: list[np.ndarray],
    op: ReduceOp = ReduceOp.SUM,
) -> list[np.ndarray]:
    size = len(hosts)
    hub = MemoryHub(size, timeout=30)
    table = dict(enumerate(hosts))
    job_key = f"cmp-{os.getpid()}-{threading.get_ident()}-{kind}-{inputs[0].size}-{'-'.join(compressions)}"

    def rank_main(rank: int) -> np.ndarray:
        x = inputs[rank]
        signature = Signature(kind, "float32", x.shape, op.name, compression=compressions[rank])
        call = hub.call(rank, 1, signature)
        backend = RingBackend(hub.transport(rank).channel, hosts=table, local_groups=LocalGroups(job_key, timeout=30))
        try:
            if kind == "all_reduce":
                buf = x.copy()
                backend.all_reduce(call, buf, op)
                return buf
            out = np.empty(x.size // size, x.dtype)
            backend.reduce_scatter(call, x, out, op)
            return out
        finally:
            backend.close()

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(rank_main, range(size)))


def make_inputs(size: int, count: int, dtype: type = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(count + size)
    return [(rng.standard_normal(count) * 10 + r).astype(dtype) for r in range(size)]


@pytest.mark.parametrize("name", COMPRESSIONS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("count", [1, 5000, 300_001])
def test_all_reduce_is_within_the_bound_and_identical_on_every_rank(name: str, layout: str, count: int) -> None:
    hosts = LAYOUTS[layout]
    inputs = make_inputs(len(hosts), count)
    results = run(hosts, "all_reduce", [name] * len(hosts), inputs)
    exact = sum(x.astype(np.float64) for x in inputs)
    for got in results:
        assert got.tobytes() == results[0].tobytes()
    assert np.all(np.abs(results[0] - exact) <= error_bound(name, inputs))
    if count > 1:
        assert not np.array_equal(results[0], exact.astype(np.float32))  # it did compress


def test_average_keeps_the_mean_and_float64_sums_in_float64() -> None:
    hosts = LAYOUTS["2x2"]
    inputs = make_inputs(4, 10_000, np.float64)
    results = run(hosts, "all_reduce", ["bf16"] * 4, inputs, ReduceOp.AVG)
    exact = sum(inputs) / 4
    assert results[0].dtype == np.float64
    assert all(r.tobytes() == results[0].tobytes() for r in results)
    assert np.all(np.abs(results[0] - exact) <= error_bound("bf16", inputs) / 4)


@pytest.mark.parametrize("name", COMPRESSIONS)
def test_one_host_is_exact(name: str) -> None:
    inputs = make_inputs(3, 5000)
    results = run(["a", "a", "a"], "all_reduce", [name] * 3, inputs)
    exact = run(["a", "a", "a"], "all_reduce", [""] * 3, inputs)
    assert all(np.array_equal(r, exact[0]) for r in results)


@pytest.mark.parametrize("name", COMPRESSIONS)
@pytest.mark.parametrize("layout", ["1+1", "3+1"])
def test_reduce_scatter_blocks_are_within_the_bound(name: str, layout: str) -> None:
    hosts = LAYOUTS[layout]
    n = len(hosts)
    inputs = make_inputs(n, n * 7001)
    results = run(hosts, "reduce_scatter", [name] * n, inputs)
    exact = sum(x.astype(np.float64) for x in inputs)
    bound = error_bound(name, inputs)
    for rank, got in enumerate(results):
        block = slice(rank * 7001, (rank + 1) * 7001)
        assert np.all(np.abs(got - exact[block]) <= bound[block])
