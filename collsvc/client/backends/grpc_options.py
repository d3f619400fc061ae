"""gRPC channel and server settings shared by the peer transport and the coordinator connection:
mutual-TLS credentials, message size limits and HTTP/2 keepalive."""

from __future__ import annotations

from typing import Any

import grpc

from collsvc.options import TlsFiles


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Mutual-TLS server credentials: the client must present a certificate signed by ``tls.ca``."""
    return grpc.ssl_server_credentials(
        [(_read(tls.key), _read(tls.cert))], root_certificates=_read(tls.ca), require_client_auth=True
    )


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Mutual-TLS client credentials."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca), private_key=_read(tls.key), certificate_chain=_read(tls.cert)
    )


def message_options(max_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]


# A silently dead path (a pulled cable, a crashed switch, a host that froze: no FIN, no RST) leaves a
# TCP connection open and a call on it waiting for its whole deadline. HTTP/2 keepalive pings find it:
# a ping unanswered for ``dead_after`` seconds closes the connection and fails its calls (UNAVAILABLE).
# Between peers it is a backstop behind the coordinator's heartbeats (which name the failure better):
# a send to an unreachable peer fails within PEER_PING_EVERY + PEER_DEAD_AFTER seconds, 5 s, the
# default heartbeat timeout.
PEER_PING_EVERY = 2.0
PEER_DEAD_AFTER = 3.0
# Servers accept pings this often from their clients; gRPC's default (one per 5 minutes without data,
# two strikes) would answer our keepalive with GOAWAY "too_many_pings".
MIN_PING_INTERVAL = 0.1


def keepalive_options(ping_every: float, dead_after: float, *, idle: bool) -> list[tuple[str, Any]]:
    """Client channel options: ping every ``ping_every`` s; a ping unanswered for ``dead_after`` s
    (or data unacknowledged as long, through TCP_USER_TIMEOUT) breaks the connection and its calls.

    Args:
        ping_every: seconds between pings.
        dead_after: seconds a ping may wait for its answer.
        idle: ping also while no call is open (otherwise only while one is).
    """
    return [
        ("grpc.keepalive_time_ms", max(int(ping_every * 1000), int(MIN_PING_INTERVAL * 1000))),
        ("grpc.keepalive_timeout_ms", int(dead_after * 1000)),
        ("grpc.keepalive_permit_without_calls", int(idle)),
        ("grpc.http2.max_pings_without_data", 0),  # no limit: a call may wait long for its answer
    ]


def ping_permit_options() -> list[tuple[str, Any]]:
    """Server options that accept the clients' keepalive pings (see :func:`keepalive_options`)."""
    return [
        ("grpc.http2.min_recv_ping_interval_without_data_ms", int(MIN_PING_INTERVAL * 1000)),
        ("grpc.http2.max_ping_strikes", 0),  # 0: never GOAWAY a client for pinging
    ]
