"""The polling budget of shared-memory waits: long while every local rank has a core, brief otherwise."""

from __future__ import annotations

import pytest

from collsvc.client.backends.shm import spin


def test_polls_briefly_when_ranks_share_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLLSVC_SHM_SPIN_US", raising=False)
    assert spin.spin_seconds(2, cores=2) == spin.SPIN_SECONDS > 0
    assert spin.spin_seconds(4, cores=4) == spin.SPIN_SECONDS
    # More ranks than cores: a few hand-overs of the core, then sleep.
    assert 0 < spin.spin_seconds(4, cores=2) == spin.SHARED_CORE_SPIN_SECONDS < spin.SPIN_SECONDS
    assert spin.spin_seconds(3, cores=2) == spin.SHARED_CORE_SPIN_SECONDS


def test_memory_barriers_poll_longer_on_shared_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLLSVC_SHM_SPIN_US", raising=False)
    assert spin.spin_seconds(2, cores=2, memory_barriers=True) == spin.SPIN_SECONDS
    shared = spin.spin_seconds(4, cores=2, memory_barriers=True)
    assert shared == spin.SHARED_CORE_MEMORY_SPIN_SECONDS > spin.SHARED_CORE_SPIN_SECONDS


def test_the_environment_overrides_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLSVC_SHM_SPIN_US", "250")
    assert spin.spin_seconds(8, cores=2) == pytest.approx(250e-6)
    monkeypatch.setenv("COLLSVC_SHM_SPIN_US", "0")
    assert spin.spin_seconds(2, cores=2) == 0.0


def test_usable_cores_is_at_least_one() -> None:
    assert spin.usable_cores() >= 1


def test_a_bad_override_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLLSVC_SHM_SPIN_US", "-5")
    with pytest.raises(ValueError, match="COLLSVC_SHM_SPIN_US"):
        spin.spin_seconds(2, cores=2)
