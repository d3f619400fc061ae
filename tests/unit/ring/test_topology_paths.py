"""The ring backend's topology paths with threads as ranks: real shared-memory groups within a
"host", the in-memory transport between hosts, hosts fabricated by a rank -> host table."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from collsvc.client.backends.base import Signature
from collsvc.client.backends.ring.backend import RingBackend
from collsvc.client.backends.ring.memory import MemoryHub
from collsvc.client.backends.ring.topology import plan
from collsvc.client.backends.shm.groups import LocalGroups
from collsvc.types import ReduceOp

LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "3+1": ["a", "a", "a", "b"],
    "1+1+2": ["a", "b", "c", "c"],
    "one host": ["a", "a", "a"],
}


def run(hosts: list[str], mode: str, op: ReduceOp, count: int, dtype: str = "float64") -> list[np.ndarray]:
    size = len(hosts)
    hub = MemoryHub(size, timeout=30)
    table = dict(enumerate(hosts))
    job_key = f"test-{os.getpid()}-{threading.get_ident()}-{mode}-{count}-{op.name}"
    signature = Signature("all_reduce", dtype, (count,), op.name)
    inputs = [np.arange(count, dtype=dtype) * (r + 1) + r for r in range(size)]

    def rank_main(rank: int) -> np.ndarray:
        groups = LocalGroups(job_key, timeout=30)
        backend = RingBackend(hub.transport(rank).channel, hosts=table, local_groups=groups, hierarchical=mode)
        buf = inputs[rank].copy()
        try:
            backend.all_reduce(hub.call(rank, 1, signature), buf, op)
        finally:
            backend.close()
        return buf

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(rank_main, range(size)))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("count", [0, 1, 1000, 300_000])
def test_all_reduce_paths_agree_with_numpy(layout: str, mode: str, count: int) -> None:
    hosts = LAYOUTS[layout]
    results = run(hosts, mode, ReduceOp.SUM, count)
    expected = sum(np.arange(count, dtype=np.float64) * (r + 1) + r for r in range(len(hosts)))
    for got in results:
        assert np.array_equal(got, expected)
        assert got.tobytes() == results[0].tobytes()  # bit-identical on every rank


def test_average_and_max_through_the_hierarchy() -> None:
    hosts = LAYOUTS["2x2"]
    avg = run(hosts, "always", ReduceOp.AVG, 5000)
    expected = sum(np.arange(5000, dtype=np.float64) * (r + 1) + r for r in range(4)) / 4
    assert all(np.allclose(a, expected) for a in avg)
    top = run(hosts, "always", ReduceOp.MAX, 5000)
    assert all(np.array_equal(t, np.arange(5000) * 4 + 3) for t in top)


def test_plan_names_leaders_and_local_members() -> None:
    from collsvc.client.backends.base import GroupSpec

    table: dict[int, Any] = dict(enumerate(["a", "b", "a", "c"]))
    topo = plan(GroupSpec("g", (0, 1, 2, 3), 2), table)
    assert topo.local == (0, 2) and topo.local_index == 1
    assert topo.leaders == (0, 1, 3) and topo.leader_index is None
    assert topo.hosts == 3 and topo.hierarchical_pays


@pytest.mark.parametrize("layout", ["2x2", "3+1", "1+1+2"])
def test_pipelined_hierarchy_with_many_chunks(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from collsvc.client.backends.ring import backend as backend_module

    monkeypatch.setattr(backend_module, "PIPELINE_CHUNK_BYTES", 8 * 1000)  # 1000 float64 per chunk
    hosts = LAYOUTS[layout]
    count = 10_500  # 11 chunks, the last one short
    results = run(hosts, "always", ReduceOp.SUM, count)
    expected = sum(np.arange(count, dtype=np.float64) * (r + 1) + r for r in range(len(hosts)))
    for got in results:
        assert np.array_equal(got, expected)


def test_plan_pairs_members_of_the_same_local_index_when_hosts_hold_as_many() -> None:
    from collsvc.client.backends.base import GroupSpec

    even: dict[int, Any] = dict(enumerate(["a", "b", "a", "b", "a", "b"]))
    topo = plan(GroupSpec("g", tuple(range(6)), 3), even)
    assert topo.local == (1, 3, 5) and topo.local_index == 1
    assert topo.counterparts == (2, 3)  # host a's second member, host b's second member
    uneven: dict[int, Any] = dict(enumerate(["a", "a", "a", "b"]))
    assert plan(GroupSpec("g", (0, 1, 2, 3), 0), uneven).counterparts is None


@pytest.mark.parametrize(("layout", "count"), [("2x2", 300_000), ("2x3", 1_300_001), ("3x2", 1_300_001)])
def test_hosts_holding_as_many_members_all_reduce_by_slices(
    layout: str, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Above 64 KiB, hosts with as many members each go by slices: every member reduces its slice of
    each chunk on its host and all-reduces it with its counterparts. 1 300 001 float64 is three
    chunks of the 4 MiB slots, the last one short and not divisible by the members per host."""
    hosts = {"2x3": ["a", "a", "a", "b", "b", "b"], "3x2": ["a", "b", "c", "a", "b", "c"]}.get(layout) or LAYOUTS[
        layout
    ]
    sliced: list[int] = []
    original = RingBackend._sliced_all_reduce

    def counting(self: RingBackend, call: Any, *args: Any) -> None:
        sliced.append(call.group.index)
        original(self, call, *args)

    monkeypatch.setattr(RingBackend, "_sliced_all_reduce", counting)
    results = run(hosts, "always", ReduceOp.SUM, count)
    expected = sum(np.arange(count, dtype=np.float64) * (r + 1) + r for r in range(len(hosts)))
    assert sorted(sliced) == list(range(len(hosts)))
    for got in results:
        assert np.array_equal(got, expected)
        assert got.tobytes() == results[0].tobytes()


def test_two_streams_cross_hosts_at_once_in_opposite_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two groups' all_reduce by slices at the same time, host a's ranks crossing for stream A first
    and host b's for stream B first: each stream has its own cross-host worker, so neither exchange
    waits behind the other's (one worker per backend held both until the calls timed out)."""
    from collsvc.client.backends.ring import backend as backend_module

    hosts = LAYOUTS["2x2"]
    size, count = len(hosts), 300_000
    hub = MemoryHub(size, timeout=10)
    table = dict(enumerate(hosts))
    crossing = {(rank, stream): threading.Event() for rank in range(size) for stream in "AB"}
    original = backend_module.algorithms.all_reduce

    arrays: dict[int, tuple[int, str]] = {}  # id of a rank's array -> (rank, stream)

    def noting(ch: Any, buf: np.ndarray, *args: Any, **kwargs: Any) -> None:
        crossing[arrays[id(buf.base)]].set()  # buf: a slice of the call's array
        original(ch, buf, *args, **kwargs)

    monkeypatch.setattr(backend_module.algorithms, "all_reduce", noting)
    inputs = [np.arange(count, dtype=np.float64) * (r + 1) for r in range(size)]
    job_key = f"streams-{os.getpid()}-{threading.get_ident()}"

    def rank_main(rank: int) -> list[np.ndarray]:
        groups = LocalGroups(job_key, timeout=10)
        backend = RingBackend(hub.transport(rank).channel, hosts=table, local_groups=groups, hierarchical="always")
        first, second = ("A", "B") if hosts[rank] == "a" else ("B", "A")
        signature = Signature("all_reduce", "float64", (count,), "SUM")

        def run_stream(stream: str) -> np.ndarray:
            if stream == second:
                assert crossing[(rank, first)].wait(10), f"rank {rank} never crossed for stream {first}"
            buf = inputs[rank].copy()
            arrays[id(buf)] = (rank, stream)
            backend.all_reduce(hub.call(rank, 1, signature, key=stream), buf, ReduceOp.SUM)
            return buf

        try:
            with ThreadPoolExecutor(2) as streams:
                return list(streams.map(run_stream, "AB"))
        finally:
            backend.close()

    with ThreadPoolExecutor(size) as pool:
        results = list(pool.map(rank_main, range(size)))
    expected = sum(inputs)
    for both in results:
        for got in both:
            assert np.array_equal(got, expected)
