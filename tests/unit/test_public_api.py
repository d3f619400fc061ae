"""The public surface is the curated ``__all__`` and matches API.md's names."""

from __future__ import annotations

import collsvc

API_NAMES = {
    "init",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "is_initialized",
    "destroy",
    "Communicator",
    "ReduceOp",
    "SUM",
    "PRODUCT",
    "MIN",
    "MAX",
    "BAND",
    "BOR",
    "BXOR",
    "AVG",
    "CollsvcError",
    "RankFailedError",
    "CollectiveTimeoutError",
    "CollectiveMismatchError",
    "AuthenticationError",
    "RendezvousError",
    "AbortedError",
    "Work",
}
METHODS = {
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "all_to_all",
    "send",
    "recv",
    "barrier",
    "broadcast_object",
    "all_gather_object",
    "new_group",
    "find_group",
    "intra_node",
    "inter_node",
    "all_reduce_callback",
    "abort",
    "close",
}


def test_exported_members() -> None:
    assert set(collsvc.__all__) >= API_NAMES
    for name in collsvc.__all__:
        assert hasattr(collsvc, name), name
    assert all(issubclass(getattr(collsvc, n), collsvc.CollsvcError) for n in API_NAMES if n.endswith("Error"))


def test_communicator_methods() -> None:
    assert set(dir(collsvc.Communicator)) >= METHODS
    assert collsvc.SUM is collsvc.ReduceOp.SUM


def test_not_initialized_is_a_clear_error() -> None:
    assert not collsvc.is_initialized()
    try:
        collsvc.get_rank()
    except collsvc.CollsvcError as exc:
        assert "init" in str(exc)
    else:
        raise AssertionError("get_rank before init must raise")
