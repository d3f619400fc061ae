"""The client side of the coordinator: every control-plane RPC, each with a deadline.

All ``grpc.RpcError`` translation for coordinator calls happens in :meth:`CoordinatorClient._call`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from collsvc.client.coordinator_channel import log_join_wait
from collsvc.client.coordinator_channels import CoordinatorChannels
from collsvc.client.join_relay import RelayedJoin, join_through_relay
from collsvc.client.reconnect import CoordinatorLink, MemberJournal
from collsvc.client.relay_wire import RELAY_ENV
from collsvc.errors import CollectiveTimeoutError, CollsvcError, RendezvousError, error_from_rpc
from collsvc.options import TlsFiles
from collsvc.proto.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)

# Extra seconds the client waits beyond a server-side wait, so the server's answer wins the race.
SERVER_WAIT_MARGIN = 5.0
# How long after its timeout a Join gives up on a coordinator that did not answer (see join).
JOIN_REPLY_MARGIN = 0.6

# How often a member waiting in rendezvous logs which ranks have not joined yet.
JOIN_REPORT_INTERVAL = 10.0


def waiting_from_proto(entries: Any) -> list[dict[str, Any]]:
    return [{"rank": w.rank, "host": w.host, "last_op": w.last_op, "finished_seq": w.finished_seq} for w in entries]


class CoordinatorClient(CoordinatorChannels):
    """Blocking calls to one coordinator for one job.

    Every method raises the collsvc error the coordinator named (see ``collsvc.errors``), or
    :class:`~collsvc.errors.RendezvousError` when the coordinator cannot be reached in time.
    """

    def __init__(
        self,
        address: str,
        job_id: str,
        *,
        token: str | None,
        tls: TlsFiles | None,
        timeout: float,
        join_timeout: float | None = None,
    ) -> None:
        super().__init__(address, job_id, tls, timeout)
        self.created = time.monotonic()  # a join gives up ``join_timeout`` after this (see join)
        self.join_timeout = timeout if join_timeout is None else join_timeout  # waiting for every member
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.rank: int | None = None
        self.member_secret = ""
        self.link = CoordinatorLink()
        self.journal = MemberJournal(job_id)  # what a restarted coordinator needs to hear again
        self._members_reply: coordinator_pb2.GetMembersResponse | None = None  # from the launcher's relay

    def _call(self, method: str, request: Any, what: str, *, timeout: float | None = None, wait: bool = False) -> Any:
        """One coordinator call, sent again while the coordinator restarts (see :meth:`CoordinatorLink.call`)."""
        limit = timeout or self.timeout
        where = f"{what} (coordinator {self.address}, job '{self.job_id}')"

        def send(remaining: float) -> Any:
            stub = self.stub
            with self._renewing_on_strangers(stub, where):
                return getattr(stub, method)(request, timeout=remaining, metadata=self.metadata, wait_for_ready=wait)

        try:
            return self.link.call(send, time.monotonic() + limit, where, self._connected)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, where) from exc

    def join(
        self,
        *,
        world_size: int,
        rank: int | None,
        host: str,
        peer_address: str,
        device: common_pb2.DeviceIdentity,
        pid: int,
        local_rank_hint: int | None,
    ) -> coordinator_pb2.JoinResponse:
        """Joins the job, waiting for the coordinator to come up and for every member to join."""
        request = coordinator_pb2.JoinRequest(
            job_id=self.job_id,
            world_size=world_size,
            host=host,
            peer_address=peer_address,
            device=device,
            pid=pid,
            timeout_s=self.join_timeout,
            idempotency_key=secrets.token_hex(16),
        )
        if rank is not None:
            request.requested_rank = rank
        if local_rank_hint is not None:
            request.local_rank_hint = local_rank_hint
        started = time.monotonic()
        # From when init made this client: a frozen coordinator (connects, never answers) fails the join
        # JOIN_REPLY_MARGIN after the timeout; a live one answers (who is missing) a timeout after receipt.
        deadline = self.created + self.join_timeout + JOIN_REPLY_MARGIN
        self._tls_probe.check(self.address, self.job_id, uses_tls=self.tls is not None, deadline=deadline)
        relayed = self._join_through_launcher(request, world_size, started, deadline)
        if relayed is not None:
            self._members_reply = relayed.members
            return self._joined(relayed.join)
        while True:
            try:
                reply = self._join_once(request, world_size, started, deadline)
                break
            except grpc.RpcError as exc:
                # The connection broke (the coordinator restarted, say): send the same Join again; its
                # idempotency key makes a coordinator that still has it find the same member.
                if self._stranger_answered(exc, deadline, "join"):
                    continue
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise RendezvousError(
                        f"join (coordinator {self.address}, job '{self.job_id}'): no answer from the coordinator "
                        f"within the {self.join_timeout:g}s timeout (not reachable, frozen or overloaded?)"
                    ) from exc
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
                    raise error_from_rpc(exc, f"join (coordinator {self.address}, job '{self.job_id}')") from exc
                log.info("job %s: join interrupted (%s); joining again", self.job_id, exc.code().name)
        self._drop_unconnected_heartbeat_channel()
        return self._joined(reply)

    def _joined(self, reply: coordinator_pb2.JoinResponse) -> coordinator_pb2.JoinResponse:
        self.rank = reply.rank
        self.member_secret = reply.member_secret
        self.journal.joined = reply
        return reply

    def _join_through_launcher(
        self, request: coordinator_pb2.JoinRequest, world_size: int, started: float, deadline: float
    ) -> RelayedJoin | None:
        """Joins through ``collsvc run``'s relay when it names one (see :mod:`collsvc.client.join_relay`);
        None when there is none or it went away (then this rank joins by itself).

        Raises:
            the collsvc error the coordinator answered the launcher's batch with.
        """
        relay = os.environ.get(RELAY_ENV)  # reads the environment itself: collsvc run wrote it for its ranks
        if not relay:
            return None

        def log_wait() -> None:
            self._log_join_wait(world_size, time.monotonic() - started)

        try:
            relayed = join_through_relay(relay, request, deadline, log_wait, JOIN_REPORT_INTERVAL)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"join (coordinator {self.address}, job '{self.job_id}')") from exc
        if relayed is None:
            log.info("job %s: the launcher's join relay did not answer; joining by itself", self.job_id)
        return relayed

    def _join_once(
        self, request: coordinator_pb2.JoinRequest, world_size: int, started: float, deadline: float
    ) -> coordinator_pb2.JoinResponse:
        future = self.stub.Join.future(
            request, timeout=max(deadline - time.monotonic(), 0.01), metadata=self.metadata, wait_for_ready=True
        )
        try:
            while True:
                try:
                    return future.result(timeout=JOIN_REPORT_INTERVAL)  # type: ignore[no-any-return]
                except grpc.FutureTimeoutError:
                    self._log_join_wait(world_size, time.monotonic() - started, deadline)
        except BaseException:
            future.cancel()
            raise

    def _log_join_wait(self, world_size: int, waited: float, deadline: float | None = None) -> None:
        """Logs, while Join waits, which ranks have not joined (see :func:`log_join_wait`)."""
        log_join_wait(self.stub, self.address, self.job_id, self.metadata, world_size, waited, deadline, self.timeout)

    def members(self) -> list[common_pb2.Member]:
        """The member table of the joined job (the one the launcher fetched with the join, if it did)."""
        reply, self._members_reply = self._members_reply, None
        if reply is None:
            reply = self._call("GetMembers", coordinator_pb2.GetMembersRequest(job_id=self.job_id), "get members")
        for member in reply.members:
            if member.rank == self.rank:
                self.journal.own_record = member
        return list(reply.members)

    def barrier(self, group: str, rank: int, generation: int, timeout: float, on_behalf_of: Sequence[int] = ()) -> None:
        """Waits until every member of ``group`` entered barrier ``generation``; arrives for the members
        ``on_behalf_of`` too (members of this host that passed a barrier with this one).

        Raises:
            CollectiveTimeoutError: ``timeout`` passed; ``waiting_on`` names who never arrived.
        """
        request = coordinator_pb2.BarrierRequest(
            job_id=self.job_id,
            group=group,
            rank=rank,
            generation=generation,
            timeout_s=timeout,
            member_secret=self.member_secret,
            on_behalf_of=on_behalf_of,
        )
        reply = self._call(
            "Barrier",
            request,
            f"barrier #{generation} of group '{group}'",
            timeout=timeout + SERVER_WAIT_MARGIN,
        )
        if reply.complete:
            self.journal.barrier_done(group, generation)
        else:
            waiting = waiting_from_proto(reply.waiting_on)
            ranks = [w["rank"] for w in waiting]
            raise CollectiveTimeoutError(
                f"barrier #{generation} of group '{group}' timed out after {timeout:g}s on rank {rank}; "
                f"waiting on ranks {ranks}",
                waiting,
            )

    def progress(self, group: str, seq: int, fresh_within: float = 0.0) -> list[dict[str, Any]]:
        """Members of ``group`` that have not started call ``seq``, with their last completed op. With
        ``fresh_within``, the coordinator first asks those that look late for their progress now and
        waits up to that long for the answers. Asked once, never waiting for a lost coordinator (it
        only makes an error more precise).

        Raises:
            RendezvousError: the coordinator is lost now, or did not answer.
            CollsvcError / ValueError: the coordinator's error.
        """
        where, limit = f"get progress (coordinator {self.address}, job '{self.job_id}')", min(self.timeout, 5.0)
        if not self.link.up:
            raise RendezvousError(f"{where}: the coordinator is unreachable now")
        request = coordinator_pb2.GetProgressRequest(job_id=self.job_id, group=group, seq=seq)
        request.fresh_within_s = fresh_within
        try:
            reply = self.stub.GetProgress(request, timeout=limit + fresh_within, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, where) from exc
        return waiting_from_proto(reply.not_started)

    def set(self, key: str, value: bytes) -> None:
        self._call(
            "SetKey",
            coordinator_pb2.SetKeyRequest(job_id=self.job_id, key=key, value=value),
            f"set key {key!r}",
        )
        self.journal.wrote(key, bytes(value))

    def get(self, key: str, timeout: float) -> bytes:
        """Waits up to ``timeout`` for ``key``.

        Raises:
            CollectiveTimeoutError: the key was not set in time.
        """
        request = coordinator_pb2.GetKeyRequest(job_id=self.job_id, key=key, wait=True, timeout_s=timeout)
        reply = self._call("GetKey", request, f"get key {key!r}", timeout=timeout + SERVER_WAIT_MARGIN)
        if not reply.found:
            raise CollectiveTimeoutError(f"key {key!r} was not set within {timeout:g}s")
        return bytes(reply.value)

    def lookup(self, key: str, timeout: float) -> bytes | None:
        """``key``'s value now, or None when it is not set (no waiting for it to be set); waits up to
        ``timeout`` for the coordinator itself to answer (it may still be starting).

        Raises:
            RendezvousError: the coordinator did not answer in time.
        """
        request = coordinator_pb2.GetKeyRequest(job_id=self.job_id, key=key, wait=False)
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply = self._call("GetKey", request, f"look up key {key!r}", timeout=timeout, wait=True)
                return bytes(reply.value) if reply.found else None
            except CollsvcError as exc:
                cause = exc.__cause__
                if not (isinstance(cause, grpc.RpcError) and self._stranger_answered(cause, deadline, "lookup")):
                    raise
                timeout = max(deadline - time.monotonic(), 0.01)

    def add(self, key: str, amount: int) -> int:
        reply = self._call(
            "AddKey",
            coordinator_pb2.AddKeyRequest(job_id=self.job_id, key=key, amount=amount),
            f"add {key!r}",
        )
        self.journal.wrote(key, str(reply.value).encode("ascii"))
        return int(reply.value)

    def compare_set(self, key: str, desired: bytes) -> bytes:
        """Stores ``desired`` under ``key`` unless something is there; returns what is stored then."""
        request = coordinator_pb2.CompareSetKeyRequest(job_id=self.job_id, key=key, expect_absent=True, desired=desired)
        reply = self._call("CompareSetKey", request, f"compare-and-set key {key!r}")
        return bytes(reply.value)

    def new_group(self, name: str, ranks: list[int]) -> None:
        self._call(
            "NewGroup",
            coordinator_pb2.NewGroupRequest(job_id=self.job_id, name=name, ranks=ranks),
            f"new group {name!r}",
        )
        self.journal.registered_group(name, ranks)

    def find_group(self, name: str) -> list[int]:
        reply = self._call(
            "FindGroup",
            coordinator_pb2.FindGroupRequest(job_id=self.job_id, name=name),
            f"find group {name!r}",
        )
        return list(reply.ranks) if reply.found else []

    def report(
        self, kind: int, reason: str, details: dict[str, Any] | None = None, ranks: list[int] | None = None
    ) -> None:
        """Tells the coordinator about a failure so that it reaches every member (best effort, short deadline)."""
        request = coordinator_pb2.ReportFailureRequest(
            job_id=self.job_id,
            rank=self.rank if self.rank is not None else -1,
            member_secret=self.member_secret,
            kind=kind,  # type: ignore[arg-type]
            reason=reason,
            details_json=json.dumps(details or {}),
            ranks=ranks or [],
        )
        try:
            self._call("ReportFailure", request, "report failure", timeout=min(self.timeout, 5.0))
        except Exception as exc:  # noqa: BLE001 - reporting must never mask the error being reported
            log.warning("job %s rank %s: could not report failure to the coordinator: %s", self.job_id, self.rank, exc)

    def leave(
        self,
        progress: Iterable[common_pb2.Progress] = (),
        cause: Iterable[int] = (),
        reason: str = "",
        *,
        unreachable: bool = False,
        within: float = 5.0,
    ) -> None:
        """Leaves the job cleanly (best effort, at most ``within`` seconds), telling the coordinator
        the final ``progress`` so the others fail at once whatever call this member never finished,
        and the ranks whose failure failed this member's job (``cause``) with the error that said so
        (``reason``), so the others name them; ``unreachable``: a delivery to them failed (the
        coordinator then says which of them it still hears from).

        A Leave not answered in time is cancelled, and the heartbeat stream that closes next then
        reads to the coordinator as a member that died: ``within`` should be as long as the
        coordinator waits for a silent member (the job's heartbeat pace), which a crowded host needs."""
        if self.rank is None:
            return
        request = coordinator_pb2.LeaveRequest(
            job_id=self.job_id,
            rank=self.rank,
            member_secret=self.member_secret,
            progress=list(progress),
            cause_ranks=list(cause),
            cause_reason=reason,
            cause_unreachable=unreachable,
        )
        deadline = time.monotonic() + min(self.timeout, within)
        try:
            self._call("Leave", request, "leave", timeout=max(deadline - time.monotonic(), 0.1))
        except Exception as exc:  # noqa: BLE001 - leaving is best effort; the coordinator also sees the stream end
            log.info("job %s rank %s: leave was not acknowledged: %s", self.job_id, self.rank, exc)
