"""The embedded coordinator of ``collsvc run``: a reserved port, ranks that dial before it listens, and
a coordinator that cannot start. Real sockets and a real coordinator."""

from __future__ import annotations

import os
import select
import socket
import threading
from pathlib import Path

import grpc
import pytest

from collsvc.client.rendezvous import CoordinatorClient
from collsvc.config import thread_defaults
from collsvc.launch.embedded_coordinator import EmbeddedCoordinator
from collsvc.proto.v1 import common_pb2
from tests.cli._util import NOWHERE, run_cli, script

TOKEN = "embedded-test-token"
WAIT = 30.0  # seconds; every wait below ends much sooner unless something is broken


def _join_alone(client: CoordinatorClient, outcome: dict[str, object]) -> None:
    try:
        reply = client.join(
            world_size=1,
            rank=0,
            host="testhost",
            peer_address="127.0.0.1:1",
            device=common_pb2.DeviceIdentity(kind="cpu"),
            pid=os.getpid(),
            local_rank_hint=0,
        )
        outcome["rank"] = reply.rank
    except Exception as exc:  # noqa: BLE001 - handed to the test thread
        outcome["error"] = exc


def test_a_rank_that_dials_before_the_coordinator_listens_joins_once_it_does() -> None:
    stopped = threading.Event()
    coordinator = EmbeddedCoordinator(TOKEN, on_failure=stopped.set)
    address = coordinator.reserve()
    assert address is not None
    client = CoordinatorClient(address, "embedded", token=TOKEN, tls=None, timeout=WAIT)
    refused = threading.Event()

    def on_state(state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            refused.set()

    client.channel.subscribe(on_state)
    outcome: dict[str, object] = {}
    joiner = threading.Thread(target=_join_alone, args=(client, outcome))
    try:
        with pytest.raises(ConnectionRefusedError):  # reserved, and nothing listens there yet
            socket.create_connection(("127.0.0.1", coordinator.port), timeout=WAIT).close()
        joiner.start()
        assert refused.wait(WAIT)  # the rank dialed and was refused
        coordinator.start()
        assert coordinator.wait_settled(WAIT)
        joiner.join(WAIT)
        assert not joiner.is_alive()
        assert outcome == {"rank": 0}
        assert coordinator.error is None and not stopped.is_set()
    finally:
        client.channel.unsubscribe(on_state)
        client.close()
        coordinator.stop()
        if joiner.ident is not None:
            joiner.join(WAIT)


def _reaches_its_end(fd: int) -> bool:
    ready, _, _ = select.select([fd], [], [], WAIT)
    return bool(ready) and os.read(fd, 1) == b""


def test_the_ready_signal_ends_once_the_coordinator_listens() -> None:
    coordinator = EmbeddedCoordinator(TOKEN, on_failure=lambda: None)
    assert coordinator.ready_signal is None
    assert coordinator.reserve() is not None
    signal = coordinator.ready_signal
    assert signal is not None
    fd, name = signal
    assert name == f"{fd}:{os.fstat(fd).st_ino}"
    try:
        assert not select.select([fd], [], [], 0)[0]  # nothing listens yet: the pipe stays open
        coordinator.start()
        assert _reaches_its_end(fd)
        assert coordinator.wait_settled(WAIT)
        socket.create_connection(("127.0.0.1", coordinator.port), timeout=WAIT).close()
    finally:
        coordinator.stop()
    assert coordinator.ready_signal is None


def test_a_coordinator_that_cannot_bind_its_port_says_why_and_stops_the_ranks() -> None:
    stopped = threading.Event()
    coordinator = EmbeddedCoordinator(TOKEN, on_failure=stopped.set)
    assert coordinator.reserve() is not None
    # Another program listens on the reserved port first (a reservation keeps out only those that
    # do not ask for SO_REUSEADDR).
    intruder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    intruder.bind(("127.0.0.1", coordinator.port))
    intruder.listen()
    try:
        signal = coordinator.ready_signal
        assert signal is not None
        coordinator.start()
        assert not coordinator.wait_settled(WAIT)
        assert stopped.is_set()
        # The ranks keep waiting (to be stopped) rather than dial whatever listens on the port.
        assert not select.select([signal[0]], [], [], 0)[0]
        assert isinstance(coordinator.error, OSError)
        assert "address already in use" in str(coordinator.error)
        assert coordinator.failure().startswith("cannot start the embedded coordinator: OSError: ")
    finally:
        coordinator.stop()
        intruder.close()


def test_a_reserved_port_is_released_when_the_coordinator_never_starts() -> None:
    coordinator = EmbeddedCoordinator(TOKEN, on_failure=lambda: None)
    assert coordinator.reserve() is not None
    port = coordinator.port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))  # held while reserved
    coordinator.stop()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        other.bind(("127.0.0.1", port))


def test_start_without_a_reserved_port_is_refused() -> None:
    with pytest.raises(RuntimeError, match="reserve"):
        EmbeddedCoordinator(TOKEN, on_failure=lambda: None).start()


def test_ranks_get_a_share_of_the_cores_for_their_thread_pools(tmp_path: Path) -> None:
    path = script(tmp_path, "threads.py", "import os; print(os.environ.get('OMP_NUM_THREADS'))")
    res = run_cli("run", "-n", "2", "--coordinator", NOWHERE, path, OMP_NUM_THREADS="")  # "": not set
    assert res.returncode == 0, res.stderr
    share = thread_defaults({}, 2)["OMP_NUM_THREADS"]
    assert sorted(res.lines("stdout")) == [f"[rank 0] {share}", f"[rank 1] {share}"]
    # The user's own setting wins.
    res = run_cli("run", "-n", "2", "--coordinator", NOWHERE, path, OMP_NUM_THREADS="3")
    assert sorted(res.lines("stdout")) == ["[rank 0] 3", "[rank 1] 3"]


def test_ranks_inherit_the_ready_signal_only_from_an_embedded_coordinator(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "ready_signal.py",
        """
        import os, stat, collsvc
        from collsvc.config import coordinator_ready_fd
        fd = coordinator_ready_fd()
        print("PIPE", fd is not None and stat.S_ISFIFO(os.fstat(fd).st_mode))
        if os.environ["COLLSVC_COORDINATOR"] != "127.0.0.1:1":
            collsvc.init().barrier()
            print("AFTER", coordinator_ready_fd())  # used and closed by init
            collsvc.destroy()
        """,
    )
    embedded = run_cli("run", "-n", "2", path, timeout=90)
    assert embedded.returncode == 0, embedded.stderr
    assert sorted(embedded.lines("stdout")) == [
        "[rank 0] AFTER None",
        "[rank 0] PIPE True",
        "[rank 1] AFTER None",
        "[rank 1] PIPE True",
    ]
    external = run_cli("run", "-n", "1", "--coordinator", NOWHERE, path)
    assert external.returncode == 0, external.stderr
    assert external.lines("stdout") == ["[rank 0] PIPE False"]
