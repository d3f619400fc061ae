"""Receive buffers are reused, and only once nothing refers to them any more."""

from __future__ import annotations

import gc

import numpy as np

from collsvc.client.backends.ring.receive_buffers import POOLED_FROM_BYTES, ReceiveBuffers


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


def test_a_buffer_is_reused_after_its_last_reference_is_gone() -> None:
    pool = ReceiveBuffers()
    first = pool.take(1 << 20)
    where = address(first)
    as_array = np.frombuffer(first, np.float32)  # what an algorithm makes of a payload
    del first
    gc.collect()
    assert pool.free_bytes == 0, "returned while an array still read it"
    second = pool.take(1 << 20)
    assert address(second) != where
    del as_array
    assert pool.free_bytes == 1 << 20
    third = pool.take((1 << 20) - 100)  # same size class
    assert address(third) == where and third.nbytes == (1 << 20) - 100
    assert pool.free_bytes == 0
    del second, third


def test_small_payloads_are_not_pooled_and_the_pool_is_bounded() -> None:
    pool = ReceiveBuffers(keep_bytes=2 << 20)
    small = pool.take(POOLED_FROM_BYTES - 1)
    assert small.nbytes == POOLED_FROM_BYTES - 1
    del small
    assert pool.free_bytes == 0
    held = [pool.take(1 << 20) for _ in range(4)]
    del held
    assert pool.free_bytes == 2 << 20  # two kept, two given back to the allocator
