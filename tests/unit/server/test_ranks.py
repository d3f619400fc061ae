from __future__ import annotations

import random

import pytest

from collsvc.server.state.ranks import assign_ranks


def _ranks(members: list[tuple[str, int | None, int | None, int, int]]) -> list[int]:
    placements, _ = assign_ranks(members, len(members))
    return [p.rank for p in placements]


def test_hosts_get_contiguous_ranks_in_host_name_order() -> None:
    # Arrivals interleave hosts; ranks must still be contiguous per host, hosts sorted by name.
    members = [(f"host{i % 3}", None, None, 100 + i, i) for i in range(9)]
    placements, num_nodes = assign_ranks(members, 9)
    by_host: dict[str, list[int]] = {}
    for (host, *_), p in zip(members, placements, strict=True):
        by_host.setdefault(host, []).append(p.rank)
    assert sorted(by_host["host0"]) == [0, 1, 2]
    assert sorted(by_host["host1"]) == [3, 4, 5]
    assert sorted(by_host["host2"]) == [6, 7, 8]
    assert num_nodes == 3
    for (host, *_), p in zip(members, placements, strict=True):
        assert p.local_size == 3
        assert p.node_rank == int(host[-1])
        assert p.local_rank == p.rank % 3


def test_assignment_does_not_depend_on_arrival_order() -> None:
    base = [(f"h{i % 4}", None, i % 2 if i % 3 else None, 1000 + i) for i in range(32)]
    expected = None
    for seed in range(5):
        order = list(range(32))
        random.Random(seed).shuffle(order)
        members = [(*base[j], arrival) for arrival, j in enumerate(order)]
        ranks = _ranks(members)
        by_identity = {base[j]: r for j, r in zip(order, ranks, strict=True)}
        if expected is None:
            expected = by_identity
        assert by_identity == expected


def test_local_rank_hint_then_pid_order_within_a_host() -> None:
    members = [
        ("a", None, 1, 50, 0),
        ("a", None, 0, 60, 1),
        ("a", None, None, 10, 2),
        ("a", None, None, 5, 3),
    ]
    assert _ranks(members) == [1, 0, 3, 2]


def test_requested_ranks_are_honoured_and_others_fill_the_gaps() -> None:
    members = [("b", 0, None, 1, 0), ("a", None, None, 1, 1), ("a", None, None, 2, 2), ("b", 3, None, 2, 3)]
    ranks = _ranks(members)
    assert ranks[0] == 0 and ranks[3] == 3
    assert sorted(ranks) == [0, 1, 2, 3]


def test_host_with_requested_rank_extends_it_contiguously() -> None:
    members = [
        ("b", 2, None, 1, 0),
        ("b", None, None, 2, 1),
        ("a", None, None, 1, 2),
        ("a", None, None, 2, 3),
    ]
    ranks = _ranks(members)
    assert ranks == [2, 3, 0, 1]


def test_node_rank_orders_hosts_by_lowest_rank() -> None:
    members = [("z", 0, None, 1, 0), ("a", None, None, 1, 1)]
    placements, num_nodes = assign_ranks(members, 2)
    assert [p.node_rank for p in placements] == [0, 1]
    assert num_nodes == 2


def test_member_count_must_match_world_size() -> None:
    with pytest.raises(ValueError):
        assign_ranks([("a", None, None, 1, 0)], 2)


def test_large_assignment_is_fast_enough() -> None:
    members = [(f"host{i % 512:04d}", None, i // 512, i, i) for i in range(16384)]
    placements, num_nodes = assign_ranks(members, len(members))
    assert num_nodes == 512
    assert sorted(p.rank for p in placements) == list(range(16384))
