"""The channels of a :class:`~collsvc.client.rendezvous.CoordinatorClient`: the control channel, the
heartbeat stream's own, and their renewal when something other than the coordinator answered at its
address (:func:`~collsvc.client.coordinator_channel.answered_by_a_stranger`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import grpc

from collsvc.client.coordinator_channel import TlsProbe, answered_by_a_stranger, heartbeat_keepalive, make_channel
from collsvc.options import TlsFiles
from collsvc.proto.v1 import coordinator_pb2_grpc

log = logging.getLogger(__name__)

# The pause before a call is sent again on new connections after a stranger answered it.
STRANGER_RETRY_S = 0.5


class CoordinatorChannels:
    """Opens, renews and closes the two channels to the coordinator at ``address``."""

    def __init__(self, address: str, job_id: str, tls: TlsFiles | None, timeout: float) -> None:
        self.address = address
        self.job_id = job_id
        self.tls = tls
        self.timeout = timeout  # any one control call or collective step
        self.channel = make_channel(address, tls)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self._tls_probe = TlsProbe(self.channel, min(timeout, 5.0))
        self._heartbeat_channel: grpc.Channel | None = None
        self._heartbeat_ready: grpc.Future[None] | None = None  # see connect_ahead
        self._dropped: list[grpc.Channel] = []  # closed with this client (see _drop_heartbeat_channel)

    def _connected(self, seconds: float) -> bool:
        """Waits up to ``seconds`` for the control channel to connect; returns whether it did."""
        ready = grpc.channel_ready_future(self.channel)
        try:
            ready.result(timeout=max(seconds, 0.0))
        except grpc.FutureTimeoutError:
            return False
        finally:
            ready.cancel()
        return True

    def connect_ahead(self, heartbeat_interval: float) -> None:
        """Starts both connections to the coordinator now and returns at once.

        The control connection opens with the first TLS probe of :meth:`join` (its answer is read
        there), and the heartbeat stream's connection (:meth:`heartbeat_channel`) opens beside it, so
        that both handshakes run while this process does other work (serving its peer endpoint,
        waiting in Join) rather than one after the other before and after the Join.

        Args:
            heartbeat_interval: the member's heartbeat interval (the heartbeat channel's keepalive pace).
        """
        self._tls_probe.send()
        if self._heartbeat_ready is None:
            self._heartbeat_ready = grpc.channel_ready_future(self.heartbeat_channel(heartbeat_interval))

    def heartbeat_channel(self, interval: float) -> grpc.Channel:
        """The channel of the heartbeat stream: its own connection, pinged at the heartbeat pace (see
        :func:`heartbeat_keepalive`), so that a silently dead path breaks the stream within a few
        intervals. Created on first use (on connections of its own after one was dropped)."""
        if self._heartbeat_channel is None:
            self._heartbeat_channel = make_channel(
                self.address, self.tls, heartbeat_keepalive(interval), own_connections=bool(self._dropped)
            )
        return self._heartbeat_channel

    def renew_heartbeat_channel(self, interval: float) -> grpc.Channel:
        """A new heartbeat channel on connections of its own, for a stream whose connection reached
        something other than the coordinator (:func:`answered_by_a_stranger`)."""
        self._drop_heartbeat_channel()
        return self.heartbeat_channel(interval)

    def _stranger_answered(self, exc: grpc.RpcError, deadline: float, what: str) -> bool:
        """When ``exc`` is a stranger's answer (:func:`answered_by_a_stranger`) and ``deadline`` has not
        passed: logs it, opens new connections, pauses briefly and returns True (send the call again)."""
        if not answered_by_a_stranger(exc) or time.monotonic() >= deadline:
            return False
        log.warning(
            "job %s: something other than a coordinator answered at %s (%s): the address is not routed to "
            "the coordinator yet? sending the %s again on new connections",
            self.job_id, self.address, exc.details(), what,
        )  # fmt: skip
        self._renew_control_channel()
        self._drop_heartbeat_channel()
        time.sleep(min(STRANGER_RETRY_S, max(deadline - time.monotonic(), 0.0)))
        return True

    @contextlib.contextmanager
    def _renewing_on_strangers(self, stub: coordinator_pb2_grpc.CoordinatorStub, where: str) -> Iterator[None]:
        """Renews the control channel when a call on ``stub`` (still the current one) got a stranger's
        answer; the error goes on (``reconnect.unreachable`` has the call sent again)."""
        try:
            yield
        except grpc.RpcError as exc:
            if answered_by_a_stranger(exc) and stub is self.stub:
                log.warning("%s: not a coordinator's answer (%s); reconnecting", where, exc.details())
                self._renew_control_channel()
            raise

    def _renew_control_channel(self) -> None:
        """The control channel anew, on connections of its own (an established connection keeps
        reaching whatever it reached; calls in flight on the old one end UNAVAILABLE, and are sent
        again)."""
        self._tls_probe.cancel()
        old, self.channel = self.channel, make_channel(self.address, self.tls, own_connections=True)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)
        self._tls_probe = TlsProbe(self.channel, min(self.timeout, 5.0))
        old.close()

    def _drop_unconnected_heartbeat_channel(self) -> None:
        """After the Join: drops the heartbeat stream's connection opened ahead when it has not
        connected (the name did not resolve, or nothing listened, when it tried). It would retry on
        gRPC's backoff, a name's resolution seconds later, while the stream opens now and would fail
        fast; a new one connects now, as the Join's just did."""
        if self._heartbeat_ready is not None and not self._heartbeat_ready.done():
            self._drop_heartbeat_channel()

    def _drop_heartbeat_channel(self) -> None:
        """Sets the heartbeat channel aside; :meth:`heartbeat_channel` makes a new one.

        It is closed with this client: closing a channel while gRPC still polls its state for the
        cancelled ready future can fail in gRPC's polling thread.
        """
        if self._heartbeat_ready is not None:
            with contextlib.suppress(Exception):  # grpc may raise from cancel() once its channel closed
                self._heartbeat_ready.cancel()
            self._heartbeat_ready = None
        if self._heartbeat_channel is not None:
            self._dropped.append(self._heartbeat_channel)
            self._heartbeat_channel = None

    def close(self) -> None:
        self._tls_probe.cancel()
        if self._heartbeat_ready is not None:
            with contextlib.suppress(Exception):  # grpc may raise from cancel() once its channel closed
                self._heartbeat_ready.cancel()
        self.channel.close()
        if self._heartbeat_channel is not None:
            self._heartbeat_channel.close()
        for channel in self._dropped:
            channel.close()
