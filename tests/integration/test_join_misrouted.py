"""A rank that starts before its cluster routes the coordinator's address: on Kubernetes a Service IP
that kube-proxy has not programmed yet leaves the node by its default route, where a gateway or proxy
may answer HTTP/2 with a bare HTTP status (``Received http2 header with status: 404``), and the
Service's name may not resolve yet. Join waits through both, on new connections, and the heartbeat
stream then runs on a connection that reaches the coordinator."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from collsvc.client.coordinator_channel import HEALTH_CHECK
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.options import CoordinatorOptions
from collsvc.proto.v1 import common_pb2
from collsvc.server.app import CoordinatorThread
from tests.harness import TOKEN as RANKS_TOKEN
from tests.harness import run_ranks
from tests.integration.conftest import TOKEN

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, SETTINGS, PING = 1, 4, 6
STATUS_404 = b"\x8d"  # HPACK: static table entry 13, ":status: 404"


class Http404Server:
    """An HTTP/2 server that answers every request with status 404 and nothing else (what a proxy on the
    default route answered for an unrouted Service IP). Closing its listener leaves the connections it
    accepted answering."""

    def __init__(self, port: int = 0) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port = self.listener.getsockname()[1]
        self.answered = threading.Event()
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # the listener closed
            self.connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
        return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload

    def _serve(self, conn: socket.socket) -> None:
        reader = conn.makefile("rb")
        try:
            if reader.read(len(PREFACE)) != PREFACE:
                return
            conn.sendall(self._frame(SETTINGS, 0, 0))
            while header := reader.read(9):
                length = int.from_bytes(header[:3], "big")
                kind, flags, stream = header[3], header[4], int.from_bytes(header[5:], "big") & 0x7FFFFFFF
                payload = reader.read(length)
                if kind == SETTINGS and not flags & 0x1:
                    conn.sendall(self._frame(SETTINGS, 0x1, 0))
                elif kind == PING and not flags & 0x1:
                    conn.sendall(self._frame(PING, 0x1, 0, payload))
                elif kind == HEADERS:
                    conn.sendall(self._frame(HEADERS, 0x5, stream, STATUS_404))  # END_STREAM | END_HEADERS
                    self.answered.set()
        except OSError:
            pass

    def stop_listening(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accepting thread: close() alone would not
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()

    def close(self) -> None:
        self.stop_listening()
        for conn in self.connections:
            conn.close()


@pytest.fixture
def stranger() -> Iterator[Http404Server]:
    server = Http404Server()
    try:
        yield server
    finally:
        server.close()


def _join(client: CoordinatorClient) -> object:
    return client.join(
        world_size=1, rank=0, host="collsvc-train-0", peer_address="10.0.0.20:29500",
        device=common_pb2.DeviceIdentity(kind="cpu"), pid=1, local_rank_hint=None,
    )  # fmt: skip


def _lookup(client: CoordinatorClient) -> object:
    # What ``python -m collsvc.elastic.rejoin`` asks first: whether the elastic job already started.
    return client.lookup("run", 20.0) is None


@pytest.mark.parametrize("call", [_join, _lookup], ids=["join", "rejoin-lookup"])
def test_a_stranger_at_the_coordinators_address_is_waited_through(
    stranger: Http404Server, call: Callable[[CoordinatorClient], object]
) -> None:
    address = f"127.0.0.1:{stranger.port}"
    client = CoordinatorClient(address, "misrouted", token=TOKEN, tls=None, timeout=10.0, join_timeout=20.0)
    client.connect_ahead(1.0)  # as collsvc.init does: both connections open at once
    outcomes: list[object] = []

    def ask() -> None:
        try:
            outcomes.append(call(client))
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcomes.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    coordinator: CoordinatorThread | None = None
    try:
        assert stranger.answered.wait(10), "the rank never asked the address"
        # Now the address routes to the coordinator; connections made before still reach the stranger.
        stranger.stop_listening()
        coordinator = CoordinatorThread(CoordinatorOptions(host="127.0.0.1", port=stranger.port, token=TOKEN))
        coordinator.start()
        asker.join(30)
        assert not asker.is_alive()
        (outcome,) = outcomes
        assert not isinstance(outcome, BaseException), repr(outcome)
        # The heartbeat stream's channel reaches the coordinator too: a call that fails fast succeeds.
        check = client.heartbeat_channel(1.0).unary_unary(HEALTH_CHECK)
        assert check(b"", timeout=5) is not None
    finally:
        client.close()
        asker.join(30)
        if coordinator is not None:
            coordinator.stop()


def _train_until(comm: Any, started: str, stop: str) -> int:
    """Barriers and all_reduces until rank 0 sees the file ``stop`` (it tells the others in the same
    all_reduce, so every rank stops after the same step); rank 0 creates ``started`` first."""
    import numpy as np

    steps = 0
    while True:
        comm.barrier()
        stopping = 1.0 if comm.rank == 0 and os.path.exists(stop) else 0.0
        total = comm.all_reduce(np.array([1.0, 1.0, 1.0, stopping]))
        assert float(total[0]) == comm.size
        steps += 1
        if steps == 3 and comm.rank == 0:
            Path(started).touch()
        if total[3] > 0:
            return steps


def test_a_stranger_while_the_coordinator_restarts_is_waited_through(tmp_path: Path) -> None:
    """The coordinator goes away mid-training and, before it serves again on its address, a stranger
    answers there (on Kubernetes: the Service between the old coordinator pod and the new one): the
    members' heartbeat streams and calls take new connections until the coordinator is back."""
    started, stop = tmp_path / "started", tmp_path / "stop"
    first = CoordinatorThread(CoordinatorOptions(host="127.0.0.1", port=0, token=RANKS_TOKEN))
    port = first.start()
    outcome: list[object] = []

    def job() -> None:
        try:
            outcome.append(run_ranks(_train_until, 2, address=f"127.0.0.1:{port}", args=(str(started), str(stop)),
                                     timeout=90.0))  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    runner = threading.Thread(target=job)
    runner.start()
    stranger: Http404Server | None = None
    second: CoordinatorThread | None = None
    try:
        deadline = time.monotonic() + 60
        while not started.exists():  # the ranks' own signal that they train
            assert runner.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.05)
        first.stop()
        stranger = Http404Server(port)
        assert stranger.answered.wait(20), "no member asked the address while the coordinator was away"
        stranger.stop_listening()  # connections made meanwhile still reach it
        second = CoordinatorThread(CoordinatorOptions(host="127.0.0.1", port=port, token=RANKS_TOKEN))
        second.start()
        stop.touch()
        runner.join(60)
        assert not runner.is_alive()
        (result,) = outcome
        assert not isinstance(result, BaseException), result
        assert all(isinstance(v, int) and v >= 3 for v in result.values), result  # type: ignore[attr-defined]
    finally:
        stop.touch()
        runner.join(60)
        if stranger is not None:
            stranger.close()
        if second is not None:
            second.stop()
