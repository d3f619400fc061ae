"""Liveness: heartbeats with progress to the coordinator, and the job events it pushes back.

The :class:`Watcher` sends this rank's progress (``progress.py``) and turns the coordinator's job
events into the job's first failure (``failure_state.py``), which wakes every waiter.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from collsvc.client.coordinator_channel import answered_by_a_stranger
from collsvc.client.failure_state import FailureState
from collsvc.client.progress import ProgressTracker
from collsvc.client.rendezvous import CoordinatorClient
from collsvc.errors import (
    AbortedError,
    CollectiveMismatchError,
    CollsvcError,
    RankFailedError,
    RendezvousError,
    error_from_rpc,
)
from collsvc.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)
Events = coordinator_pb2.EventKind
# Stream errors that may mean a coordinator restarting (or a path breaking): retried within the grace.
_RETRIABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


def event_error(
    event: coordinator_pb2.WatchEvent, own_rank: int | None = None, own_host: str | None = None
) -> BaseException | None:
    """The exception a job event means for process ``own_rank`` on ``own_host`` (None: a bystander's
    view from nowhere), or None for informational events.

    A member that left because its collective failed on this very rank (a link between the two that
    dropped its traffic while both reached the coordinator, or this process stopped or starved for
    longer than the call's timeout) is named instead: this process is running, so it is not the peer
    that failed, and an error naming the rank that raises it would send its user looking at itself.
    A member that left because it could not reach ranks the coordinator knew to be running is a cut
    link between hosts (:func:`cut_link_error`): each rank names the link's far end from where it runs.
    """
    ranks, hosts = list(event.ranks), list(event.hosts)
    where = ", ".join(f"{r} ({h})" if h else str(r) for r, h in zip(ranks, hosts or [""] * len(ranks), strict=False))
    if event.kind == Events.EVENT_KIND_MEMBER_FAILED:
        return RankFailedError(f"rank {where} failed: {event.reason}", ranks, hosts)
    if event.kind == Events.EVENT_KIND_MEMBER_LEFT:
        details = _left_details(event)
        cause, reason = _cause(details)
        if own_rank is not None and own_rank in cause:
            others = [r for r in cause if r != own_rank]
            return RankFailedError(
                f"rank {where} left the job after its collective failed waiting on this rank ({own_rank}), "
                "which is running: the path between them dropped the traffic, or this process was stopped "
                f"or starved for longer than the call's timeout; its error: {reason or 'not told'}",
                sorted({*ranks, *others}),
                unreachable=bool(details.get("unreachable", False)),
            )
        running = _running(details)
        if own_rank is not None and any(rank in running for rank in cause):
            return cut_link_error(event, where, reason, running, own_host)
        if cause and reason:
            # It ended because its collective failed on these ranks (failed, left or late): its error says how.
            return RankFailedError(f"rank {where} left the job after its collective failed: {reason}", cause)
        if cause:
            # It ended because its job had failed on these ranks: they are the ones at fault.
            named = ", ".join(str(r) for r in cause)
            return RankFailedError(
                f"rank {named} failed (rank {where} left the job after its collective failed because of it)", cause
            )
        return RankFailedError(f"rank {where} left the job", ranks, hosts)
    if event.kind == Events.EVENT_KIND_JOB_ABORTED:
        return AbortedError(f"job aborted: {event.reason}", event.reason)
    if event.kind == Events.EVENT_KIND_COLLECTIVE_MISMATCH:
        raw = json.loads(event.details_json or "{}")
        return CollectiveMismatchError(event.reason, {int(k): v for k, v in raw.items()})
    return None


def _left_details(event: coordinator_pb2.WatchEvent) -> dict[str, Any]:
    """A MEMBER_LEFT event's details, read once ({} when absent or unreadable: an older coordinator)."""
    try:
        details = json.loads(event.details_json or "{}")
    except ValueError:
        return {}
    return details if isinstance(details, dict) else {}


def _cause(details: dict[str, Any]) -> tuple[list[int], str]:
    """The ranks the departure names as what had failed the departed member's job ([] if none), and
    the departed member's error that said so ("" if not told)."""
    try:
        return [int(rank) for rank in details.get("cause", [])], str(details.get("cause_reason", ""))
    except (ValueError, TypeError):
        return [], ""


def _running(details: dict[str, Any]) -> dict[int, str]:
    """Of the ranks a departed member could not reach, those the coordinator knew to be running on
    another host when it left (rank -> host; see ``member_events.running_across_hosts``)."""
    try:
        return {int(rank): str(host) for rank, host in details.get("running", {}).items()}
    except (ValueError, AttributeError, TypeError):
        return {}


def left_cause(event: coordinator_pb2.WatchEvent) -> tuple[list[int], str]:
    """The ranks a MEMBER_LEFT event names as what had failed the departed member's job ([] if none),
    and the departed member's error that said so ("" if not told)."""
    return _cause(_left_details(event))


def cut_link_error(
    event: coordinator_pb2.WatchEvent, where: str, reason: str, running: dict[int, str], own_host: str | None
) -> RankFailedError:
    """A bystander's error for a member that left because the path to running ranks broke: a rank on
    the departed member's host names the running ranks, one on their host names the departed member
    (the far side, seen from each), one on a third host (or of unknown host) names both."""
    departed = dict(zip(event.ranks, event.hosts or [""] * len(event.ranks), strict=False))
    if own_host is not None and own_host in running.values():
        named = departed
    elif own_host is not None and own_host in departed.values():
        named = running
    else:
        named = {**departed, **running}
    ends = ", ".join(f"{rank} ({host})" for rank, host in sorted(running.items()))
    message = (
        f"rank {where} left the job after its collective failed: {reason or 'not told'}; the coordinator "
        f"still heard from rank {ends} then, so the path between them dropped the traffic (a cut link)"
    )
    ranks = sorted(named)
    return RankFailedError(message, ranks, [named[rank] for rank in ranks], unreachable=True)


def left_progress(event: coordinator_pb2.WatchEvent) -> dict[int, dict[str, int]]:
    """The departed members' final progress carried by a MEMBER_LEFT event (rank -> stream -> seq)."""
    try:
        raw = _left_details(event).get("finished", {})
        return {int(rank): {str(g): int(s) for g, s in streams.items()} for rank, streams in raw.items()}
    except (ValueError, AttributeError, TypeError):
        return {}  # an older coordinator: fall back to failing only direct waits on the departed


class Watcher:
    """Runs the Watch stream in a daemon thread: heartbeats out, job events in.

    A broken stream is retried until ``coordinator_grace`` seconds pass; then (or when a restarted
    coordinator cannot take this member back) the failure state gets a :class:`RendezvousError`.
    After a break the member re-registers before it watches again, so that a coordinator that
    restarted rebuilds the job from its members; meanwhile :class:`CoordinatorLink` holds back the
    member's other coordinator calls. Events are numbered: the stream asks for those after the last
    one received, so a reconnect neither misses nor repeats one.

    The stream runs on a connection of its own that is pinged at the heartbeat pace
    (:meth:`CoordinatorClient.heartbeat_channel`): on a path that died silently (no FIN, no RST) the
    stream would otherwise never break and the grace period never start. Reconnecting waits for the
    coordinator at most until the grace period ends, however long a connection attempt may hang.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        rank: int,
        *,
        host: str | None = None,
        interval: float,
        progress: ProgressTracker,
        failure: FailureState,
        departed: Callable[[list[int], RankFailedError, dict[int, dict[str, int]]], None],
        coordinator_grace: float = 20.0,
        stats: Callable[[], list[common_pb2.CollectiveStats]] = list,
    ) -> None:
        self._client = client
        self._stats = stats  # per-(op, group) running totals for the coordinator's metrics
        self._rank = rank
        self._host = host  # where this rank runs: a cut link is named by its far end from here
        self._interval = interval
        self._progress = progress
        self._failure = failure
        self._departed = departed
        self._grace = coordinator_grace
        self._stopping = threading.Event()
        self._watching = threading.Event()
        self._outbox: queue.Queue[coordinator_pb2.WatchRequest | None] = queue.Queue()
        self._call: Any = None
        self._reconnecting: grpc.Future[None] | None = None
        self._last_event_seq = 0
        self._left: set[int] = set()  # ranks this member was told left the job
        self._thread = threading.Thread(target=self._run, name=f"collsvc-watch-{rank}", daemon=True)

    def start(self, timeout: float) -> None:
        """Starts the stream and waits until the coordinator registered it.

        Raises:
            RendezvousError: the coordinator did not confirm the stream within ``timeout``.
        """
        self._thread.start()
        if not self._watching.wait(timeout):
            error = self._failure.error()
            if isinstance(error, CollsvcError):
                raise error
            raise RendezvousError(f"rank {self._rank}: the coordinator did not confirm the heartbeat stream")

    def _requests(self) -> Iterator[coordinator_pb2.WatchRequest]:
        yield coordinator_pb2.WatchRequest(
            job_id=self._client.job_id,
            rank=self._rank,
            member_secret=self._client.member_secret,
            last_event_seq=self._last_event_seq,
        )
        while not self._stopping.is_set():
            try:
                item = self._outbox.get(timeout=self._interval)  # the heartbeat period
            except queue.Empty:
                item = coordinator_pb2.WatchRequest(progress=self._progress.snapshot(), stats=self._stats())
            if item is None:
                return
            yield item

    def beat_now(self) -> None:
        """Sends progress immediately, not at the next heartbeat."""
        self._outbox.put(coordinator_pb2.WatchRequest(progress=self._progress.snapshot()))

    def _run(self) -> None:
        channel = self._client.heartbeat_channel(self._interval)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        link = self._client.link
        link.watched = True
        deadline: float | None = None  # the end of the grace period while the coordinator is lost
        broke_with = ""  # why the stream broke when the grace period started
        # Whether a stream ever reached the coordinator. The stream's connection is opened ahead of the
        # Join (CoordinatorChannels.connect_ahead): on a cluster still routing the coordinator's address
        # it may have reached a stranger while the Join's reached the coordinator. Such a first stream
        # lost nothing: it is opened again on new connections, within the same grace period, and said
        # at info level rather than as a lost coordinator.
        watched_once = False
        starting = False  # the current grace period began with a stranger before any stream
        while not self._stopping.is_set():
            try:
                if deadline is not None:
                    self._await_coordinator(channel, deadline)
                    self._reregister(stub, deadline, quiet=starting)
                self._call = stub.Watch(self._requests(), metadata=self._client.metadata)
                for event in self._call:
                    if event.kind == Events.EVENT_KIND_WATCHING:
                        deadline, watched_once, starting = None, True, False
                        self._watching.set()
                        link.restored()
                        continue
                    if event.seq and event.seq <= self._last_event_seq:
                        continue  # already handled on an earlier stream
                    self._last_event_seq = max(self._last_event_seq, event.seq)
                    self._handle(event)
                if self._stopping.is_set():
                    return
                raise RendezvousError("the coordinator closed the heartbeat stream")
            except (grpc.RpcError, RendezvousError) as exc:
                if self._stopping.is_set():
                    return
                code = exc.code() if isinstance(exc, grpc.RpcError) else grpc.StatusCode.UNAVAILABLE
                cause = str(error_from_rpc(exc, "heartbeat stream") if isinstance(exc, grpc.RpcError) else exc)
                now = time.monotonic()
                stranger = isinstance(exc, grpc.RpcError) and answered_by_a_stranger(exc)
                if deadline is None:
                    deadline, broke_with = now + self._grace, cause
                    starting = stranger and not watched_once
                    link.lost()
                    log.log(
                        logging.INFO if starting else logging.WARNING,
                        "job %s rank %d: %s (%s); retrying for %gs",
                        self._client.job_id, self._rank,
                        "the heartbeat stream's first connection reached something other than the coordinator"
                        if starting else "lost the coordinator",
                        cause, self._grace,
                    )  # fmt: skip
                retriable = code in _RETRIABLE or stranger
                if not retriable or now >= deadline:
                    if retriable and cause != broke_with:  # the grace period ran out: say what started it
                        cause = f"{broke_with}; {cause}"
                    error = RendezvousError(
                        f"rank {self._rank} lost the coordinator at {self._client.address} "
                        f"(job '{self._client.job_id}'): {cause}"
                    )
                    self._failure.set(error)
                    link.give_up(error)
                    self._watching.set()
                    return
                if stranger:  # this connection reaches something other than the coordinator: a new one
                    channel = self._client.renew_heartbeat_channel(self._interval)
                    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                self._stopping.wait(0.2)  # reconnect backoff while the coordinator may be restarting

    @property
    def interval(self) -> float:
        """Seconds between this member's heartbeats (the job's pace)."""
        return self._interval

    def _handle(self, event: coordinator_pb2.WatchEvent) -> None:
        if event.kind == Events.EVENT_KIND_PROGRESS_WANTED:  # a peer timed out: who started what, now
            self._outbox.put(coordinator_pb2.WatchRequest(progress=self._progress.snapshot(), answers=event.request_id))
            return
        error = event_error(event, self._rank, self._host)
        if event.kind == Events.EVENT_KIND_MEMBER_LEFT and isinstance(error, RankFailedError):
            # A clean leave fails only what still needs the departed rank.
            self._left.update(event.ranks)
            log.info("job %s rank %d: %s", self._client.job_id, self._rank, error)
            self._departed(list(event.ranks), error, left_progress(event))
        elif error is not None:
            log.error("job %s rank %d: %s", self._client.job_id, self._rank, error)
            self._failure.set(error)

    def _reregister(self, stub: coordinator_pb2_grpc.CoordinatorStub, deadline: float, *, quiet: bool) -> None:
        """Re-registers with a coordinator that may have restarted (see :meth:`MemberJournal.reregister`);
        ``quiet``: says so at info level (a first stream that met a stranger, see :meth:`_run`)."""
        client = self._client
        waiting = client.journal.reregister(
            stub,
            client.member_secret,
            left_ranks=self._left,
            last_event_seq=self._last_event_seq,
            timeout=max(min(deadline - time.monotonic(), 10.0), 0.1),
            metadata=client.metadata,
        )
        log.log(
            logging.INFO if quiet else logging.WARNING,
            "job %s rank %d: re-registered with the coordinator at %s%s",
            client.job_id, self._rank, client.address, " (waiting for the other members)" if waiting else "",
        )  # fmt: skip

    def _await_coordinator(self, channel: grpc.Channel, deadline: float) -> None:
        """Waits until the coordinator accepts a connection again, at most until ``deadline``.

        A connection attempt to a host that silently drops packets hangs for gRPC's connect timeout
        (20 s), longer than a short grace period; a stream opened meanwhile would wait for it.

        Raises:
            RendezvousError: ``deadline`` passed, or the watcher is stopping.
        """
        ready = self._reconnecting = grpc.channel_ready_future(channel)
        if self._stopping.is_set():
            ready.cancel()
        try:
            ready.result(timeout=max(deadline - time.monotonic(), 0.0))
        except grpc.FutureTimeoutError:
            raise RendezvousError(f"not reconnected within the {self._grace:g}s grace period") from None
        except grpc.FutureCancelledError:
            raise RendezvousError("stopped while reconnecting to the coordinator") from None
        finally:
            # grpc's ready future can raise from cancel() once its channel is closed (stop() races us).
            with contextlib.suppress(Exception):
                ready.cancel()
            self._reconnecting = None

    def stop(self) -> None:
        self._stopping.set()
        self._client.link.watched = False
        self._outbox.put(None)
        if self._call is not None:
            self._call.cancel()
        reconnecting = self._reconnecting
        if reconnecting is not None:
            with contextlib.suppress(Exception):  # see _await_coordinator
                reconnecting.cancel()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
