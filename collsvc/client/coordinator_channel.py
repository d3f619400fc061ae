"""Channels to the coordinator: fast reconnects, keepalive pings, and the heartbeat stream's own pace."""

from __future__ import annotations

from typing import Any

import grpc

from collsvc.client.backends.ring.grpc_transport import channel_credentials, keepalive_options
from collsvc.types import TlsFiles

# Ranks often dial before the coordinator listens; gRPC's default 1 s reconnect backoff would dominate
# start-up, so retry quickly (measured: 1.3 s -> 0.4 s to the first barrier).
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
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


def make_channel(address: str, tls: TlsFiles | None, keepalive: tuple[float, float] | None = None) -> grpc.Channel:
    """A channel to the coordinator (mutual TLS when ``tls`` is given).

    Args:
        address: ``host:port`` of the coordinator.
        tls: client TLS files, or None for plaintext.
        keepalive: (ping every, dead after) in seconds; None: the control-call defaults.
    """
    ping_every, dead_after = keepalive or (CONTROL_PING_EVERY, CONTROL_DEAD_AFTER)
    options = [*CHANNEL_OPTIONS, *keepalive_options(ping_every, dead_after, idle=keepalive is not None)]
    if tls is not None:
        return grpc.secure_channel(address, channel_credentials(tls), options=options)
    return grpc.insecure_channel(address, options=options)
