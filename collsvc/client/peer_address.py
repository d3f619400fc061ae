"""Where a rank's peer endpoint listens, and the address its peers dial."""

from __future__ import annotations

import ipaddress
import socket

from collsvc.options import InitOptions


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_address(address: str) -> tuple[str, int | None]:
    """``host:port`` (or ``[v6]:port``, or a bare host) -> (host, port or None)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    if address.count(":") == 1:
        host, port = address.split(":")
        return host, int(port)
    return address, None


def peer_binding(options: InitOptions) -> tuple[str, str]:
    """(address to bind the peer endpoint on, host peers should dial).

    A loopback coordinator means a single-host job: bind loopback only. Otherwise bind every interface
    and advertise ``COLLSVC_ADVERTISE_ADDRESS`` or the local address that routes to the coordinator.
    """
    coordinator_host, coordinator_port = split_address(options.coordinator)
    if options.advertise_address:
        advertised, _ = split_address(options.advertise_address)
        return ("127.0.0.1" if _is_loopback(coordinator_host) and _is_loopback(advertised) else "0.0.0.0"), advertised
    if _is_loopback(coordinator_host):
        return "127.0.0.1", "127.0.0.1"
    try:
        # A UDP "connect" sends nothing; it asks the kernel which local address routes there.
        family = socket.AF_INET6 if ":" in coordinator_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((coordinator_host, coordinator_port or 29400))
            local = str(probe.getsockname()[0])
    except OSError:
        local = socket.gethostbyname(socket.gethostname())
    return "0.0.0.0", local
