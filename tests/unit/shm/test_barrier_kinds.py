"""Which barrier a host's ranks meet in (``COLLSVC_SHM_BARRIERS``): memory words where the CPU keeps
stores in order, sockets otherwise, and a clear refusal of what cannot run."""

from __future__ import annotations

import pytest

from collsvc.client.backends.shm import steps
from collsvc.errors import BackendUnavailableError


@pytest.mark.parametrize("supported", [True, False])
def test_each_kind_picks_its_barrier_or_says_why_not(monkeypatch: pytest.MonkeyPatch, supported: bool) -> None:
    monkeypatch.setattr(steps, "memory_barriers_supported", lambda: supported)
    assert steps._memory_barriers("sockets") is False
    assert steps._memory_barriers("auto") is supported
    if supported:
        assert steps._memory_barriers("memory") is True
    else:
        with pytest.raises(BackendUnavailableError, match="x86-64"):
            steps._memory_barriers("memory")
    with pytest.raises(ValueError, match="auto, memory or sockets"):
        steps._memory_barriers("words")
