"""Which road a frame to each peer takes: its bulk lane where the peer offers one, else gRPC.

The first send to a peer asks it for a lane over gRPC (``Lane``, see ``lane_wire.py``) and connects.
A peer that offers none (TLS is on there, ``COLLSVC_TCP_LANE=0``, an older version answering
UNIMPLEMENTED) or whose lane cannot be reached (a firewall that lets only the gRPC port through) gets
its frames over gRPC for the rest of the job. A peer that cannot be asked right now (its process is
stopped or gone) is asked again at the next send; meanwhile that frame goes over gRPC, which reports
the failure as it always did. A lane that broke is replaced the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import grpc

from collsvc.client.backends.ring.lane_sender import LaneConnection, open_lane
from collsvc.client.backends.ring.lane_wire import HANDSHAKE_SECONDS, OFFER, LaneError, split_address

log = logging.getLogger(__name__)

LaneAsk = Callable[[int, bytes, float], bytes]  # (global rank, request, timeout) -> the peer's answer
LaneBroken = Callable[[int, LaneError], None]  # (global rank, why its lane broke)


class _NoLane:
    """The peer offers no lane, or its lane cannot be reached: gRPC for the rest of the job."""


NO_LANE = _NoLane()


class Lanes:
    """This rank's lanes to its peers, opened on first use."""

    def __init__(self, rank: int, addresses: Mapping[int, str], ask: LaneAsk, on_broken: LaneBroken) -> None:
        self._rank = rank
        self._addresses = dict(addresses)
        self._ask = ask
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self._lanes: dict[int, LaneConnection | _NoLane] = {}
        self._opening: dict[int, threading.Lock] = {}

    def to(self, dst: int, deadline: float) -> LaneConnection | None:
        """The open lane to global rank ``dst``, opening one if there is none; None: use gRPC."""
        lane = self._lanes.get(dst)
        if isinstance(lane, LaneConnection) and not lane.broken:
            return lane
        if lane is NO_LANE:
            return None
        with self._lock:
            opening = self._opening.setdefault(dst, threading.Lock())
        with opening:  # one opening per peer at a time; the others wait for its outcome
            lane = self._lanes.get(dst)
            if isinstance(lane, LaneConnection) and not lane.broken:
                return lane
            if lane is NO_LANE:
                return None
            opened = self._open(dst, deadline)
            if opened is not None:
                self._lanes[dst] = opened
            if isinstance(opened, LaneConnection):
                if isinstance(lane, LaneConnection):
                    lane.close()
                return opened
            return None

    def _open(self, dst: int, deadline: float) -> LaneConnection | _NoLane | None:
        """A new lane to ``dst``, NO_LANE where it has none, None where it cannot be asked now."""
        timeout = max(min(deadline - time.monotonic(), HANDSHAKE_SECONDS), 0.001)
        try:
            answer = self._ask(dst, self._rank.to_bytes(4, "little", signed=True), timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT):
                return NO_LANE
            return None
        if len(answer) != OFFER.size:
            return NO_LANE
        port, ticket = OFFER.unpack(answer)
        host = split_address(self._addresses[dst])
        try:
            return open_lane(host, port, self._rank, ticket, timeout, lambda error: self._on_broken(dst, error))
        except OSError as exc:
            log.info(
                "rank %d: no bulk lane to rank %d at %s:%d (%s); frames go over gRPC", self._rank, dst, host, port, exc
            )
            return NO_LANE

    def drain(self, timeout: float) -> bool:
        """Waits (at most ``timeout`` seconds) until every peer this rank has a lane to confirmed that
        all frames sent to it are in its mailbox; returns whether all did."""
        deadline = time.monotonic() + timeout
        with self._lock:
            open_lanes = [lane for lane in self._lanes.values() if isinstance(lane, LaneConnection)]
        waits = [lane.start_drain(deadline) for lane in open_lanes if not lane.broken]
        return all(wait is not None and wait.wait(max(deadline - time.monotonic(), 0)) for wait in waits)

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes = self._lanes, {}
        for lane in lanes.values():
            if isinstance(lane, LaneConnection):
                lane.close()
