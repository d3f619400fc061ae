from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from collsvc.options import Limits
from collsvc.proto.v1 import coordinator_pb2
from collsvc.server.services.hub import Stream
from collsvc.server.state.common import Device
from collsvc.server.state.credentials import MemberSecrets
from collsvc.server.state.jobs import Job
from collsvc.server.state.roster import JoinRequest


class FakeClock:
    """Monotonic seconds that only move when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_job(clock: FakeClock) -> Callable[..., Job]:
    def make(job_id: str = "job", limits: Limits | None = None) -> Job:
        return Job(job_id, clock=clock, limits=limits or Limits(), incarnation=42, secrets=MemberSecrets(b"key"))

    return make


def join(job: Job, world_size: int, host: str = "h", **kw: object) -> object:
    args: dict[str, object] = dict(
        world_size=world_size,
        requested_rank=None,
        host=host,
        peer_address=f"{host}:1",
        device=Device(),
        pid=0,
        local_rank_hint=None,
    )
    args.update(kw)
    return job.join(JoinRequest(**args))  # type: ignore[arg-type]


def drain(stream: Stream) -> list[Any]:
    """The events queued on ``stream`` so far (job events are queued serialized, once for every stream)."""
    out = []
    while not stream.queue.empty():
        event = stream.queue.get_nowait()
        out.append(coordinator_pb2.WatchEvent.FromString(event) if isinstance(event, bytes) else event)
    return out
