"""Barriers through memory words: a sleeping waiter is woken, and both sides must agree on the kind."""

from __future__ import annotations

import os
import threading
import time
import uuid

import numpy as np
import pytest

from collsvc.client.backends.shm import LocalGroup
from collsvc.client.backends.shm.board import memory_barriers_supported
from collsvc.config import shm_barriers
from collsvc.errors import RendezvousError
from collsvc.types import ReduceOp
from tests.unit.shm.threads import run_group, run_ranks

needs_x86 = pytest.mark.skipif(not memory_barriers_supported(), reason="memory barriers need an x86-64 CPU")


@needs_x86
@pytest.mark.parametrize("size", [2, 3, 4])
def test_sleeping_waiters_are_woken_by_the_last_arrival(size: int) -> None:
    namespace = uuid.uuid4().hex
    arrived_late = threading.Event()

    def rank(r: int) -> float:
        # spin=0: every wait sleeps at once, so only the last arrival's pokes can wake the others.
        with LocalGroup(namespace, r, size, timeout=5, spin=0.0, barriers="memory") as group:
            buf = np.full(4, r + 1.0)
            if r == size - 1:
                # Arrive only once every other rank sleeps (its word in its segment says so).
                sleepers = group._segments[:-1]
                deadline = time.monotonic() + 5
                while not all(s.sleeping[0] for s in sleepers) and time.monotonic() < deadline:
                    os.sched_yield()
                assert all(s.sleeping[0] for s in sleepers), "some ranks never went to sleep"
                arrived_late.set()
            group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 5)
            assert (buf == size * (size + 1) / 2).all()
            return time.monotonic()

    returned = run_ranks(rank, range(size), size)
    assert arrived_late.is_set()
    # Woken by the poke, not by the 5 s deadline.
    assert max(returned) - min(returned) < 2.0


@needs_x86
def test_ranks_that_disagree_on_the_barrier_kind_get_a_rendezvous_error() -> None:
    namespace = uuid.uuid4().hex

    def rank(r: int) -> RendezvousError:
        with pytest.raises(RendezvousError) as raised:
            LocalGroup(namespace, r, 2, timeout=2, barriers=("memory", "sockets")[r]).close()
        return raised.value

    errors = run_ranks(rank, range(2), 2)
    assert "memory barriers" in str(errors[0])


def test_the_barrier_kind_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLSVC_SHM_BARRIERS", "sockets")
    assert shm_barriers() == "sockets"
    monkeypatch.setenv("COLLSVC_SHM_BARRIERS", "futex")
    with pytest.raises(ValueError, match="COLLSVC_SHM_BARRIERS"):
        shm_barriers()
    with pytest.raises(ValueError, match="auto, memory or sockets"):
        LocalGroup("unused", 0, 1, timeout=1, barriers="futex")


@needs_x86
def test_a_call_given_spin_zero_sleeps_at_once_and_the_budget_comes_back() -> None:
    """The hierarchical pipeline passes ``spin=0`` for a step it expects to wait long: the waiting rank
    must sleep at once although its group polls for 10 s, and the group's budget is 10 s again after."""

    def work(group: LocalGroup) -> float:
        buf = np.full(1000, float(group.rank))
        if group.rank == 0:
            peer = group._segments[1]
            deadline = time.monotonic() + 5
            while not peer.sleeping[0] and time.monotonic() < deadline:
                os.sched_yield()
            assert peer.sleeping[0], "the waiting rank polled instead of sleeping"
            group.broadcast(buf, 0, time.monotonic() + 5)
        else:
            group.broadcast(buf, 0, time.monotonic() + 5, spin=0.0)
        assert (buf == 0.0).all()
        return group.spin_seconds

    assert run_group(2, work, spin=10.0, barriers="memory") == [10.0, 10.0]
