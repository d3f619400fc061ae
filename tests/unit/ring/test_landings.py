"""Frames read straight into a call's array: the lane receiver on loopback with a hand-driven sender.

The rule pinned here: a frame lands in place only where a call declared it (same size, same call),
and nothing is written into that array after the call withdrew it, even when the sender stopped in
the middle of the frame.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from collsvc.client.backends.ring import algorithms, frames
from collsvc.client.backends.ring.landings import FrameKey, Landings
from collsvc.client.backends.ring.lane_receiver import LaneListener
from collsvc.client.backends.ring.lane_wire import ACCEPTED, HELLO, read_exact
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.client.backends.ring.memory import MemoryHub
from collsvc.types import ReduceOp

from .threads import CheckedChannel, run_ranks

LIMIT = 64 << 20
SENDER = 5
DIGEST = 1234
KEY_HASH = 77


class ObservedLandings(Landings):
    """Landings that tell the test when the reader claimed a frame."""

    def __init__(self) -> None:
        super().__init__()
        self.claimed = threading.Event()

    def claim(self, key: FrameKey, nbytes: int, digest: int, stop: Callable[[], None]) -> memoryview | None:
        into = super().claim(key, nbytes, digest, stop)
        if into is not None:
            self.claimed.set()
        return into


@pytest.fixture
def lane() -> Iterator[tuple[Mailbox, socket.socket]]:
    """A mailbox with a lane listener, and a raw connection to it admitted as rank SENDER."""
    mailbox = Mailbox()
    mailbox.landings = ObservedLandings()
    listener = LaneListener("127.0.0.1", 0, mailbox, LIMIT)
    raw = socket.create_connection(("127.0.0.1", listener.port), timeout=10)
    raw.sendall(HELLO.pack(SENDER, listener.ticket(SENDER)))
    answer = bytearray(1)
    read_exact(raw, memoryview(answer))
    assert bytes(answer) == ACCEPTED
    yield mailbox, raw
    raw.close()
    listener.close()


def claimed(mailbox: Mailbox) -> bool:
    assert isinstance(mailbox.landings, ObservedLandings)
    return mailbox.landings.claimed.wait(10)


def frame_head(step: int, nbytes: int, digest: int = DIGEST) -> bytes:
    return frames.encode_header(SENDER, KEY_HASH, 1, step, digest, b'{"op":"t"}', nbytes)


def address(view: memoryview | np.ndarray) -> int:
    array = np.frombuffer(view, np.uint8) if isinstance(view, memoryview) else view
    return int(array.__array_interface__["data"][0])


def test_a_declared_frame_is_read_into_the_array_and_others_into_their_own_buffers(
    lane: tuple[Mailbox, socket.socket],
) -> None:
    mailbox, raw = lane
    target = np.zeros(1 << 18, np.float32)  # 1 MiB
    wrong_size = np.zeros(10, np.float32)
    mailbox.landings.expect((KEY_HASH, 1, 0, SENDER), memoryview(target.view(np.uint8)), DIGEST)
    mailbox.landings.expect((KEY_HASH, 1, 1, SENDER), memoryview(wrong_size.view(np.uint8)), DIGEST)
    mailbox.landings.expect((KEY_HASH, 1, 2, SENDER), memoryview(np.zeros(4, np.uint8)), DIGEST + 1)
    data = np.arange(target.size, dtype=np.float32)
    raw.sendall(frame_head(0, data.nbytes) + data.tobytes())
    raw.sendall(frame_head(1, 4 * 11) + np.ones(11, np.float32).tobytes())  # not the declared size
    raw.sendall(frame_head(2, 4) + b"abcd")  # another call's digest

    deadline = time.monotonic() + 10
    taken = [mailbox.take((KEY_HASH, 1, step, SENDER), deadline) for step in range(3)]
    assert all(t is not None for t in taken)
    landed, odd_size, odd_call = (t[1] for t in taken if t is not None)
    assert address(landed) == address(target) and np.array_equal(target, data)
    assert address(odd_size) != address(wrong_size) and not wrong_size.any()
    assert bytes(odd_call) == b"abcd"
    mailbox.landings.withdraw([(KEY_HASH, 1, step, SENDER) for step in range(3)])
    assert mailbox.landings.registered == 0


def half_a_declared_frame(mailbox: Mailbox, raw: socket.socket) -> tuple[np.ndarray, FrameKey, int]:
    """Declares a 64 KiB frame, sends its header and first half (ones), and waits until the reader
    claimed it; returns the array, the frame's key and the bytes sent."""
    target = np.zeros(1 << 16, np.uint8)
    key = (KEY_HASH, 1, 0, SENDER)
    mailbox.landings.expect(key, memoryview(target), DIGEST)
    half = target.size // 2
    raw.sendall(frame_head(0, target.size) + b"\x01" * half)
    assert claimed(mailbox), "the reader never claimed the declared frame"
    return target, key, half


def test_nothing_is_written_into_the_array_after_the_call_withdrew_it(lane: tuple[Mailbox, socket.socket]) -> None:
    """The sender stops half-way through a declared frame; the call ends (withdraws) after a short
    grace: the reader is cut off, and the rest of the frame, sent after that, never reaches the array."""
    mailbox, raw = lane
    target, key, half = half_a_declared_frame(mailbox, raw)

    began = time.monotonic()
    mailbox.landings.withdraw([key], grace=0.2)
    assert time.monotonic() - began < 5
    snapshot = target.copy()
    with contextlib.suppress(OSError):
        raw.sendall(b"\x02" * (target.size - half))
    raw.settimeout(10)
    with contextlib.suppress(OSError):
        assert raw.recv(1) == b""  # the receiver shut the lane down (or reset it)
    assert np.array_equal(target, snapshot)
    assert not (target == 2).any()
    assert mailbox.take(key, time.monotonic() + 0.05) is None


def test_a_withdraw_waits_for_a_read_that_finishes_within_the_grace(lane: tuple[Mailbox, socket.socket]) -> None:
    mailbox, raw = lane
    target, key, half = half_a_declared_frame(mailbox, raw)
    finisher = threading.Timer(0.1, lambda: raw.sendall(b"\x01" * (target.size - half)))
    finisher.start()
    mailbox.landings.withdraw([key], grace=10)
    finisher.join()
    assert (target == 1).all()
    taken = mailbox.take(key, time.monotonic() + 5)
    assert taken is not None and address(taken[1]) == address(target)


def test_withdrawing_what_was_never_claimed_returns_at_once() -> None:
    landings = Landings()
    view = memoryview(bytearray(8))
    landings.expect((1, 1, 1, 1), view, 9)
    began = time.monotonic()
    landings.withdraw([(1, 1, 1, 1), (1, 1, 2, 1)])
    assert time.monotonic() - began < 0.5
    assert landings.claim((1, 1, 1, 1), 8, 9, lambda: None) is None


def test_ring_copy_rounds_and_broadcast_chains_land_in_place() -> None:
    """Over the in-memory transport (which lands a declared frame when it is sent, the earliest a lane
    could): results stay exact, and every copy-round frame of a ring all_reduce lands (each one
    depends on this rank's first send, which comes after its declarations). A chain's frames land
    where the receiver declared them before they were sent; the rest are copied."""
    size, chunks = 4, 3
    rows = np.arange(size * size * chunks * 2, dtype=np.float64).reshape(size, -1)  # 2 float64 per frame
    ring_hub, chain_hub = MemoryHub(size), MemoryHub(size)

    def reduce_body(rank: int, channel_for: Callable[..., CheckedChannel]) -> np.ndarray:
        summed = rows[rank].copy()
        ring = channel_for(0, 8, 16)
        algorithms.all_reduce(ring, summed, ReduceOp.SUM, chunk_bytes=16, small_bytes=-1)
        ring.close()
        return summed

    def broadcast_body(rank: int, channel_for: Callable[..., CheckedChannel]) -> np.ndarray:
        sent = rows[rank].copy()
        chain = channel_for(0, 8, 16)
        algorithms.broadcast(chain, sent, 2, chunk_bytes=16, small_bytes=-1)
        chain.close()
        return sent

    for summed in run_ranks(size, reduce_body, hub=ring_hub):
        assert np.array_equal(summed, rows.sum(axis=0))
    assert ring_hub.frames_landed == size * (size - 1) * chunks  # n - 1 copy rounds of `chunks` frames
    for sent in run_ranks(size, broadcast_body, hub=chain_hub):
        assert np.array_equal(sent, rows[2])
    assert chain_hub.frames_landed <= (size - 1) * rows.shape[1] // 2
