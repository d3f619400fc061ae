"""Building, serving and embedding the coordinator daemon.

``build_server`` and ``serve`` are separate steps so that tests bind port 0 and read the port back;
:class:`CoordinatorThread` runs a coordinator on its own event loop for ``collsvc run`` and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from collsvc.options import CoordinatorOptions
from collsvc.server.request_limits import RequestLimits
from collsvc.server.services.coordinator import SERVICE, CoordinatorServicer, add_coordinator
from collsvc.server.services.hub import DEFAULT_WAIT_S, Hub
from collsvc.server.services.liveness import monitor_period

if TYPE_CHECKING:  # prometheus-client is imported only when metrics are served
    from collsvc.server.metrics import MetricsEndpoint

log = logging.getLogger(__name__)

SERVICE_NAME = "collsvc.proto.v1.Coordinator"
DRAIN_GRACE_S = 2.0
# The cyclic garbage collector's first-generation threshold while a coordinator daemon serves (Python's
# default is 700). Each waiting call holds dozens of tracked objects, which the collector rescans
# again and again as a rendezvous burst allocates: 16,384 ranks joining, passing a barrier and
# leaving kept the collector busy for 11.1 s with the defaults, 1.4 s with this (measured with
# benchmarks/rendezvous_scale.py). Calls free their objects by reference counting; cyclic garbage
# still goes within a million allocations.
SERVING_GC_THRESHOLD = 50_000


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_security(options: CoordinatorOptions) -> None:
    """Refuses an unauthenticated coordinator on a non-loopback address.

    Raises:
        ValueError: ``options.host`` is not loopback and neither a token, TLS nor ``insecure`` is set.
    """
    if is_loopback(options.host) or options.token or options.tls is not None or options.insecure:
        return
    raise ValueError(
        f"refusing to serve the coordinator on {options.host} without authentication: anyone who can "
        "reach it could join or abort jobs. Pass --token-file FILE (a shared secret), or "
        "--tls-cert/--tls-key/--tls-ca (mutual TLS), or --insecure to accept unauthenticated access."
    )


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _bind_error(host: str, port: int) -> OSError:
    """The reason a bind failed, found by trying it with a plain socket (gRPC only says 'failed')."""
    why, code = "address unavailable", errno.EADDRNOTAVAIL
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host.strip("[]"), port))
    except OSError as exc:
        why, code = exc.strerror or str(exc), exc.errno or code
    if code == errno.EADDRINUSE:
        why = "address already in use (is another coordinator running on this port?)"
    return OSError(code, f"cannot bind coordinator to {_address(host, port)}: {why}")


def _server_credentials(options: CoordinatorOptions) -> grpc.ServerCredentials | None:
    tls = options.tls
    if tls is None:
        return None
    key, cert, ca = (Path(p).read_bytes() for p in (tls.key, tls.cert, tls.ca))
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


async def build_server(
    options: CoordinatorOptions,
    *,
    metrics_ready: Callable[[int], None] | None = None,
    hub: Hub | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Builds a coordinator server and binds it (not started yet).

    Args:
        options: where and how to serve; port 0 picks a free port.
        metrics_ready: called with the bound port of ``/metrics`` when ``options.metrics_port`` is set.
        hub: the jobs' state to serve (a new one when not given; :func:`serve` keeps its own to drain it).

    Returns:
        ``(server, port)``: the server, and the port it is bound to.

    Raises:
        ValueError: a non-loopback host without token, TLS or ``insecure`` (see :func:`check_security`).
        OSError: the address cannot be bound (in use, or not an address of this machine).
    """
    check_security(options)
    hub = hub or Hub(options)
    # The largest request the protocol needs under these limits (a compare-and-set of two values at
    # the value limit); gRPC refuses anything bigger before it is handed to us. Replies may be larger
    # (the status of every job), and only trusted code makes them.
    max_request = RequestLimits(options.limits).max_receive_bytes(SERVICE)
    max_reply = max(options.limits.max_message_bytes, max_request)
    backlog = max(1 << 16, 2 * options.limits.max_world_size)
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # a second coordinator on a used port must fail, not share it
            ("grpc.max_receive_message_length", max_request),
            # A fixed 1 MiB receive window per call instead of one that grows with the measured
            # bandwidth: gRPC refuses an oversized message only after taking in what the window
            # admits (8 concurrent 64 MiB Joins cost ~70 MB with a growing window, ~3 MB with this),
            # and a 1 MiB value still arrives as fast (docs/security.md).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", 1 << 20),
            ("grpc.max_send_message_length", max_reply),
            ("grpc.max_concurrent_streams", 1 << 20),
            # Thousands of ranks join at once. gRPC core cancels (status CANCELLED) calls that arrive
            # while 1000 (soft) / 3000 (hard) are queued before the application took them, which a
            # rendezvous burst of ~1800 calls already hits (benchmarks/rendezvous_scale.py): room for
            # the Joins and Barriers of the largest job, twice.
            ("grpc.server.max_pending_requests", backlog),
            ("grpc.server.max_pending_requests_hard_limit", 2 * backlog),
            # It also cancels a call that waited 30 s before the application took it, as the tail of
            # a 65,536-rank burst does on a busy machine; such a call still ends at its own deadline.
            ("grpc.server_max_unrequested_time_in_server", int(DEFAULT_WAIT_S)),
            # Silent partitions: members ping (HTTP/2 keepalive) to find a dead path within a few heartbeat
            # intervals. gRPC's default policy answers pings more often than every 5 minutes without data
            # with GOAWAY "too_many_pings"; accept them. The coordinator pings its members too, to close
            # half-open connections of members gone without a trace; a ping may go unanswered for two
            # heartbeat timeouts, so the heartbeat check names a frozen member first, as it always did.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 100),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.keepalive_time_ms", int(options.heartbeat_timeout * 1000)),
            ("grpc.keepalive_timeout_ms", int(2 * options.heartbeat_timeout * 1000)),
        ],
    )
    add_coordinator(server, CoordinatorServicer(hub), token=options.token)
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]  # the asyncio servicer
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    address = _address(options.host, options.port)
    credentials = _server_credentials(options)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise _bind_error(options.host, options.port) from exc
    if port == 0:
        raise _bind_error(options.host, options.port)
    metrics = _start_metrics(hub, options, metrics_ready)
    asyncio.get_running_loop().create_task(_monitor(server, hub, metrics), name="collsvc-heartbeat-monitor")
    log.info(
        "coordinator bound to %s (token %s, tls %s)",
        _address(options.host, port),
        "on" if options.token else "off",
        "on" if credentials else "off",
    )
    return server, port


def _start_metrics(
    hub: Hub, options: CoordinatorOptions, ready: Callable[[int], None] | None
) -> MetricsEndpoint | None:
    """Serves Prometheus ``/metrics`` when ``options.metrics_port`` is set (OSError when it cannot bind)."""
    if options.metrics_port is None:
        return None
    from collsvc.server.metrics import MetricsEndpoint

    metrics = MetricsEndpoint(hub, options.host, options.metrics_port)
    port = metrics.start()
    log.info("coordinator metrics on http://%s/metrics", _address(options.host, port))
    if ready is not None:
        ready(port)
    return metrics


async def _monitor(server: grpc.aio.Server, hub: Hub, metrics: MetricsEndpoint | None = None) -> None:
    """Checks heartbeats every half interval for exactly as long as the server runs (and serves metrics as long)."""
    period = monitor_period(hub.options)
    try:
        # wait_for_termination returns True when the *timeout* passed and False once the server stopped.
        while await server.wait_for_termination(timeout=period):
            try:
                hub.tick()
            except Exception:  # a bug here must not stop liveness checks for every job
                log.exception("heartbeat monitor failed")
    finally:
        if metrics is not None:
            metrics.stop()


@contextlib.contextmanager
def _collector_tuned_for_serving() -> Iterator[None]:
    """Freezes what start-up allocated (the collector never rescans it) and raises the collector's
    thresholds; restores both afterwards. Only for a process that exists to serve (see :func:`serve`)."""
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(SERVING_GC_THRESHOLD, 20, 20)
    try:
        yield
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()


async def serve(
    options: CoordinatorOptions,
    *,
    ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
    metrics_ready: Callable[[int], None] | None = None,
) -> None:
    """Runs a coordinator until ``stop`` is set or SIGTERM/SIGINT arrives, then drains.

    In the main thread (a coordinator daemon) it also handles the signals and tunes the garbage
    collector for thousands of waiting calls (:data:`SERVING_GC_THRESHOLD`); a coordinator embedded
    in another program's thread (:class:`CoordinatorThread`) leaves both to that program.

    Args:
        options: where and how to serve.
        ready: called with the bound port once the server listens.
        stop: set it to shut down (signals are only handled when running in the main thread).
        metrics_ready: called with the port of ``/metrics`` (when ``options.metrics_port`` is set).

    Raises:
        ValueError, OSError: as :func:`build_server`.
    """
    hub = Hub(options)
    server, port = await build_server(options, metrics_ready=metrics_ready, hub=hub)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    daemon = threading.current_thread() is threading.main_thread()
    if daemon:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - platforms without it
                pass
    with _collector_tuned_for_serving() if daemon else contextlib.nullcontext():
        await server.start()
        log.info("coordinator listening on %s", _address(options.host, port))
        try:
            if ready is not None:
                ready(port)
            await stop.wait()
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
            log.info("coordinator on port %d stopping (grace %.1fs)", port, DRAIN_GRACE_S)
            hub.drain()  # the streams the stop cancels are not members failing
            await server.stop(grace=DRAIN_GRACE_S)


class CoordinatorThread:
    """A coordinator on a background thread with its own event loop.

    Example::

        coordinator = CoordinatorThread(CoordinatorOptions(port=0))
        port = coordinator.start()
        ...
        coordinator.stop()
    """

    def __init__(self, options: CoordinatorOptions) -> None:
        self.options = options
        self.port: int | None = None
        self.metrics_port: int | None = None  # the bound /metrics port, when options.metrics_port is set
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        """``host:port`` to dial (valid after :meth:`start`)."""
        return _address(self.options.host, self.port or 0)

    def start(self, timeout: float = 30.0) -> int:
        """Starts serving; returns the bound port once the coordinator listens.

        Raises:
            ValueError, OSError: as :func:`build_server` (e.g. the port is in use).
            RuntimeError: already started, or it did not come up within ``timeout`` seconds.
        """
        if self._thread is not None:
            raise RuntimeError("coordinator thread already started")
        self._thread = threading.Thread(target=self._run, name="collsvc-coordinator", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"coordinator did not start within {timeout:g}s")
        if self._error is not None:
            self._thread.join(timeout)
            raise self._error
        assert self.port is not None
        return self.port

    def _on_metrics(self, port: int) -> None:
        self.metrics_port = port

    def _on_ready(self, port: int) -> None:
        self.port = port
        self._ready.set()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def main() -> None:
            self._stop = asyncio.Event()
            await serve(self.options, ready=self._on_ready, stop=self._stop, metrics_ready=self._on_metrics)

        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # handed to start(); the thread ends either way
            if not self._ready.is_set():
                self._error = exc
            else:
                log.exception("coordinator thread failed")
        finally:
            self._ready.set()
            try:
                _cancel_remaining(loop)
            finally:
                loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the coordinator (drains for up to ~2 s) and joins the thread."""
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed in between
                loop.call_soon_threadsafe(stop.set)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> CoordinatorThread:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _cancel_remaining(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
