"""Every shared-memory test runs with both kinds of barrier: words in the segments and datagrams."""

from __future__ import annotations

import pytest

from collsvc.client.backends.shm.board import memory_barriers_supported


@pytest.fixture(autouse=True, params=["memory", "sockets"])
def barrier_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The ``COLLSVC_SHM_BARRIERS`` every group of the test is built with."""
    kind: str = request.param
    if kind == "memory" and not memory_barriers_supported():
        pytest.skip("barriers through memory words need an x86-64 CPU")
    monkeypatch.setenv("COLLSVC_SHM_BARRIERS", kind)
    return kind
