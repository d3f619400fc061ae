"""A member's position among hosts, and Horovod's cross communicator's members (pure)."""

from __future__ import annotations

from collsvc.client.placement import Placement, placement_of, same_local_rank


def test_positions_on_interleaved_hosts() -> None:
    hosts = ["a", "b", "a", "c", "b", "a"]
    assert placement_of(hosts, 0) == Placement(local_rank=0, local_size=3, node_rank=0, num_nodes=3)
    assert placement_of(hosts, 4) == Placement(local_rank=1, local_size=2, node_rank=1, num_nodes=3)
    assert placement_of(hosts, 5) == Placement(local_rank=2, local_size=3, node_rank=0, num_nodes=3)
    assert placement_of(hosts, 3) == Placement(local_rank=0, local_size=1, node_rank=2, num_nodes=3)


def test_one_host() -> None:
    assert placement_of(["h"] * 4, 2) == Placement(local_rank=2, local_size=4, node_rank=0, num_nodes=1)


def test_cross_members_skip_hosts_without_that_position() -> None:
    hosts = {10: "a", 11: "b", 12: "a", 13: "c", 14: "b", 15: "a"}
    ranks = [10, 11, 12, 13, 14, 15]
    assert same_local_rank(ranks, hosts, 0) == [10, 11, 13]
    assert same_local_rank(ranks, hosts, 1) == [12, 14]
    assert same_local_rank(ranks, hosts, 2) == [15]
    assert same_local_rank([11, 14], hosts, 1) == [14]  # positions count within the group
