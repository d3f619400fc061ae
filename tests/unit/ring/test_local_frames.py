"""Frames between ranks of one host through shared-memory rings: the ring itself, and two ranks' ends
(``LocalFrames``) in one process, each with its own inbox, thread and mailbox."""

from __future__ import annotations

import array
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from collsvc.client.backends.ring import frames, local_frames
from collsvc.client.backends.ring.local_frames import LocalFrames, inbox_base
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.client.backends.shm.frame_ring import FrameRing, supported
from collsvc.errors import RankFailedError
from tests.unit.other_user import send_descriptor_as_nobody

pytestmark = pytest.mark.skipif(not supported(), reason="frame rings need x86-64's memory ordering")


def record(index: int, size: int) -> bytes:
    return bytes([index % 251]) * size


def test_ring_returns_records_in_order_across_many_wraps() -> None:
    ring, fd = FrameRing.create(1024)
    reader = FrameRing.attach(fd)
    os.close(fd)
    sent, got = [], []
    for index in range(2000):
        data = record(index, (index * 37) % 300)
        while not ring.put((data[:5], memoryview(data)[5:]), len(data)):
            got.extend(reader.take_all())  # full: the reader makes room
        sent.append(data)
        if index % 7 == 0:
            got.extend(reader.take_all())
    got.extend(reader.take_all())
    assert got == sent
    assert reader.take_all() == []
    ring.close()
    reader.close()


def test_full_ring_refuses_without_writing_and_large_records_never_fit() -> None:
    ring, fd = FrameRing.create(256)
    reader = FrameRing.attach(fd)
    os.close(fd)
    assert ring.fits(120) and not ring.fits(121)  # at most half the ring per record
    assert ring.put((b"a" * 100,), 100)
    assert ring.put((b"b" * 100,), 100)
    assert not ring.put((b"c" * 100,), 100)  # 2 x 112 of 256 used: no room for a third
    assert reader.take_all() == [b"a" * 100, b"b" * 100]
    assert ring.put((b"c" * 100,), 100)  # starts over at the beginning after a skip marker
    assert reader.take_all() == [b"c" * 100]


def test_attach_rejects_a_segment_of_the_wrong_shape() -> None:
    fd = os.memfd_create("not-a-ring")
    try:
        os.ftruncate(fd, 100)
        with pytest.raises(ValueError, match="not of a ring's shape"):
            FrameRing.attach(fd)
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="capacity"):
        FrameRing.create(100)


class SlowMailbox(Mailbox):
    """A mailbox whose deposits wait for ``release`` (a receiving rank that does not keep up)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def deposit_all(self, arrived: list[tuple[frames.FrameHeader, memoryview]]) -> None:
        self.release.wait(10)
        super().deposit_all(arrived)


def frame(src: int, step: int, payload: bytes) -> tuple[tuple[bytes, bytes], int]:
    header = frames.encode_header(src, 7, 1, step, 99, b"{}", len(payload))
    return (header, payload), len(header) + len(payload)


def take(box: Mailbox, src: int, step: int) -> bytes | None:
    got = box.take((7, 1, step, src), time.monotonic() + 10)
    return None if got is None else bytes(got[1])


@pytest.fixture
def base() -> bytes:
    return inbox_base(f"test-{uuid.uuid4().hex}", "token")


@pytest.fixture
def pair(base: bytes) -> Iterator[tuple[LocalFrames, LocalFrames, Mailbox]]:
    box = Mailbox()
    sender = LocalFrames(0, [1], base, Mailbox(), 1 << 30)
    receiver = LocalFrames(1, [0], base, box, 1 << 30)
    yield sender, receiver, box
    sender.close()
    receiver.close()


def test_frames_reach_the_peers_mailbox_in_any_number_and_size(pair: tuple[LocalFrames, LocalFrames, Mailbox]) -> None:
    sender, _, box = pair
    payloads = [os.urandom(size) for size in (0, 1, 4096, 1 << 20, 100, (1 << 20) + 5)]
    for step, payload in enumerate(payloads):
        parts, nbytes = frame(0, step, payload)
        assert sender.send(1, parts, nbytes)
    for step, payload in enumerate(payloads):
        assert take(box, 0, step) == payload


def test_a_frame_over_half_a_ring_or_to_a_remote_rank_takes_grpc(
    pair: tuple[LocalFrames, LocalFrames, Mailbox],
) -> None:
    sender, _, _ = pair
    parts, nbytes = frame(0, 0, b"x" * (local_frames.RING_BYTES // 2))
    assert not sender.send(1, parts, nbytes)
    small, size = frame(0, 1, b"x")
    assert not sender.send(5, small, size)  # not a local peer


def test_a_peer_without_an_inbox_gets_grpc_until_it_binds(base: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_frames, "_RETRY_AFTER", 0.0)
    sender = LocalFrames(0, [1], base, Mailbox(), 1 << 30)
    parts, nbytes = frame(0, 0, b"early")
    assert not sender.send(1, parts, nbytes)
    box = Mailbox()
    receiver = LocalFrames(1, [0], base, box, 1 << 30)
    try:
        parts, nbytes = frame(0, 1, b"later")
        assert sender.send(1, parts, nbytes)
        assert take(box, 0, 1) == b"later"
    finally:
        sender.close()
        receiver.close()


def test_a_peer_that_closed_makes_frames_take_grpc(pair: tuple[LocalFrames, LocalFrames, Mailbox]) -> None:
    sender, receiver, box = pair
    parts, nbytes = frame(0, 0, b"before")
    assert sender.send(1, parts, nbytes)
    assert take(box, 0, 0) == b"before"
    receiver.close()
    parts, nbytes = frame(0, 1, b"after")
    assert not sender.send(1, parts, nbytes)  # its inbox is gone: gRPC reports the peer
    assert not sender.send(1, parts, nbytes)


def test_a_full_ring_takes_grpc_after_a_short_wait(base: bytes) -> None:
    box = SlowMailbox()
    sender = LocalFrames(0, [1], base, Mailbox(), 1 << 30)
    receiver = LocalFrames(1, [0], base, box, 1 << 30)
    try:
        payload = b"y" * (1 << 20)
        results = []
        steps = 2 * local_frames.RING_BYTES // len(payload)
        for step in range(steps):  # twice a ring's bytes into a ring whose reader is stuck after its first pass
            parts, nbytes = frame(0, step, payload)
            started = time.monotonic()
            results.append(sender.send(1, parts, nbytes))
            # FULL_WAIT (10 ms) and the thread switches around it: a send that waited for the stuck
            # reader would never return. 5 s leaves room for a machine whose load average is in the
            # hundreds (1 s failed once at ~470).
            assert time.monotonic() - started < 5.0
        assert results[0] and not all(results)
        box.release.set()
        for step, through_ring in enumerate(results):
            if through_ring:
                assert take(box, 0, step) == payload
    finally:
        box.release.set()
        sender.close()
        receiver.close()


def test_messages_from_strangers_are_ignored(pair: tuple[LocalFrames, LocalFrames, Mailbox], base: bytes) -> None:
    sender, _, box = pair
    ring, fd = FrameRing.create(4096)
    parts, nbytes = frame(0, 9, b"forged")
    assert ring.put(parts, nbytes)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
        stranger.bind(base + b"/stranger")
        fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        stranger.sendmsg([local_frames._MESSAGE.pack(local_frames._RING, 0)], fds, 0, base + b"/1")
        stranger.sendto(b"", base + b"/1")  # an empty message does not stop the receiving thread
    os.close(fd)
    parts, nbytes = frame(0, 10, b"genuine")
    assert sender.send(1, parts, nbytes)
    assert take(box, 0, 10) == b"genuine"
    assert box.take((7, 1, 9, 0), time.monotonic() + 0.1) is None  # the forged ring was never read
    ring.close()


class BrokenInbox:
    """Stands for an inbox whose reads fail while it is open (what a bug closing its descriptor does)."""

    def recvmsg(self, *args: object) -> object:
        raise OSError(9, "Bad file descriptor")


def test_an_inbox_that_breaks_fails_this_ranks_waits_naming_it(
    pair: tuple[LocalFrames, LocalFrames, Mailbox], base: bytes
) -> None:
    _, receiver, box = pair
    inbox = receiver._inbox
    receiver._inbox = BrokenInbox()  # type: ignore[assignment]  # read on the thread's next pass
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
            stranger.sendto(b"", base + b"/1")  # wakes the thread from its read of the real inbox
        receiver._thread.join(timeout=10)
        assert not receiver._thread.is_alive()  # it stopped: no spinning on the error
        started = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1 can no longer receive") as caught:
            box.take((7, 1, 3, 0), time.monotonic() + 30)
        assert caught.value.ranks == [1]
        assert time.monotonic() - started < 5.0  # at once, not at the wait's deadline
    finally:
        receiver._inbox = inbox


def test_close_ends_the_thread_at_once(base: bytes) -> None:
    ends = LocalFrames(0, [1], base, Mailbox(), 1 << 30)
    started = time.monotonic()
    ends.close()
    ends.close()
    assert time.monotonic() - started < 1.0
    assert not ends._thread.is_alive()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send as another user")
def test_a_ring_from_another_user_is_ignored_even_from_the_right_name(
    pair: tuple[LocalFrames, LocalFrames, Mailbox], base: bytes
) -> None:
    sender, _, box = pair
    ring, fd = FrameRing.create(4096)
    parts, nbytes = frame(0, 9, b"forged")
    assert ring.put(parts, nbytes)
    # another user takes rank 0's outbox name before rank 0 does, and offers a ring
    send_descriptor_as_nobody(base + b"/0>1", base + b"/1", local_frames._MESSAGE.pack(local_frames._RING, 0), fd)
    os.close(fd)
    parts, nbytes = frame(0, 10, b"genuine")  # rank 0's own ring, after the impostor's message
    assert sender.send(1, parts, nbytes)
    assert take(box, 0, 10) == b"genuine"
    assert box.take((7, 1, 9, 0), time.monotonic() + 0.1) is None  # the impostor's ring was never read
    ring.close()
