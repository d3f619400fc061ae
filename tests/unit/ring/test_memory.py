"""The in-memory transport: deadlines, faults, mismatches, groups, and the RingBackend on top of it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from collsvc.client.backends.base import Signature
from collsvc.client.backends.ring import algorithms
from collsvc.client.backends.ring.backend import RingBackend
from collsvc.client.backends.ring.memory import MemoryHub
from collsvc.errors import AbortedError, CollectiveMismatchError, CollectiveTimeoutError
from collsvc.types import ReduceOp

from .threads import CheckedChannel, run_ranks

SIG = Signature("all_reduce", "float64", (16,), "sum")


def test_send_copies_and_recv_returns_the_bytes() -> None:
    hub = MemoryHub(2, timeout=1.0)
    sender = hub.channel(hub.call(0, 1))
    receiver = hub.transport(1).channel(hub.call(1, 1))
    payload = bytearray(b"abc")
    sender.send(1, 7, memoryview(payload))
    payload[0] = ord("z")  # the caller may reuse its buffer once send returned
    assert bytes(receiver.recv(0, 7)) == b"abc"
    assert hub.pending() == 0
    with pytest.raises(ValueError):
        sender.send(1, 1 << 32, b"")


def test_silent_rank_times_out_naming_it() -> None:
    size = 3
    hub = MemoryHub(size, timeout=0.3)
    hub.silence(1)

    def body(rank: int, channel_for: Callable[..., CheckedChannel]) -> BaseException | None:
        try:
            algorithms.all_reduce(channel_for(0, 8), np.ones(16), ReduceOp.SUM, small_bytes=-1)
        except CollectiveTimeoutError as exc:
            return exc
        return None

    start = time.monotonic()
    # Not run_ranks: it fails the hub on the first raise, and here every rank's own error matters.
    errors = _collect(size, hub, body)
    elapsed = time.monotonic() - start
    assert elapsed < 2.0
    # Rank 2 receives from rank 1 in the ring and must name it.
    assert isinstance(errors[2], CollectiveTimeoutError)
    assert errors[2].ranks == [1]


def _collect(
    size: int, hub: MemoryHub, body: Callable[[int, Callable[..., CheckedChannel]], BaseException | None]
) -> list[BaseException | None]:
    results: list[BaseException | None] = [None] * size

    def run(rank: int) -> None:
        results[rank] = body(
            rank, lambda seq, itemsize=1: CheckedChannel(hub.channel(hub.call(rank, seq)), itemsize, None)
        )

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


def test_fail_wakes_waiters_with_the_error() -> None:
    hub = MemoryHub(2, timeout=30.0)
    channel = hub.channel(hub.call(0, 1))
    error = AbortedError("job aborted", "test")

    timer = threading.Timer(0.05, hub.fail, args=(error,))
    timer.start()
    start = time.monotonic()
    with pytest.raises(AbortedError):
        channel.recv(1, 0)
    assert time.monotonic() - start < 5.0
    timer.join()


def test_signature_mismatch_is_reported_with_both_calls() -> None:
    hub = MemoryHub(2, timeout=1.0)
    other = Signature("all_reduce", "float32", (16,), "sum")
    hub.channel(hub.call(0, 3, SIG)).send(1, 0, b"x" * 8)
    with pytest.raises(CollectiveMismatchError) as info:
        hub.channel(hub.call(1, 3, other)).recv(0, 0)
    assert info.value.details[0]["dtype"] == "float64"
    assert info.value.details[1]["dtype"] == "float32"


def test_length_mismatch_with_equal_signatures_is_a_mismatch_not_a_hang() -> None:
    def body(rank: int, channel_for: Callable[..., CheckedChannel]) -> None:
        out = np.zeros(4 if rank == 0 else 5)
        ch = channel_for(0, 8)
        if rank == 0:
            algorithms.recv(ch, out, 1)
        else:
            algorithms.send(ch, out, 0)

    with pytest.raises(
        CollectiveMismatchError,
        match="internal fault: frame .* carries 40 bytes, expected 32, although the ranks. calls agree",
    ):
        run_ranks(2, body, timeout=2.0)


def test_subgroup_channels_use_group_indices() -> None:
    hub = MemoryHub(5, timeout=2.0)
    members = (4, 1, 3)

    def body(rank: int, _: Callable[..., CheckedChannel]) -> np.ndarray | None:
        if rank not in members:
            return None
        ch = hub.channel(hub.call(rank, 1, ranks=members))
        buf = np.full(10, float(rank))
        algorithms.all_reduce(ch, buf, ReduceOp.SUM, chunk_bytes=16, small_bytes=-1)
        return buf

    results = run_ranks(5, body, hub=hub)
    for rank in members:
        assert results[rank].tolist() == [8.0] * 10


def test_ring_backend_over_memory_transport() -> None:
    size = 3
    hub = MemoryHub(size, timeout=5.0)

    def body(rank: int, _: Callable[..., CheckedChannel]) -> tuple[np.ndarray, np.ndarray]:
        backend = RingBackend(hub.transport(rank).channel)
        avg = np.full(7, float(rank + 1), np.float32)
        backend.all_reduce(hub.call(rank, 1, SIG), avg, ReduceOp.AVG)
        out = np.zeros(size * 2, np.int32)
        backend.all_gather(hub.call(rank, 2, SIG), np.full(2, rank, np.int32), out)
        return avg, out

    for avg, out in run_ranks(size, body, hub=hub):
        assert avg.tolist() == [2.0] * 7
        assert out.tolist() == [0, 0, 1, 1, 2, 2]


def test_bad_arguments_raise_before_any_frame() -> None:
    hub = MemoryHub(2, timeout=0.5)
    ch = hub.channel(hub.call(0, 1))
    with pytest.raises(TypeError):
        algorithms.all_reduce(ch, np.ones(4), ReduceOp.BXOR)
    with pytest.raises(ValueError):
        algorithms.broadcast(ch, np.ones(4), 2)
    with pytest.raises(ValueError):
        algorithms.reduce_scatter(ch, np.ones(5), np.ones(2), ReduceOp.SUM)
    with pytest.raises(ValueError):
        algorithms.all_gather(ch, np.ones(2), np.ones(3))
    with pytest.raises(TypeError):
        algorithms.all_gather(ch, np.ones(2), np.ones(4, np.float32))
    with pytest.raises(ValueError):
        algorithms.all_to_all(ch, np.ones(3), np.ones(3))
    with pytest.raises(ValueError):
        algorithms.gather(ch, np.ones(2), None, 0)
    with pytest.raises(ValueError):
        algorithms.scatter(ch, None, np.ones(2), 0)
    with pytest.raises(ValueError):
        algorithms.all_reduce(ch, np.ones(4), ReduceOp.SUM, chunk_bytes=0)
    assert hub.frames_sent == 0
