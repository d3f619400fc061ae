from __future__ import annotations

import pytest

from collsvc.errors import ResourceLimitError
from collsvc.options import Limits
from collsvc.server.state.barriers import BarrierBook
from collsvc.server.state.kvstore import KVStore


def test_barrier_completes_when_all_arrive() -> None:
    book = BarrierBook()
    assert not book.arrive("world", 1, 0, 3)
    assert not book.arrive("world", 1, 1, 3)
    assert book.missing("world", 1, range(3)) == [2]
    assert book.arrive("world", 1, 2, 3)
    assert book.is_complete("world", 1)
    assert book.missing("world", 1, range(3)) == []


def test_back_to_back_generations_do_not_mix() -> None:
    book = BarrierBook()
    assert not book.arrive("world", 1, 0, 2)
    assert book.arrive("world", 1, 1, 2)
    # Rank 0 races ahead into generation 2; a late retry of generation 1 must not count for it.
    assert not book.arrive("world", 2, 0, 2)
    assert book.arrive("world", 1, 0, 2)  # retry of a completed barrier: complete at once
    assert not book.is_complete("world", 2)
    assert book.arrive("world", 2, 1, 2)
    assert book.is_complete("world", 2)


def test_duplicate_arrival_counts_once_and_groups_are_separate() -> None:
    book = BarrierBook()
    assert not book.arrive("g", 1, 0, 2)
    assert not book.arrive("g", 1, 0, 2)
    assert not book.arrive("world", 1, 1, 2)
    assert book.pending() == [("g", 1), ("world", 1)]


def test_generation_must_start_at_one() -> None:
    with pytest.raises(ValueError):
        BarrierBook().arrive("world", 0, 0, 1)


def test_kv_set_get_delete() -> None:
    kv = KVStore(Limits())
    assert kv.get("k") is None
    kv.set("k", b"v")
    assert kv.get("k") == b"v"
    assert kv.delete("k")
    assert not kv.delete("k")
    with pytest.raises(ValueError):
        kv.set("", b"x")


def test_kv_add_is_a_decimal_counter() -> None:
    kv = KVStore(Limits())
    assert kv.add("n", 5) == 5
    assert kv.add("n", -2) == 3
    assert kv.get("n") == b"3"
    kv.set("s", b"abc")
    with pytest.raises(ValueError):
        kv.add("s", 1)
    kv.set("big", str(2**63 - 1).encode())
    with pytest.raises(ValueError):
        kv.add("big", 1)


def test_kv_compare_set() -> None:
    kv = KVStore(Limits())
    assert kv.compare_set("k", expect_absent=True, expected=b"", desired=b"a") == (True, b"a")
    assert kv.compare_set("k", expect_absent=True, expected=b"", desired=b"b") == (False, b"a")
    assert kv.compare_set("k", expect_absent=False, expected=b"x", desired=b"b") == (False, b"a")
    assert kv.compare_set("k", expect_absent=False, expected=b"a", desired=b"b") == (True, b"b")
    assert kv.compare_set("absent", expect_absent=False, expected=b"a", desired=b"b") == (False, b"")


def test_kv_limits() -> None:
    kv = KVStore(Limits(max_key_bytes=4, max_value_bytes=8, max_keys_per_job=2))
    with pytest.raises(ResourceLimitError):
        kv.set("toolong", b"")
    with pytest.raises(ResourceLimitError):
        kv.set("k", b"123456789")
    kv.set("a", b"")
    kv.set("b", b"")
    kv.set("a", b"ok")  # overwriting an existing key needs no room
    with pytest.raises(ResourceLimitError):
        kv.set("c", b"")
    with pytest.raises(ResourceLimitError):
        kv.add("c", 1)
