"""The Work a synchronous collective on CPU tensors returns (``CompletedWork``, collsvc/torch/_work.py):
made in one step with shared done-state, it must still behave as a finished ``dist.Work`` of its own."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from collsvc.torch._work import CompletedWork  # noqa: E402


def test_a_completed_work_is_a_finished_dist_work_with_its_outputs() -> None:
    t = torch.arange(4.0)
    work = CompletedWork([t], "allreduce in group 'world'")
    assert isinstance(work, dist.Work)
    assert work.wait() is True and work.is_completed() and work.is_success()
    assert work.exception() is None
    assert work.result()[0] is t
    future = work.get_future()
    assert future is work.get_future() and future.done()
    assert future.wait()[0] is t
    assert future.then(lambda f: f.value()[0].sum().item()).wait() == 6.0


def test_completed_works_keep_their_own_outputs_and_futures() -> None:
    a, b = torch.zeros(2), torch.ones(3)
    first, second = CompletedWork([a], "one"), CompletedWork([b], "two")
    assert first.get_future() is not second.get_future()
    assert first.result()[0] is a and second.result()[0] is b
    assert first._description == "one" and second._description == "two"


def test_threads_asking_one_completed_work_for_its_future_get_the_same_one() -> None:
    work = CompletedWork([torch.zeros(1)], "x")
    start = threading.Barrier(4)
    seen: list[object] = []

    def ask() -> None:
        start.wait(timeout=10)
        seen.append(work.get_future())

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(seen) == 4 and all(future is seen[0] for future in seen)
