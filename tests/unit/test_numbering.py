"""Sequence numbers per stream (collsvc/client/numbering.py): equal numbers on two ranks mean the same call,
so no number may repeat or be skipped, whatever threads number calls."""

from __future__ import annotations

import sys
import threading

from collsvc.client.numbering import StreamNumbers


def test_each_stream_counts_its_own_calls_from_one() -> None:
    numbers = StreamNumbers()
    assert numbers.peek("world") == 1
    assert [numbers.next("world") for _ in range(3)] == [1, 2, 3]
    assert numbers.next("p2p:0>1") == 1
    assert numbers.peek("world") == 4 and numbers.peek("p2p:0>1") == 2 and numbers.peek("other") == 1
    assert numbers.next("world") == 4


def test_threads_numbering_one_stream_get_every_number_once() -> None:
    numbers = StreamNumbers()
    start = threading.Barrier(4)
    taken: list[list[int]] = [[] for _ in range(4)]

    def number(mine: list[int]) -> None:
        start.wait(timeout=10)
        for _ in range(5000):
            mine.append(numbers.next("world"))

    threads = [threading.Thread(target=number, args=(mine,)) for mine in taken]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: interleave the calls
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        sys.setswitchinterval(interval)
    every = sorted(n for mine in taken for n in mine)
    assert every == list(range(1, 20001))
    assert all(mine == sorted(mine) for mine in taken)  # each thread's own calls in its order


def test_a_streams_number_function_shares_its_count_with_next_and_peek() -> None:
    numbers = StreamNumbers()
    number = numbers.of("world")
    assert [number(), numbers.next("world"), number()] == [1, 2, 3]
    assert numbers.peek("world") == 4 and numbers.next("other") == 1
