"""Every collsvc error, core and torch-facing, survives pickle with its class and attributes: torch pickles
a Future's error (DDP's reducer, ``then`` callbacks) and ``torch.multiprocessing`` sends errors between
processes."""

from __future__ import annotations

import importlib
import pickle
from typing import Any

import pytest

from collsvc import errors


def _samples() -> list[errors.CollsvcError]:
    return [
        errors.CollsvcError("plain"),
        errors.JobBrokenError("broken"),
        errors.RankFailedError("rank 1 died", [1], ["node-b"]),
        errors.CollectiveTimeoutError("late", [{"rank": 2, "host": "node-c", "last_op": "", "finished_seq": 4}]),
        errors.CollectiveMismatchError("differ", {0: {"op": "all_reduce"}, 1: {"op": "broadcast"}}),
        errors.AbortedError("aborted", "by hand"),
        errors.RendezvousError("no coordinator"),
        errors.AuthenticationError("bad token"),
        errors.BackendUnavailableError("no GPU"),
        errors.ResourceLimitError("too big"),
        errors.JobEndedError("ended", "rank 0 left", [0]),
        errors.ForkedChildError("forked"),
    ]


def _every_class() -> set[type[errors.CollsvcError]]:
    found: set[type[errors.CollsvcError]] = set()
    todo: list[type[errors.CollsvcError]] = [errors.CollsvcError]
    while todo:
        cls = todo.pop()
        found.add(cls)
        todo.extend(c for c in cls.__subclasses__() if c.__module__ == errors.__name__)
    return found


def _same(a: BaseException, b: BaseException) -> None:
    assert type(a) is type(b)
    assert a.args == b.args and str(a) == str(b)
    assert a.__dict__ == b.__dict__
    assert getattr(a, "ranks", None) == getattr(b, "ranks", None)


def test_the_samples_cover_every_class() -> None:
    assert {type(e) for e in _samples()} == _every_class()


@pytest.mark.parametrize("error", _samples(), ids=lambda e: type(e).__name__)
def test_core_errors_round_trip(error: errors.CollsvcError) -> None:
    _same(error, pickle.loads(pickle.dumps(error)))


@pytest.mark.parametrize("error", _samples(), ids=lambda e: type(e).__name__)
def test_torch_facing_errors_round_trip_under_their_own_name(error: errors.CollsvcError) -> None:
    pytest.importorskip("torch")
    import torch.distributed as dist

    from collsvc.torch import to_torch_error

    converted: Any = to_torch_error(error)
    cls = type(converted)
    assert isinstance(converted, dist.DistBackendError) and isinstance(converted, type(error))
    assert getattr(importlib.import_module(cls.__module__), cls.__qualname__) is cls  # pickle finds it by name
    assert pickle.loads(pickle.dumps(cls)) is cls
    back = pickle.loads(pickle.dumps(converted))
    _same(converted, back)
    assert isinstance(back, dist.DistBackendError)
