"""LocalGroup under mismatch, missing ranks, fail() and bad configuration: errors, not hangs."""

from __future__ import annotations

import os
import threading
import time
import uuid

import numpy as np
import pytest

from collsvc.client.backends.shm import LocalGroup
from collsvc.errors import CollectiveMismatchError, CollectiveTimeoutError, CollsvcError, RendezvousError
from collsvc.types import ReduceOp
from tests.unit.other_user import send_descriptor_as_nobody
from tests.unit.shm.threads import run_group, run_ranks


def test_different_digests_raise_on_every_rank_and_the_group_stays_usable() -> None:
    def work(group: LocalGroup) -> dict[int, str]:
        buf = np.full(4, group.rank + 1.0)
        with pytest.raises(CollectiveMismatchError) as info:
            group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 5, digest=100 + (group.rank == 2))
        assert (buf == group.rank + 1.0).all(), "data was combined despite the mismatch"
        group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 5, digest=7)
        assert (buf == 6.0).all()
        return info.value.details

    details = run_group(3, work)
    assert details[0] == details[1] == details[2]
    # Per-rank values of each call (decoded descriptors), with the digests that differ.
    assert {rank: d["digest"] for rank, d in details[0].items()} == {
        0: f"{100:#018x}",
        1: f"{100:#018x}",
        2: f"{101:#018x}",
    }
    assert details[0][0]["op"] == "all_reduce" and details[0][0]["reduce_op"] == "SUM"


def test_different_calls_are_caught_without_a_digest() -> None:
    def work(group: LocalGroup) -> None:
        with pytest.raises(CollectiveMismatchError):
            if group.rank == 0:
                group.broadcast(np.zeros(10_000), 0, time.monotonic() + 5)  # many rounds
            else:
                group.all_reduce(np.zeros(9_000), ReduceOp.SUM, time.monotonic() + 5)
        group.barrier(time.monotonic() + 5)

    run_group(2, work)


@pytest.mark.parametrize(("size", "waiter"), [(2, 0), (3, 0), (3, 1)])
def test_a_rank_that_never_arrives_times_out_by_name(size: int, waiter: int) -> None:
    absent = size - 1
    ready = threading.Event()
    done = threading.Event()

    def work(group: LocalGroup) -> float:
        if group.rank == absent:
            ready.set()
            done.wait(10)  # joined the group, never calls the collective
            return 0.0
        start = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as info:
            group.all_reduce(np.ones(100), ReduceOp.SUM, start + 0.3)
        elapsed = time.monotonic() - start
        if group.rank == waiter:
            assert info.value.ranks == [absent]
        with pytest.raises(CollectiveTimeoutError):  # the group is out of step now: it stays failed
            group.barrier(time.monotonic() + 5)
        return elapsed

    def release_when_timed_out() -> None:
        ready.wait(10)

    watcher = threading.Thread(target=release_when_timed_out)
    watcher.start()
    try:
        results = run_group(
            size,
            lambda g: _finish(work(g), g, absent, done),
        )
    finally:
        done.set()
        watcher.join()
    assert all(r < 2.0 for r in results)


def _finish(value: float, group: LocalGroup, absent: int, done: threading.Event) -> float:
    if group.rank != absent:
        done.set()
    return value


def test_fail_wakes_a_blocked_waiter_and_every_later_call_raises_it() -> None:
    namespace = uuid.uuid4().hex
    joined = threading.Event()
    peer = threading.Thread(target=lambda: _join_and_wait(namespace, joined))
    peer.start()
    try:
        with LocalGroup(namespace, 0, 2, timeout=5) as group:
            joined.wait(5)
            boom = RuntimeError("coordinator says rank 1 died")
            timer = threading.Timer(0.1, group.fail, args=(boom,))
            start = time.monotonic()
            timer.start()
            with pytest.raises(RuntimeError) as info:
                group.barrier(time.monotonic() + 10)
            assert info.value is boom and time.monotonic() - start < 2.0
            with pytest.raises(RuntimeError):
                group.all_reduce(np.ones(3), ReduceOp.SUM, time.monotonic() + 10)
            timer.join()
    finally:
        joined.set()
        peer.join()


def test_fail_on_a_group_of_one_is_raised_by_its_next_call() -> None:
    """A group of one has no sockets to wake: fail() and wake() only record, and never raise."""
    with LocalGroup(uuid.uuid4().hex, 0, 1, timeout=5) as group:
        boom = RuntimeError("coordinator says the job failed")
        group.fail(boom)
        group.wake()
        with pytest.raises(RuntimeError) as info:
            group.barrier(time.monotonic() + 5)
        assert info.value is boom


def _join_and_wait(namespace: str, joined: threading.Event) -> None:
    with LocalGroup(namespace, 1, 2, timeout=5):
        joined.set()
        joined.wait(5)


def test_construction_times_out_naming_the_ranks_that_never_came() -> None:
    namespace = uuid.uuid4().hex
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        LocalGroup(namespace, 1, 3, timeout=0.3)
    assert info.value.ranks == [0, 2]
    # The group is named by the namespace's first 16 characters (the job's and group's hash prefix).
    assert str(info.value).startswith(f"shm group {namespace[:16]} local rank 1/3: local ranks [0, 2] ")
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("local_rank", [-1, 3])
def test_a_local_rank_outside_the_group_is_refused_naming_the_valid_range(local_rank: int) -> None:
    with pytest.raises(ValueError, match=rf"local_rank {local_rank} is outside 0\.\.2$"):
        LocalGroup(uuid.uuid4().hex, local_rank, 3, timeout=1)


def test_ranks_starting_at_different_times_join() -> None:
    namespace = uuid.uuid4().hex
    waiting = threading.Event()

    def rank(r: int) -> float:
        if r == 1:
            waiting.wait(5)
        group = LocalGroup(namespace, r, 2, timeout=None)
        if r == 0:
            waiting.set()  # rank 0 is bound and about to wait for rank 1 when rank 1 starts
        with group:
            group.connect(time.monotonic() + 5)
            buf = np.ones(3)
            group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 5)
            return float(buf[0])

    assert run_ranks(rank, range(2), 2) == [2.0, 2.0]


def test_a_namespace_in_use_and_disagreeing_slot_sizes_are_rendezvous_errors() -> None:
    namespace = uuid.uuid4().hex

    def rank(r: int) -> RendezvousError:
        with pytest.raises(RendezvousError) as raised:
            LocalGroup(namespace, r, 2, slot_bytes=4096 * (r + 1), timeout=2).close()
        return raised.value

    errors = run_ranks(rank, range(2), 2)
    assert len(errors) == 2 and all(isinstance(e, RendezvousError) for e in errors)

    def duplicate(group: LocalGroup) -> None:
        if group.rank == 0:
            with pytest.raises(RendezvousError):
                LocalGroup(namespace, 1, 2, timeout=1)
        group.barrier(time.monotonic() + 5)

    run_group(2, duplicate, namespace=namespace)


def test_close_releases_every_descriptor_and_leaves_nothing_in_dev_shm() -> None:
    before = set(os.listdir("/proc/self/fd"))
    shm_before = set(os.listdir("/dev/shm"))
    run_group(3, lambda g: g.barrier(time.monotonic() + 5))
    assert set(os.listdir("/proc/self/fd")) <= before
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_a_departure_seen_after_the_deadline_does_not_replace_the_timeout() -> None:
    """A peer that timed out in the same call a moment earlier and then left is no culprit: the waiter
    that wakes up after its own deadline reports the timeout, naming the rank that never came."""
    namespace = uuid.uuid4().hex
    joined = threading.Event()
    peer = threading.Thread(target=lambda: _join_and_wait(namespace, joined))
    peer.start()
    try:
        with LocalGroup(namespace, 0, 2, timeout=5, spin=0.0) as group:
            joined.wait(5)
            deadline = time.monotonic() + 0.3

            def departure_after_the_deadline() -> None:
                if time.monotonic() >= deadline:
                    raise RuntimeError("rank 1 left the job")

            group.watch(departure_after_the_deadline)
            timer = threading.Timer(0.35, group.wake)  # the departure's news arrives after the deadline
            timer.start()
            with pytest.raises(CollectiveTimeoutError) as info:
                group.barrier(deadline)
            assert info.value.ranks == [1]
            timer.join()
    finally:
        joined.set()
        peer.join()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send as another user")
def test_a_segment_offered_by_another_user_under_a_peers_name_is_ignored() -> None:
    from collsvc.client.backends.shm import doorbell, steps
    from collsvc.client.backends.shm.segment import Layout, Segment

    namespace = uuid.uuid4().hex
    waiting = LocalGroup(namespace, 1, 2, slot_bytes=4096, timeout=None)
    layout = Layout.for_group(4096, 2)
    forged, fd = Segment.create(layout)
    hello = steps._HELLO.pack(2, layout.slot_bytes, waiting._memory_barriers)
    base = doorbell._names(namespace)
    # another user takes local rank 0's outbox name first and offers its own segment
    send_descriptor_as_nobody(base + b"/0>1", base + b"/1", doorbell.HEADER.pack(doorbell.HELLO, 0, 0) + hello, fd)
    os.close(fd)
    forged.close()

    def rank(index: int) -> float:
        group = waiting if index == 1 else LocalGroup(namespace, index, 2, slot_bytes=4096, timeout=5.0)
        with group:
            group.connect(time.monotonic() + 5.0)
            buf = np.full(8, index + 1.0)
            group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 5.0)
            return float(buf[0])

    assert run_ranks(rank, range(2), 2) == [
        3.0,
        3.0,
    ]  # the genuine rank 0's segment, not the impostor's (which never arrives)


def _signature_of(nbytes: int) -> bytes:
    """A call signature (JSON) of exactly ``nbytes`` bytes."""
    label = b'{"pad": "' + b"x" * (nbytes - 11) + b'"}'
    assert len(label) == nbytes
    return label


@pytest.mark.parametrize(
    ("slot_bytes", "label_bytes", "whole"),
    [(4096, 1020, True), (4096, 1021, False), (1024, 1020, True), (1024, 3000, False)],
)
def test_a_mismatch_shows_signatures_up_to_one_kib_and_falls_back_to_descriptors_past_that(
    slot_bytes: int, label_bytes: int, whole: bool
) -> None:
    """Each rank publishes at most 1 KiB (its length word included) of its signature after a mismatch;
    a longer one arrives cut, is no JSON then, and the error describes that rank by its descriptor."""

    def work(group: LocalGroup) -> dict[int, dict[str, str]]:
        group.label(lambda: _signature_of(label_bytes))
        with pytest.raises(CollectiveMismatchError) as info:
            group.all_reduce(np.ones(4), ReduceOp.SUM, time.monotonic() + 10, digest=group.rank)
        details: dict[int, dict[str, str]] = info.value.details
        return details

    for details in run_group(2, work, slot_bytes=slot_bytes):
        for rank in (0, 1):
            assert details[rank]["op"] == "all_reduce"  # the descriptor, always
            assert ("pad" in details[rank]) == whole, details[rank].keys()


def test_a_mismatch_whose_signature_exchange_fails_still_raises_the_mismatch_by_descriptors() -> None:
    """After a mismatch every rank takes one more step to publish its signature; where that step fails
    (here rank 1 cannot produce its signature and fails rank 0's group), rank 0 still raises the
    mismatch, describing each rank by its descriptor."""
    groups: dict[int, LocalGroup] = {}

    def give_up() -> bytes:
        groups[0].fail(CollsvcError("rank 1 gave up"))
        raise RuntimeError("no signature")

    def work(group: LocalGroup) -> dict[int, dict[str, str]]:
        groups[group.rank] = group
        group.barrier(time.monotonic() + 10)  # both groups are known before either uses the other
        if group.rank == 1:
            group.label(give_up)
            with pytest.raises(RuntimeError, match="no signature"):
                group.all_reduce(np.ones(4), ReduceOp.SUM, time.monotonic() + 10, digest=1)
            return {}
        group.label(lambda: b'{"shape": [4]}')
        with pytest.raises(CollectiveMismatchError) as info:
            group.all_reduce(np.ones(4), ReduceOp.SUM, time.monotonic() + 10, digest=0)
        details: dict[int, dict[str, str]] = info.value.details
        return details

    details = run_group(2, work)[0]
    assert [details[rank]["digest"] for rank in (0, 1)] == [f"{0:#018x}", f"{1:#018x}"]
    assert "shape" not in details[0]  # no signatures: the exchange failed
