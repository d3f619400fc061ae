"""Channels to the coordinator: fast reconnects, keepalive pings, and the heartbeat stream's own pace."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from typing import Any

import grpc

from collsvc.client.backends.grpc_options import channel_credentials, keepalive_options
from collsvc.errors import AuthenticationError
from collsvc.options import TlsFiles

log = logging.getLogger(__name__)

# A rank may dial before its coordinator listens; gRPC's default 1 s reconnect backoff would dominate
# start-up, so retry quickly (measured: 1.3 s -> 0.4 s to the first barrier). gRPC retries a refused
# connection after 100 ms at the earliest (its floor for the initial backoff), then 1.6 times later each
# time up to the maximum. "min_reconnect_backoff_ms" is no backoff: it is the least time gRPC gives one
# connection attempt (TCP connect plus the server's HTTP/2 SETTINGS) before abandoning it. At its floor
# (100 ms) attempts failed on a loaded machine while the coordinator was busy starting ("timed out before
# receiving SETTINGS frame"), and fail-fast calls with them; 1 s is ample and short next to the grace period.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 1000),
    ("grpc.max_reconnect_backoff_ms", 500),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
]


# A coordinator call (a barrier, a key wait) on a path that died silently (no FIN, no RST) would wait
# for its whole deadline, minutes; keepalive pings end it within CONTROL_PING_EVERY + CONTROL_DEAD_AFTER
# seconds (5 s, the default heartbeat timeout) with UNAVAILABLE, which becomes a RendezvousError.
CONTROL_PING_EVERY = 2.0
CONTROL_DEAD_AFTER = 3.0


def heartbeat_keepalive(interval: float) -> tuple[float, float]:
    """(ping every, dead after) in seconds for the heartbeat stream of a member beating every ``interval``.

    The coordinator sends nothing on the stream unless something happens, so silence alone proves
    nothing; an unanswered ping does. A member on a dead path thus finds out within about four
    intervals (the coordinator's heartbeat timeout should be several intervals, 5 by default) and
    starts its grace period. ``dead_after`` is at least 1 s so that a loaded machine answering a
    ping late is not taken for a dead one.
    """
    return max(interval, 0.1), max(3 * interval, 1.0)


def make_channel(
    address: str, tls: TlsFiles | None, keepalive: tuple[float, float] | None = None, *, own_connections: bool = False
) -> grpc.Channel:
    """A channel to the coordinator (mutual TLS when ``tls`` is given).

    Args:
        address: ``host:port`` of the coordinator.
        tls: client TLS files, or None for plaintext.
        keepalive: (ping every, dead after) in seconds; None: the control-call defaults.
        own_connections: connections of its own, never those of an earlier channel with the same
            options (gRPC shares them process-wide by default): for a channel that replaces one whose
            connection reached the wrong server or waits in a reconnect backoff.
    """
    ping_every, dead_after = keepalive or (CONTROL_PING_EVERY, CONTROL_DEAD_AFTER)
    options = [*CHANNEL_OPTIONS, *keepalive_options(ping_every, dead_after, idle=keepalive is not None)]
    if own_connections:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if tls is not None:
        return grpc.secure_channel(address, channel_credentials(tls), options=options)
    return grpc.insecure_channel(address, options=options)


def answered_by_a_stranger(exc: grpc.RpcError) -> bool:
    """Whether an HTTP/2 server that is not a gRPC server answered the call (an HTTP status without a
    gRPC one, e.g. "Received http2 header with status: 404").

    A rank that starts before its cluster routes the coordinator's address meets such answers: a
    Kubernetes Service IP that kube-proxy has not programmed yet leaves the node by its default route,
    where a proxy or gateway may answer. The coordinator itself always answers with a gRPC status.
    """
    return "received http2 header with status" in ((exc.details() if hasattr(exc, "details") else "") or "").lower()


# The standard health service answers without a token; an empty body asks about the whole server.
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# gRPC's words for a TLS refusal: this side's handshake failed, or the server accepted the TCP
# connection and closed it (it refused our certificate, our lack of one, or our plaintext).
_TLS_REFUSAL_WORDS = ("handshake", "socket closed")


class TlsProbe:
    """Tells a coordinator that refuses this client's TLS (or its lack of TLS) from one not up yet.

    A few fail-fast calls to the health service: "connection refused" means not up yet, while a
    handshake error or an accepted-then-closed connection every time means TLS is refused. The first
    call may be sent ahead (:meth:`send`), so that it opens the connection while the caller does
    other work.

    Args:
        channel: the channel to the coordinator.
        timeout: seconds each call may take.
    """

    def __init__(self, channel: grpc.Channel, timeout: float) -> None:
        self._check = channel.unary_unary(HEALTH_CHECK, request_serializer=None, response_deserializer=None)
        self._timeout = timeout
        self._sent: grpc.Future[Any] | None = None

    def send(self) -> None:
        """Sends the first call now; :meth:`refusal` reads its answer."""
        if self._sent is None:
            self._sent = self._check.future(b"", timeout=self._timeout)

    def refusal(self, attempts: int = 3, deadline: float | None = None) -> str | None:
        """gRPC's words for the last failure when every call failed the way a TLS refusal does; None
        when the coordinator answered, is not up yet, or did not answer before ``deadline``
        (``time.monotonic()`` seconds; a frozen coordinator accepts the connection and never answers)."""
        detail = ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(0.05)
            remaining = self._timeout if deadline is None else min(self._timeout, deadline - time.monotonic())
            if remaining <= 0:
                return None
            sent, self._sent = self._sent, None
            try:
                if sent is not None:
                    try:
                        sent.result(timeout=remaining)
                    except grpc.FutureTimeoutError:
                        sent.cancel()
                        return None
                else:
                    self._check(b"", timeout=remaining)
                return None
            except grpc.RpcError as exc:
                detail = (exc.details() if hasattr(exc, "details") else "") or ""
                if exc.code() != grpc.StatusCode.UNAVAILABLE or not any(
                    word in detail.lower() for word in _TLS_REFUSAL_WORDS
                ):
                    return None
        return detail

    def check(self, address: str, job_id: str, *, uses_tls: bool, deadline: float | None = None) -> None:
        """Fails fast when the coordinator is up but refuses this client's TLS (or its lack of TLS).

        Join waits for the coordinator to come up (wait_for_ready), so a refused handshake would look
        like an absent coordinator until the whole timeout passed. It probes until ``deadline`` at most.

        Raises:
            AuthenticationError: every probe failed the way a TLS refusal does.
        """
        detail = self.refusal(deadline=deadline)
        if detail is None:
            return  # up (or not up yet): Join reports or waits as usual
        hint = (
            "check that this rank's certificate is signed by the CA the coordinator trusts, that "
            "COLLSVC_TLS_CA verifies the coordinator's certificate, and that the coordinator serves TLS"
            if uses_tls
            else "the coordinator presumably requires mutual TLS: set COLLSVC_TLS_CERT, COLLSVC_TLS_KEY and "
            "COLLSVC_TLS_CA"
        )
        raise AuthenticationError(f"TLS refused by coordinator {address} (job '{job_id}'): {hint} ({detail})")

    def cancel(self) -> None:
        """Cancels a call sent ahead and never read."""
        sent, self._sent = self._sent, None
        if sent is not None:
            with contextlib.suppress(Exception):  # grpc may raise from cancel() once its channel closed
                sent.cancel()


def wait_for_launch_signal(fd: int, timeout: float) -> None:
    """Waits until the pipe ``fd`` reaches its end, at most ``timeout`` seconds, then closes ``fd``.

    ``collsvc run`` closes the other end once its embedded coordinator listens (one that cannot start
    gets its ranks stopped instead), see ``config.coordinator_ready_fd``. Dialing a port that does not
    listen yet would cost a reconnect backoff: gRPC waits at least 100 ms before it tries again, then
    1.6 times longer each time.
    """
    try:
        select.select([fd], [], [], max(timeout, 0.0))
    finally:
        os.close(fd)


def log_join_wait(
    stub: Any,
    address: str,
    job_id: str,
    metadata: Any,
    world_size: int,
    waited: float,
    deadline: float | None,
    timeout: float,
) -> None:
    """Logs, while a Join waits, which ranks have not joined, from the coordinator's status (asked for
    ``timeout`` seconds, at most 5, and never past ``deadline``)."""
    from collsvc.client.join_report import describe_not_joined
    from collsvc.proto.v1 import coordinator_pb2

    limit = min(timeout, 5.0)
    if deadline is not None:
        limit = min(limit, deadline - time.monotonic())
    if limit <= 0:
        return
    try:
        reply = stub.GetStatus(coordinator_pb2.GetStatusRequest(job_id=job_id), timeout=limit, metadata=metadata)
    except grpc.RpcError as exc:
        what = f"coordinator {address} not reachable yet ({exc.code().name})"
        log.warning("job %s: waiting %.0fs in rendezvous; %s", job_id, waited, what)
        return
    for job in reply.jobs:
        if job.job_id == job_id and job.state == "joining":
            what = describe_not_joined(world_size, [m.rank for m in job.members])
            log.warning("job %s: waiting %.0fs in rendezvous; %s", job_id, waited, what)
