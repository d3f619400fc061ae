"""A real coordinator on 127.0.0.1, port 0, and blocking clients for it."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from collsvc.errors import CollsvcError, error_from_rpc
from collsvc.options import CoordinatorOptions
from collsvc.proto.v1 import coordinator_pb2 as pb
from collsvc.proto.v1 import coordinator_pb2_grpc
from collsvc.server.app import CoordinatorThread

TOKEN = "integration-token"
CALL_TIMEOUT = 10.0


class Client:
    """Blocking stub calls with the token attached; errors come back as collsvc exceptions."""

    def __init__(self, address: str, token: str | None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.watches: list[Watch] = []
        self.secrets: dict[tuple[str, int], str] = {}  # (job id, rank) -> member secret, from joins

    def __call__(self, method: str, request: Any, timeout: float = CALL_TIMEOUT) -> Any:
        try:
            return getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, method) from exc

    def join(self, job_id: str, world_size: int, *, timeout_s: float = 5.0, **fields: Any) -> Any:
        fields.setdefault("host", "localhost")
        request = pb.JoinRequest(job_id=job_id, world_size=world_size, timeout_s=timeout_s, **fields)
        reply = self("Join", request, timeout=timeout_s + 5)
        self.secrets[(job_id, reply.rank)] = reply.member_secret
        return reply

    def barrier_request(
        self, job_id: str, rank: int, generation: int, timeout_s: float, group: str = "world"
    ) -> pb.BarrierRequest:
        """A BarrierRequest as member ``rank`` would send it, with the secret its join returned."""
        return pb.BarrierRequest(
            job_id=job_id,
            group=group,
            rank=rank,
            generation=generation,
            timeout_s=timeout_s,
            member_secret=self.secrets.get((job_id, rank), ""),
        )

    def join_all(
        self, job_id: str, world_size: int, fields: Callable[[int], dict[str, Any]] | None = None
    ) -> list[Any]:
        """``world_size`` concurrent joins (threads); replies in the order of the join calls."""
        with ThreadPoolExecutor(world_size) as pool:
            futures = [
                pool.submit(self.join, job_id, world_size, **(fields(i) if fields else {"pid": i}))
                for i in range(world_size)
            ]
            return [f.result() for f in futures]

    def watch(self, job_id: str, reply: Any, progress: list[Any] | None = None) -> Watch:
        """Opens a Watch stream for the member ``reply`` (a JoinResponse); closed with the client."""
        stream = Watch(self, job_id, reply, progress)
        self.watches.append(stream)
        return stream

    def close(self) -> None:
        for stream in self.watches:
            stream.cancel()
        self.channel.close()


class Watch:
    """One Watch stream: heartbeats go in through :meth:`send`, events come out of :meth:`next`."""

    def __init__(self, client: Client, job_id: str, reply: Any, progress: list[Any] | None = None) -> None:
        self._outbox: queue.Queue[Any] = queue.Queue()
        first = pb.WatchRequest(
            job_id=job_id, rank=reply.rank, member_secret=reply.member_secret, progress=progress or []
        )
        self._outbox.put(first)
        self.events: queue.Queue[Any] = queue.Queue()
        self.call = client.stub.Watch(iter(self._outbox.get, None), metadata=client.metadata, timeout=30)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for event in self.call:
                self.events.put(event)
        except grpc.RpcError as exc:
            self.events.put(exc)

    def send(self, progress: list[Any] | None = None) -> None:
        self._outbox.put(pb.WatchRequest(progress=progress or []))

    def next(self, timeout: float = 5.0) -> Any:
        """The next event (or the RpcError that ended the stream) within ``timeout`` seconds."""
        return self.events.get(timeout=timeout)

    def close(self) -> None:
        self._outbox.put(None)

    def cancel(self) -> None:
        self._outbox.put(None)
        self.call.cancel()


@pytest.fixture
def start_coordinator() -> Iterator[Callable[..., tuple[CoordinatorThread, Client]]]:
    started: list[tuple[CoordinatorThread, Client]] = []

    def start(**options: Any) -> tuple[CoordinatorThread, Client]:
        token = options.setdefault("token", TOKEN)
        options.setdefault("port", 0)  # a restarted coordinator passes the port of the one it replaces
        thread = CoordinatorThread(CoordinatorOptions(host="127.0.0.1", **options))
        port = thread.start()
        client = Client(f"127.0.0.1:{port}", token)
        started.append((thread, client))
        return thread, client

    yield start
    for thread, client in started:
        client.close()
        thread.stop()


@pytest.fixture
def client(start_coordinator: Callable[..., tuple[CoordinatorThread, Client]]) -> Client:
    return start_coordinator()[1]


def expect_error(fn: Callable[[], Any]) -> BaseException:
    """Runs ``fn`` and returns the collsvc/ValueError it raised."""
    with pytest.raises((CollsvcError, ValueError)) as info:
        fn()
    return info.value
