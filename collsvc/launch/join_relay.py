"""The launcher's side of joining a host's ranks in one call (the rank's side: ``collsvc.client.join_relay``).

``collsvc run`` starts a :class:`JoinRelay` before its ranks and names it in their environment. Each
rank's JoinRequest waits here until every rank of this launcher that has not joined yet sent one (or
:data:`GATHER_WINDOW` passed since the first of them: a rank that is slow to reach ``init`` or never
does must not hold the others back), then all of them go to the coordinator in one JoinBatch. The
coordinator admits each member as its own Join would, so a rank whose relay fails joins by itself
with the same request (same idempotency key) and finds the same place. The member table is fetched
once for the batch and handed to each rank with its answer.

Only ranks that present the relay's secret (from the environment the launcher gave them) are served:
the relay speaks to the coordinator with the job's token, which a rank of this launcher has anyway.

The launcher starts the relay before its ranks, and ranks start faster while it has not loaded gRPC
or protobuf yet: this module loads neither; the first request parsed and the first batch sent
(``collsvc.launch.join_batch``) do.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from collsvc.client.relay_wire import RELAY_ENV, RelayClosed, receive_frame, send_frames
from collsvc.config import tls_from_env

if TYPE_CHECKING:
    from collsvc.launch.join_batch import BatchSender
    from collsvc.options import TlsFiles
    from collsvc.proto.v1.coordinator_pb2 import JoinRequest

log = logging.getLogger(__name__)

# Longest a rank's request waits here for the launcher's other ranks before its batch goes anyway.
GATHER_WINDOW = 1.0
# Members one JoinBatch carries at most: the coordinator's default Limits.max_ranks_per_host (not
# imported from collsvc.types, which loads numpy; a test pins the two equal).
MAX_BATCH = 256
# How long a connecting rank may take to send its secret and request.
_READ_TIMEOUT = 5.0


@dataclass
class _Pending:
    """Requests of one job gathered for the next batch, with the connections to answer on."""

    requests: list[JoinRequest] = field(default_factory=list)
    connections: list[socket.socket] = field(default_factory=list)
    first_at: float = 0.0


class JoinRelay:
    """Gathers the JoinRequests of one launcher's ranks and joins them in JoinBatch calls.

    Args:
        coordinator: ``host:port`` of the coordinator the ranks join.
        token: the job token (sent as the ranks send it), or None.
        tls: client TLS files (as the ranks use them), or None.
        ranks: how many ranks this launcher starts (a batch goes once all that have not joined sent theirs).
        clock: ``time.monotonic`` or a stand-in.
        max_batch: members per JoinBatch at most (more ranks go in several batches).

    Raises:
        OSError: the relay's socket could not be opened.
    """

    def __init__(
        self,
        coordinator: str,
        token: str | None,
        tls: TlsFiles | None,
        ranks: int,
        clock: Callable[[], float] = time.monotonic,
        max_batch: int = MAX_BATCH,
    ) -> None:
        self._name = f"collsvc-join-relay-{secrets.token_hex(8)}"
        self._secret = secrets.token_hex(16)
        self._ranks = ranks
        self._clock = clock
        self._max_batch = max(1, max_batch)
        self._coordinator, self._token, self._tls = coordinator, token, tls
        self._sender: BatchSender | None = None  # the gRPC side, made with the first request
        self._lock = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self._sent: dict[str, int] = {}  # job id -> requests sent in batches so far
        self._closed = False
        self.batches: list[int] = []  # the size of every batch sent, in order
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self._name)
        self._listener.listen(max(ranks * 2, 16))
        threading.Thread(target=self._accept, name="collsvc-join-relay-accept", daemon=True).start()
        threading.Thread(target=self._gather, name="collsvc-join-relay", daemon=True).start()

    def environment(self) -> dict[str, str]:
        """What the ranks' environment needs to find the relay: ``COLLSVC_JOIN_RELAY=NAME:SECRET``."""
        return {RELAY_ENV: f"{self._name}:{self._secret}"}

    def close(self) -> None:
        """Stops taking requests; requests not sent yet are dropped (their ranks join by themselves)."""
        with self._lock:
            self._closed = True
            dropped = [c for pending in self._pending.values() for c in pending.connections]
            self._pending.clear()
            self._lock.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for connection in dropped:
            connection.close()
        with self._lock:
            sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    # -- taking requests ---------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                request = self._read_request(connection)
            except (OSError, RelayClosed, ValueError) as exc:
                log.warning("join relay: refused a request: %s", exc)
                connection.close()
                continue
            self._batch_sender()  # its connection opens while the other ranks' requests come in
            with self._lock:
                if self._closed:
                    connection.close()
                    return
                pending = self._pending.setdefault(request.job_id, _Pending(first_at=self._clock()))
                pending.requests.append(request)
                pending.connections.append(connection)
                self._lock.notify_all()

    def _read_request(self, connection: socket.socket) -> JoinRequest:
        connection.settimeout(_READ_TIMEOUT)
        presented = receive_frame(connection)
        if not hmac.compare_digest(presented, self._secret.encode()):
            raise ValueError("wrong relay secret")
        from collsvc.proto.v1.coordinator_pb2 import JoinRequest  # a rank is running by now

        request = JoinRequest.FromString(receive_frame(connection))
        connection.settimeout(None)
        return request

    # -- sending batches ---------------------------------------------------------------------------

    def _gather(self) -> None:
        with self._lock:
            while not self._closed:
                now = self._clock()
                due = [job for job, pending in self._pending.items() if self._due(job, pending, now)]
                for job in due:
                    gathered = self._pending.pop(job)
                    self._sent[job] = self._sent.get(job, 0) + len(gathered.requests)
                    for first in range(0, len(gathered.requests), self._max_batch):  # the coordinator's limit
                        part = slice(first, first + self._max_batch)
                        batch = _Pending(gathered.requests[part], gathered.connections[part], gathered.first_at)
                        self.batches.append(len(batch.requests))
                        threading.Thread(
                            target=self._send, args=(batch,), name="collsvc-join-batch", daemon=True
                        ).start()
                waits = [p.first_at + GATHER_WINDOW - now for p in self._pending.values()]
                self._lock.wait(max(min(waits), 0.001) if waits else None)

    def _due(self, job: str, pending: _Pending, now: float) -> bool:
        """Whether ``job``'s gathered requests go now: every rank that has not joined sent one, or the
        first of them waited :data:`GATHER_WINDOW`."""
        unsent = self._ranks - self._sent.get(job, 0)
        return len(pending.requests) >= unsent or now - pending.first_at >= GATHER_WINDOW

    def _send(self, batch: _Pending) -> None:
        sender = self._batch_sender()
        answers = sender.answers(batch.requests)
        for connection, answer in zip(batch.connections, answers, strict=True):
            with contextlib.suppress(OSError):  # that rank is gone; the others are answered
                if answer:  # none: closed unanswered, so the rank joins by itself
                    send_frames(connection, answer)
            connection.close()

    def _batch_sender(self) -> BatchSender:
        """The gRPC side, loaded with the first request: the ranks are started by then (see module doc)."""
        from collsvc.launch.join_batch import BatchSender

        with self._lock:
            if self._sender is None:
                self._sender = BatchSender(self._coordinator, self._token, self._tls)
            return self._sender


def start_relay(
    ranks: int, elastic: bool, coordinator: str, token: str | None, say: Callable[[str], None]
) -> JoinRelay | None:
    """The relay for a launcher of ``ranks`` ranks, or None where every rank joins by itself: one rank,
    ``elastic`` supervision (its ranks join generations of their own), or a relay that cannot start
    (said through ``say``; TLS settings the ranks will refuse themselves, say)."""
    if ranks < 2 or elastic:
        return None
    try:
        return JoinRelay(coordinator, token, tls_from_env(os.environ), ranks)
    except (OSError, ValueError) as exc:
        say(f"collsvc run: each rank joins by itself (no join relay: {exc})")
        return None
