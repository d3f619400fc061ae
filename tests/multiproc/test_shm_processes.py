"""LocalGroup across real spawned processes: correctness, and a SIGKILLed rank leaves nothing behind."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
import uuid
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="Linux only")

SECONDS = 30


def _collectives(namespace: str, rank: int, size: int, results: Any) -> None:
    try:
        from collsvc.client.backends.shm import LocalGroup
        from collsvc.types import ReduceOp

        with LocalGroup(namespace, rank, size, slot_bytes=8192, timeout=SECONDS) as group:
            deadline = time.monotonic() + SECONDS
            buf = np.arange(50_001, dtype=np.float32) * (rank + 1)  # 25 rounds of 8 KiB
            group.all_reduce(buf, ReduceOp.SUM, deadline)
            assert np.array_equal(buf, np.arange(50_001, dtype=np.float32) * sum(range(1, size + 1)))
            out = np.empty(size * 3001, np.int16)
            group.all_gather(np.full(3001, rank, np.int16), out, deadline)
            assert np.array_equal(out, np.repeat(np.arange(size, dtype=np.int16), 3001))
            rows = np.ones(size * 4001, np.float64) * rank
            block = np.empty(4001)
            group.reduce_scatter(rows, block, ReduceOp.MAX, deadline)
            assert (block == size - 1).all()
            data = np.full(20_000, rank, np.uint8)
            group.broadcast(data, size - 1, deadline)
            assert (data == size - 1).all()
        results.put((rank, "ok"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _looping(namespace: str, rank: int, size: int, results: Any, started: Any) -> None:
    try:
        from collsvc.client.backends.shm import LocalGroup
        from collsvc.errors import CollectiveTimeoutError
        from collsvc.types import ReduceOp

        group = LocalGroup(namespace, rank, size, slot_bytes=4096, timeout=SECONDS)
        buf = np.ones(100_000, np.float32)  # 98 rounds per call: a kill lands mid-collective
        started.set()
        start = time.monotonic()
        while time.monotonic() - start < SECONDS:
            try:
                group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 1.0)
                buf[:] = 1
            except CollectiveTimeoutError as exc:
                results.put((rank, ("timeout", exc.ranks)))
                group.close()
                return
        results.put((rank, "never timed out"))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _start(target: Any, size: int, *extra: Any) -> tuple[list[Any], Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    namespace = uuid.uuid4().hex
    procs = [ctx.Process(target=target, args=(namespace, r, size, results, *extra), daemon=True) for r in range(size)]
    for proc in procs:
        proc.start()
    return procs, results


def _collect(procs: list[Any], results: Any, expected: int) -> dict[int, Any]:
    got: dict[int, Any] = {}
    try:
        while len(got) < expected:
            rank, value = results.get(timeout=SECONDS)
            got[rank] = value
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(len(procs))) - set(got))} did not report in {SECONDS} s")
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return got


@pytest.mark.parametrize("size", [3, 4])
def test_collectives_across_processes(size: int) -> None:
    procs, results = _start(_collectives, size)
    got = _collect(procs, results, size)
    assert all(v == "ok" for v in got.values()), got


def test_sigkill_mid_collective_leaves_no_shared_memory_and_survivors_time_out() -> None:
    shm_before = set(os.listdir("/dev/shm"))
    ctx = mp.get_context("spawn")
    started = [ctx.Event() for _ in range(3)]
    results = ctx.Queue()
    namespace = uuid.uuid4().hex
    procs = [ctx.Process(target=_looping, args=(namespace, r, 3, results, started[r]), daemon=True) for r in range(3)]
    for proc in procs:
        proc.start()
    for event in started:
        assert event.wait(SECONDS)
    os.kill(procs[1].pid, signal.SIGKILL)
    got = _collect(procs, results, 2)
    assert got[0] == ("timeout", [1]), got  # local rank 0 leads the barrier: it knows who is missing
    assert got[2][0] == "timeout", got
    for proc in procs:
        assert not proc.is_alive()
    # Segments are memfds, never named files; multiprocessing's own sem.mp-* files are not ours.
    leftovers = {name for name in set(os.listdir("/dev/shm")) - shm_before if "collsvc" in name}
    assert not leftovers, leftovers
