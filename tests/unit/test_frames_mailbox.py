from __future__ import annotations

import threading
import time

import pytest

from collsvc.client.backends.ring import frames
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.errors import RankFailedError


def frame(payload: bytes, **kw: int) -> bytes:
    header = frames.encode_header(
        kw.get("src", 1), 42, kw.get("seq", 3), kw.get("step", 5), 99, b'{"op":"x"}', len(payload)
    )
    return header + payload


def test_frame_round_trip_is_zero_copy_view() -> None:
    data = frame(b"abcdef")
    header, payload = frames.decode(data, max_payload=1024)
    assert (header.src, header.key_hash, header.seq, header.step, header.digest) == (1, 42, 3, 5, 99)
    assert header.signature.rstrip() == b'{"op":"x"}'
    assert (len(data) - len(payload)) % 64 == 0  # payload starts aligned
    assert bytes(payload) == b"abcdef" and isinstance(payload, memoryview)


@pytest.mark.parametrize(
    "data",
    [b"", b"short", b"XXXX" + frame(b"a")[4:], frame(b"abc")[:-1], frame(b"abc") + b"extra"],
)
def test_malformed_frames_are_rejected(data: bytes) -> None:
    with pytest.raises(frames.FrameError):
        frames.decode(data, max_payload=1024)


def test_frame_over_limit_is_rejected_before_use() -> None:
    with pytest.raises(frames.FrameError, match="over the limit"):
        frames.decode(frame(b"x" * 100), max_payload=10)


def test_mailbox_hands_out_frames_that_arrived_early_and_late() -> None:
    box = Mailbox()
    header, payload = frames.decode(frame(b"early"), 1024)
    box.deposit(header, payload)
    key = (42, 3, 5, 1)
    assert box.take(key, time.monotonic() + 1)[1].tobytes() == b"early"
    late_header, late_payload = frames.decode(frame(b"late", step=6), 1024)
    threading.Timer(0.05, box.deposit, (late_header, late_payload)).start()
    got = box.take((42, 3, 6, 1), time.monotonic() + 5)
    assert got is not None and bytes(got[1]) == b"late"


def test_mailbox_deadline_returns_none() -> None:
    start = time.monotonic()
    assert Mailbox().take((1, 1, 1, 1), start + 0.05) is None
    assert time.monotonic() - start < 1.0


def test_failure_wakes_waiters_but_present_frames_still_win() -> None:
    box = Mailbox()
    header, payload = frames.decode(frame(b"there"), 1024)
    box.deposit(header, payload)
    box.fail(RankFailedError("rank 2 died", [2], ["h"]))
    assert box.take((42, 3, 5, 1), time.monotonic() + 1) is not None
    with pytest.raises(RankFailedError):
        box.take((42, 3, 9, 1), time.monotonic() + 10)


def test_failure_wakes_a_blocked_waiter_promptly() -> None:
    box = Mailbox()
    threading.Timer(0.05, box.fail, (RankFailedError("gone", [1]),)).start()
    start = time.monotonic()
    with pytest.raises(RankFailedError):
        box.take((1, 1, 1, 1), start + 30)
    assert time.monotonic() - start < 5


def test_departed_rank_dooms_only_calls_it_never_finished() -> None:
    box = Mailbox()
    left = RankFailedError("rank 2 left the job", [2], ["h"])
    box.depart([2], left, {2: {"world": 7}})
    soon = time.monotonic() + 0.05
    # Call 7 of "world" (and its hierarchical sub-calls) finished on rank 2: waits go on to the deadline.
    assert box.take((1, 7, 0, 0), soon, waiter=("world", 7, (0, 1, 2))) is None
    assert box.take((1, 7, 0, 0), time.monotonic() + 0.05, waiter=("world/leaders/3", 7, (0, 1, 2))) is None
    # Call 8 needs rank 2, which left before it: the wait fails at once, even for a frame from rank 1.
    start = time.monotonic()
    with pytest.raises(RankFailedError):
        box.take((1, 8, 0, 1), start + 30, waiter=("world", 8, (0, 1, 2)))
    with pytest.raises(RankFailedError):
        box.take((1, 8, 0, 1), start + 30, waiter=("world/host", 8, (0, 1, 2)))
    assert time.monotonic() - start < 5
    # A group without rank 2 is not affected.
    assert box.take((2, 8, 0, 1), time.monotonic() + 0.05, waiter=("evens", 8, (0, 1))) is None


def test_a_refused_peer_that_left_is_explained_by_its_departure_news() -> None:
    box = Mailbox()
    refused = RankFailedError("sending to rank 0 failed (UNAVAILABLE)", [0])
    box.unreachable(0, refused, grace=30.0)
    cause = RankFailedError("rank 1 failed (rank 0 left the job after ...)", [1])
    # The departure news arrives while the refusal waits for it (from the coordinator's event thread).
    threading.Timer(0.05, box.depart, args=([0], cause, {0: {"world": 0}})).start()
    started = time.monotonic()
    assert box.explain(0, ("world", 1, (0, 1, 2))) is cause
    assert time.monotonic() - started < 5.0  # the news ended the wait, not the grace
    # A departure is not a failure: waits for other frames go on.
    assert box.take((42, 1, 0, 2), time.monotonic() + 0.05) is None


def test_a_refused_peer_without_news_fails_the_process_after_the_grace() -> None:
    box = Mailbox()
    refused = RankFailedError("sending to rank 0 failed (UNAVAILABLE)", [0])
    box.unreachable(0, refused, grace=0.1)
    started = time.monotonic()
    assert box.explain(0) is None  # no news: the caller's own delivery error stands
    assert 0.05 < time.monotonic() - started < 5.0
    with pytest.raises(RankFailedError) as caught:
        box.take((42, 1, 0, 2), time.monotonic() + 5.0)
    assert caught.value is refused


def test_a_refused_peer_is_explained_by_a_failure_that_arrived_meanwhile() -> None:
    box = Mailbox()
    box.unreachable(0, RankFailedError("sending to rank 0 failed", [0]), grace=30.0)
    failed = RankFailedError("rank 1 died", [1])
    threading.Timer(0.05, box.fail, args=(failed,)).start()
    assert box.explain(0) is failed


def test_first_present_returns_the_key_that_arrived_and_leaves_its_frame() -> None:
    box = Mailbox()
    waiting, arrived = (99, 1, 0, 1), (42, 1, 0, 2)
    header, payload = frames.decode(frame(b"xy", src=2, seq=1, step=0), max_payload=64)
    box.deposit(header, payload)
    assert box.first_present([waiting, arrived], time.monotonic() + 5) == arrived
    assert box.take(arrived, time.monotonic() + 1) is not None  # still there for the receive
    assert box.first_present([waiting], time.monotonic() + 0.05) is None


def test_first_present_raises_when_every_sender_left() -> None:
    box = Mailbox()
    left = RankFailedError("rank 1 left", [1])
    box.depart([1], left)
    box.depart([2], RankFailedError("rank 2 left", [2]))
    with pytest.raises(RankFailedError) as caught:
        box.first_present([(42, 1, 0, 1), (42, 1, 0, 2)], time.monotonic() + 5)
    assert caught.value is left
