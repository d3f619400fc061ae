"""Living through a coordinator restart, on the member's side.

:class:`CoordinatorLink` tells coordinator calls whether to wait for the coordinator to come back;
:class:`MemberJournal` keeps what this member must tell a coordinator that restarted (who it is, the
barriers it saw complete, the groups it registered, the keys it wrote), so that the job is rebuilt
from its members.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

from collsvc.client.coordinator_channel import answered_by_a_stranger
from collsvc.errors import REASON_METADATA_KEY, RendezvousError
from collsvc.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)
# A barrier generation's series (see collsvc.server.state.barriers): user barriers count from 1, named
# internal barriers use high generations of their own series.
BARRIER_SERIES_SHIFT = 20


def unreachable(exc: grpc.RpcError) -> bool:
    """Whether a failed call means the coordinator could not be reached (or went away mid-call), as
    opposed to an answer: the coordinator's own errors carry a reason, even those sent as UNAVAILABLE
    (a failed rank), and a refused TLS handshake names itself."""
    if answered_by_a_stranger(exc):
        return True  # not routed to the coordinator (yet, or for the moment): the call renews its connection
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailing: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    if any(item[0] == REASON_METADATA_KEY for item in trailing or ()):
        return False
    return "handshake" not in ((exc.details() if hasattr(exc, "details") else "") or "").lower()


class CoordinatorLink:
    """Whether the coordinator is reachable, as the heartbeat watcher sees it.

    While the coordinator is lost (its stream broke), coordinator calls wait instead of failing: the
    watcher reconnects, re-registers this member with a coordinator that may have restarted, and
    then says the link is back; or it gives up after the grace period, and every waiting call
    raises its error.
    """

    # The longest single wait for a call's own channel to connect before the link is looked at again
    # (a connection attempt does not notice that the watcher gave up).
    CONNECT_CHECK_S = 1.0

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._up = True
        self._error: BaseException | None = None
        self.watched = False  # a watcher runs: only then does a lost link come back by itself

    def call(self, send: Callable[[float], Any], deadline: float, what: str, connected: Callable[[float], bool]) -> Any:
        """Runs ``send(seconds left)`` (one gRPC call); while the coordinator is lost (and a watcher may
        bring it back) waits for it and sends again, all before ``deadline``.

        After a call failed as unreachable it is sent again once the link is up and the call's own
        channel connected (``connected(seconds)`` waits up to that long and says whether it did): the
        heartbeat stream's channel often reconnects before the call's.

        Every request sent this way is idempotent (barriers are generation-counted, keys and groups
        are set, not appended), apart from AddKey, whose retry can count twice when the reply, not
        the request, was lost.

        Raises:
            grpc.RpcError: the call failed otherwise, or the coordinator did not come back in time.
            RendezvousError: the link stayed down until ``deadline``.
            CollsvcError: the watcher gave up on the coordinator.
        """
        if not self.wait_up(deadline):
            raise RendezvousError(f"{what}: the coordinator did not come back in time (restarting?)")
        while True:
            try:
                return send(max(deadline - time.monotonic(), 0.01))
            except grpc.RpcError as exc:
                if not (unreachable(exc) and self.watched):
                    raise
                log.info("%s: coordinator unreachable; waiting for it to come back", what)
                while True:
                    if not self.wait_up(deadline):
                        raise
                    remaining = deadline - time.monotonic()
                    if connected(min(remaining, self.CONNECT_CHECK_S)):
                        break
                    if remaining <= 0:
                        raise

    @property
    def up(self) -> bool:
        """Whether the coordinator is reachable as far as the watcher knows (not lost, not given up on)."""
        return self._up and self._error is None

    def lost(self) -> None:
        """The watcher's stream broke: calls wait from now on."""
        with self._changed:
            self._up = False

    def restored(self) -> None:
        """The watcher re-registered and watches again: waiting calls go on."""
        with self._changed:
            self._up = True
            self._changed.notify_all()

    def give_up(self, error: BaseException) -> None:
        """The coordinator is gone for good: every waiting and later call raises ``error``."""
        with self._changed:
            self._error = error
            self._changed.notify_all()

    def wait_up(self, deadline: float) -> bool:
        """Waits until the link is up; returns False when ``deadline`` passed first.

        Raises:
            CollsvcError: the watcher gave up on the coordinator.
        """
        with self._changed:
            while True:
                if self._error is not None:
                    raise self._error
                if self._up:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)


class MemberJournal:
    """What this member knows of its job that a restarted coordinator lost (thread-safe).

    Keys are journalled with the last value this member wrote or got from an add; a key that another
    member deleted since is restored all the same (deletes are rare and only made by the writer).

    Args:
        job_id: the job's name.
    """

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.joined: coordinator_pb2.JoinResponse | None = None
        self.own_record: common_pb2.Member | None = None  # this member in the job's member table
        self._lock = threading.Lock()
        self._written: dict[str, bytes] = {}
        self._groups: dict[str, list[int]] = {}
        self._barriers_done: dict[tuple[str, int], int] = {}  # (group, series) -> highest generation

    def wrote(self, key: str, value: bytes) -> None:
        with self._lock:
            self._written[key] = value

    def registered_group(self, name: str, ranks: Sequence[int]) -> None:
        with self._lock:
            self._groups[name] = list(ranks)

    def barrier_done(self, group: str, generation: int) -> None:
        key = (group, generation >> BARRIER_SERIES_SHIFT)
        with self._lock:
            self._barriers_done[key] = max(self._barriers_done.get(key, 0), generation)

    def reregister_request(
        self, member_secret: str, left_ranks: Iterable[int], last_event_seq: int
    ) -> coordinator_pb2.ReregisterRequest:
        """What this member tells a coordinator that may have restarted (see the Reregister RPC).

        Raises:
            RendezvousError: this member never completed its join.
        """
        joined, record = self.joined, self.own_record
        if joined is None or record is None:
            raise RendezvousError(f"job '{self.job_id}': cannot re-register a member that never joined")
        with self._lock:
            barriers = [
                coordinator_pb2.BarrierMark(group=group, generation=generation)
                for (group, _), generation in self._barriers_done.items()
            ]
        return coordinator_pb2.ReregisterRequest(
            job_id=self.job_id,
            rank=joined.rank,
            member_secret=member_secret,
            job_incarnation=joined.job_incarnation,
            world_size=joined.world_size,
            num_nodes=joined.num_nodes,
            member=record,
            barriers=barriers,
            left_ranks=sorted(left_ranks),
            last_event_seq=last_event_seq,
        )

    def reregister(
        self,
        stub: coordinator_pb2_grpc.CoordinatorStub,
        member_secret: str,
        *,
        left_ranks: Iterable[int],
        last_event_seq: int,
        timeout: float,
        metadata: Any,
    ) -> bool:
        """Re-registers with a coordinator that may have restarted, then restores this member's groups
        and keys; returns whether the job still waits for other members.

        Raises:
            grpc.RpcError: the coordinator refused (UNAUTHENTICATED: it cannot verify this member's
                secret) or went away again.
            RendezvousError: this member never completed its join.
        """
        request = self.reregister_request(member_secret, left_ranks, last_event_seq)
        reply = stub.Reregister(request, timeout=timeout, metadata=metadata)
        for method, restore in self.restore_requests():
            getattr(stub, method)(restore, timeout=timeout, metadata=metadata)
        return bool(reply.recovering)

    def restore_requests(self) -> list[tuple[str, Any]]:
        """``(method, request)`` for the groups this member registered and the keys it wrote, to restore
        on a coordinator that restarted (what is there already is kept)."""
        with self._lock:
            groups = list(self._groups.items())
            written = list(self._written.items())
        job = self.job_id
        requests: list[tuple[str, Any]] = [
            ("NewGroup", coordinator_pb2.NewGroupRequest(job_id=job, name=n, ranks=r, restore=True)) for n, r in groups
        ]
        requests += [
            ("SetKey", coordinator_pb2.SetKeyRequest(job_id=job, key=k, value=v, restore=True)) for k, v in written
        ]
        return requests
