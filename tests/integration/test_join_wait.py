"""A member waiting for peers that never come says which ranks have not joined: in its log while it
waits, in its error when the join times out, and in ``collsvc status``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from collsvc.cli import remote
from collsvc.client import rendezvous
from collsvc.client.join_report import describe_not_joined, not_joined
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.errors import RendezvousError
from collsvc.proto.v1 import common_pb2
from collsvc.proto.v1 import coordinator_pb2 as pb
from tests.integration.conftest import TOKEN, Client


def test_not_joined_is_known_only_when_every_member_asked_for_a_rank() -> None:
    assert not_joined(4, [0, 2]) == [1, 3]
    assert not_joined(4, [0, -1]) is None
    assert describe_not_joined(2, [0]) == "not joined: rank 1 (1 of 2 joined)"
    assert describe_not_joined(8, [0, 7]) == "not joined: ranks 1-6 (2 of 8 joined)"
    assert describe_not_joined(5, [1, 3]) == "not joined: ranks 0, 2, 4 (2 of 5 joined)"
    assert describe_not_joined(3, [-1]) == "not joined: 2 of 3 members (ranks are assigned once all joined)"


def _join_rank_0(address: str, timeout: float) -> None:
    client = CoordinatorClient(address, "k8s-job", token=TOKEN, tls=None, timeout=timeout)
    try:
        client.join(
            world_size=2, rank=0, host="collsvc-train-0", peer_address="10.0.0.20:29500",
            device=common_pb2.DeviceIdentity(kind="cpu"), pid=1, local_rank_hint=None,
        )  # fmt: skip
    finally:
        client.close()


def test_waiting_rank_logs_and_error_name_the_missing_ranks(
    start_coordinator: Callable[..., tuple[Any, Client]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    thread, _ = start_coordinator()
    monkeypatch.setattr(rendezvous, "JOIN_REPORT_INTERVAL", 0.3)
    caplog.set_level(logging.WARNING, logger=rendezvous.__name__)
    with pytest.raises(RendezvousError) as info:
        _join_rank_0(f"127.0.0.1:{thread.port}", timeout=2.0)
    assert "only 1 of 2 members joined" in str(info.value)
    assert "ranks that never joined: [1]" in str(info.value)
    waiting = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert waiting, "the waiting rank logged nothing while it waited"
    assert all("not joined: rank 1 (1 of 2 joined)" in line for line in waiting), waiting


def test_status_names_the_ranks_that_have_not_joined(start_coordinator: Callable[..., tuple[Any, Client]]) -> None:
    thread, client = start_coordinator()
    joiner = threading.Thread(
        target=lambda: pytest.raises(RendezvousError, _join_rank_0, f"127.0.0.1:{thread.port}", 3.0)
    )
    joiner.start()
    try:
        text = ""
        for _ in range(100):  # bounded: until the join is registered
            text = remote.format_status(remote.status_to_dict(client("GetStatus", pb.GetStatusRequest())))
            if "k8s-job" in text:
                break
            threading.Event().wait(0.05)
        assert "job k8s-job: joining, world size 2, 1 joined" in text
        assert "  not joined: rank 1 (1 of 2 joined)" in text
    finally:
        joiner.join()
