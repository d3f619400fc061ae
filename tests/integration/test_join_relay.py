"""The launcher's join relay with a real coordinator and the ranks' own join code: one JoinBatch for the
ranks of a host, their errors as their own, and every way it can fail ending in a rank joining by itself."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from collsvc.client.relay_wire import RELAY_ENV
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.errors import RendezvousError
from collsvc.launch.join_relay import MAX_BATCH, JoinRelay
from collsvc.options import Limits
from collsvc.proto.v1 import common_pb2

from .conftest import TOKEN, Client


@pytest.fixture
def coordinator(start_coordinator: Callable[..., tuple[Any, Client]]) -> tuple[str, Client]:
    thread, client = start_coordinator(heartbeat_timeout=600.0)  # nobody heartbeats here
    return str(thread.address), client


@pytest.fixture
def address(coordinator: tuple[str, Client]) -> str:
    return coordinator[0]


@pytest.fixture
def relays() -> Iterator[list[JoinRelay]]:
    opened: list[JoinRelay] = []
    yield opened
    for relay in opened:
        relay.close()


def open_relay(relays: list[JoinRelay], address: str, ranks: int) -> JoinRelay:
    relay = JoinRelay(address, TOKEN, None, ranks)
    relays.append(relay)
    return relay


def rank_joins(
    address: str, job_id: str, world_size: int, local: int, *, join_timeout: float = 20.0
) -> tuple[Any, list[Any]]:
    """One rank's join as ``collsvc.init`` does it (through the relay when the environment names one),
    then the member table; returns both."""
    client = CoordinatorClient(address, job_id, token=TOKEN, tls=None, timeout=10.0, join_timeout=join_timeout)
    try:
        reply = client.join(
            world_size=world_size,
            rank=None,
            host="relay-host",
            peer_address=f"127.0.0.1:{40000 + local}",
            device=common_pb2.DeviceIdentity(),
            pid=1000 + local,
            local_rank_hint=local,
        )
        return reply, client.members()
    finally:
        client.close()


def joins(address: str, job_id: str, world_size: int, ranks: int, **kw: Any) -> list[Any]:
    with ThreadPoolExecutor(ranks) as pool:
        futures = [pool.submit(rank_joins, address, job_id, world_size, i, **kw) for i in range(ranks)]
        return [f.result() for f in futures]


def test_the_ranks_of_a_launcher_join_in_one_batch(
    address: str, relays: list[JoinRelay], monkeypatch: pytest.MonkeyPatch
) -> None:
    relay = open_relay(relays, address, 3)
    monkeypatch.setenv(RELAY_ENV, relay.environment()[RELAY_ENV])
    results = joins(address, "batched", 3, 3)
    assert sorted(reply.rank for reply, _ in results) == [0, 1, 2]
    for reply, members in results:
        assert [m.rank for m in members] == [0, 1, 2]
        assert members[reply.rank].peer_address == f"127.0.0.1:{40000 + reply.local_rank}"
    assert relay.batches == [3]


def test_a_failed_batch_fails_every_rank_with_the_coordinators_error(
    address: str, relays: list[JoinRelay], monkeypatch: pytest.MonkeyPatch
) -> None:
    relay = open_relay(relays, address, 2)
    monkeypatch.setenv(RELAY_ENV, relay.environment()[RELAY_ENV])
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(rank_joins, address, "short", 3, i, join_timeout=0.5) for i in range(2)]
        errors = [f.exception(timeout=30) for f in futures]
    assert all(isinstance(e, RendezvousError) for e in errors), errors
    assert all("only 2 of 3 members joined" in str(e) for e in errors), errors
    assert relay.batches == [2]


def test_a_rank_that_never_reaches_the_relay_holds_the_others_back_at_most_the_gather_window(
    coordinator: tuple[str, Client], relays: list[JoinRelay], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, direct = coordinator
    relay = open_relay(relays, address, 3)  # expects 3 ranks; the third joins by itself
    monkeypatch.setenv(RELAY_ENV, relay.environment()[RELAY_ENV])
    with ThreadPoolExecutor(2) as pool:
        relayed = [pool.submit(rank_joins, address, "window", 3, i) for i in range(2)]
        alone = direct.join("window", 3, host="elsewhere", timeout_s=20.0)
        results = [f.result(timeout=30) for f in relayed]
    assert sorted([reply.rank for reply, _ in results] + [alone.rank]) == [0, 1, 2]
    assert relay.batches == [2]  # sent once the window passed, not when a third request came


@pytest.mark.parametrize("how", ["wrong secret", "no relay", "relay closed"])
def test_a_rank_joins_by_itself_when_the_relay_does_not_answer(
    address: str, relays: list[JoinRelay], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    relay = open_relay(relays, address, 2)
    name, _, secret = relay.environment()[RELAY_ENV].partition(":")
    if how == "wrong secret":
        monkeypatch.setenv(RELAY_ENV, f"{name}:{'0' * len(secret)}")
    elif how == "no relay":
        monkeypatch.setenv(RELAY_ENV, f"collsvc-no-such-relay:{secret}")
    else:
        monkeypatch.setenv(RELAY_ENV, relay.environment()[RELAY_ENV])
        relay.close()
    results = joins(address, f"alone-{how.replace(' ', '-')}", 2, 2)
    assert sorted(reply.rank for reply, _ in results) == [0, 1]
    assert relay.batches == []


def test_more_ranks_than_one_batch_may_carry_go_in_several(
    address: str, relays: list[JoinRelay], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Limits().max_ranks_per_host == MAX_BATCH  # the relay's default is the coordinator's limit
    relay = JoinRelay(address, TOKEN, None, 5, max_batch=2)
    relays.append(relay)
    monkeypatch.setenv(RELAY_ENV, relay.environment()[RELAY_ENV])
    results = joins(address, "split", 5, 5)
    assert sorted(reply.rank for reply, _ in results) == [0, 1, 2, 3, 4]
    assert sum(relay.batches) == 5 and max(relay.batches) == 2, relay.batches  # [2, 2, 1] unless one was late
