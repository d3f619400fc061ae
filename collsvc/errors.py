"""The collsvc error tree, and the one table that maps it to and from gRPC.

Every error a user can catch subclasses :class:`CollsvcError`. Bad arguments caught locally, before
anything is sent, raise the built-in :class:`ValueError` or :class:`TypeError` instead::

    CollsvcError
    ├── JobBrokenError              the job cannot go on as it is (catch this to re-form or restart)
    │   ├── RankFailedError         a member died, froze or left while others still needed it
    │   ├── CollectiveMismatchError members called different collectives at the same step
    │   ├── AbortedError            a member aborted the job
    │   └── JobEndedError           the coordinator no longer has the job: it ended (says why, and who)
    ├── CollectiveTimeoutError      a collective or barrier outlived its timeout (names who is missing)
    ├── RendezvousError             joining failed, or the coordinator was lost past its grace period
    ├── AuthenticationError         missing or wrong token, or TLS refused
    ├── BackendUnavailableError     the requested backend cannot run here (says how to fix it)
    ├── ResourceLimitError          a request exceeded a configured size limit
    └── ForkedChildError            a process forked from a rank used the rank's job (it is no member)

Callers catch by meaning: ``except JobBrokenError`` for "this job is over, heal or restart",
``except CollectiveTimeoutError`` for "too slow or stuck", ``except CollsvcError`` for anything of
ours. Messages say what happened and which rank; the attributes carry the same facts for code.

The coordinator and peer servers put an :class:`ErrorReason` name in the ``collsvc-error-reason``
trailing metadata of every failed call; :func:`error_from_rpc` turns a ``grpc.RpcError`` back into the
matching exception, chained with ``raise ... from``. That function is the only place client code
translates gRPC errors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from collsvc.proto.v1 import common_pb2

REASON_METADATA_KEY = "collsvc-error-reason"
DETAILS_METADATA_KEY = "collsvc-error-details"


class CollsvcError(Exception):
    """Base of every collsvc error."""


class JobBrokenError(CollsvcError):
    """The job cannot go on as it is: a member failed or left, members disagreed on a call, or the job
    was aborted. Every later collective of the affected groups raises too. An elastic job re-forms on
    it; any other job ends (its processes may join a new job on the same coordinator)."""


class RankFailedError(JobBrokenError):
    """A member of the job died, froze or left while others still needed it.

    Raised on every surviving rank, for the pending collective and every later one.

    Attributes:
        ranks: the global ranks that failed or left.
        hosts: the hosts those ranks ran on (same order as ``ranks``; "" where unknown).
        unreachable: True when ``ranks`` were out of reach rather than reported dead: a delivery to
            them failed (this rank's own, or, for a member that left after one, that member's).
            They may be dead, or running behind a path that dropped the traffic (the message says
            which, when the coordinator knew them to be running).
    """

    def __init__(
        self, message: str, ranks: Sequence[int] = (), hosts: Sequence[str] = (), *, unreachable: bool = False
    ) -> None:
        super().__init__(message)
        self.ranks: list[int] = list(ranks)
        self.hosts: list[str] = list(hosts)
        self.unreachable = unreachable


class CollectiveTimeoutError(CollsvcError):
    """A collective or barrier did not complete within its timeout.

    Attributes:
        waiting_on: one dict per rank that never entered the collective, with keys ``rank``,
            ``host``, ``last_op`` (its last completed operation) and ``finished_seq``.
    """

    def __init__(self, message: str, waiting_on: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(message)
        self.waiting_on: list[dict[str, Any]] = [dict(w) for w in waiting_on]

    @property
    def ranks(self) -> list[int]:
        """The ranks in ``waiting_on``."""
        return [int(w["rank"]) for w in self.waiting_on]


def describe_waiting(waiting: Sequence[Mapping[str, Any]]) -> str:
    """``waiting_on`` as timeout messages name it: "rank 2 (node-c; last completed: all_reduce(...))"."""
    named = ", ".join(
        f"{w['rank']} ({w.get('host', '')}; last completed: {w.get('last_op') or 'none'})" for w in waiting
    )
    return f"rank{'s' if len(waiting) > 1 else ''} {named}"


class CollectiveMismatchError(JobBrokenError):
    """Ranks called different collectives, ops, dtypes, shapes or roots at the same step.

    Raised on every rank of the group before any data moves.

    Attributes:
        details: maps each rank whose call is known to a description of its call
            (``{"op": ..., "dtype": ..., "shape": ..., "root": ..., "reduce_op": ...}``).
    """

    def __init__(self, message: str, details: Mapping[int, Any] | None = None) -> None:
        super().__init__(message)
        self.details: dict[int, Any] = dict(details or {})


class AuthenticationError(CollsvcError):
    """The token was missing or wrong, or TLS was refused."""


class RendezvousError(CollsvcError):
    """Joining failed: world sizes disagree, a rank is taken twice, the job is full, devices clash,
    or the coordinator was unreachable past the timeout."""


class AbortedError(JobBrokenError):
    """The job was aborted (``Communicator.abort``); carries the reason.

    Attributes:
        reason: the text given to ``abort``.
    """

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class JobEndedError(JobBrokenError):
    """The coordinator no longer has this member's job: it ended while this member still used it
    (every member failed or left, e.g. this one was declared failed meanwhile), so it was forgotten.

    Attributes:
        reason: why the job ended, as the coordinator recorded it ("" when it no longer knows).
        ranks: the ranks that caused it, where known (the failed ranks; [] otherwise).
    """

    def __init__(self, message: str, reason: str = "", ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.reason = reason
        self.ranks = list(ranks)


class BackendUnavailableError(CollsvcError):
    """The requested backend cannot run here (for NCCL: no CuPy or no GPU); the message says how to fix it."""


class ResourceLimitError(CollsvcError):
    """A request exceeded a configured size limit (key, value, message or world size)."""


class ForkedChildError(CollsvcError):
    """A process forked from a rank (a DataLoader worker, a pool worker, ``os.fork()``) called a
    collective or a coordinator call on the communicator it inherited, or ``init``.

    The child holds a copy of the rank's objects but is no member of the job: only the process that
    joined speaks for its rank, and gRPC cannot be used in a forked copy of a process that runs it.
    Start a process that must join a job with the ``spawn`` start method.
    """


Reason = common_pb2.ErrorReason

# The one table: reason <-> exception type <-> gRPC status code.
_TABLE: tuple[tuple[int, type[CollsvcError], grpc.StatusCode], ...] = (
    (Reason.ERROR_REASON_RANK_FAILED, RankFailedError, grpc.StatusCode.UNAVAILABLE),
    (Reason.ERROR_REASON_COLLECTIVE_TIMEOUT, CollectiveTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Reason.ERROR_REASON_COLLECTIVE_MISMATCH, CollectiveMismatchError, grpc.StatusCode.FAILED_PRECONDITION),
    (Reason.ERROR_REASON_AUTHENTICATION, AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (Reason.ERROR_REASON_RENDEZVOUS, RendezvousError, grpc.StatusCode.FAILED_PRECONDITION),
    (Reason.ERROR_REASON_ABORTED, AbortedError, grpc.StatusCode.ABORTED),
    (Reason.ERROR_REASON_RESOURCE_EXHAUSTED, ResourceLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)

_BY_REASON = {reason: (exc, code) for reason, exc, code in _TABLE}
_BY_TYPE = {exc: (reason, code) for reason, exc, code in _TABLE}


def status_for(reason: int) -> grpc.StatusCode:
    """The gRPC status code the servers use for ``reason`` (INVALID_ARGUMENT and NOT_FOUND included)."""
    if reason == Reason.ERROR_REASON_INVALID_ARGUMENT:
        return grpc.StatusCode.INVALID_ARGUMENT
    if reason == Reason.ERROR_REASON_NOT_FOUND:
        return grpc.StatusCode.NOT_FOUND
    return _BY_REASON.get(reason, (CollsvcError, grpc.StatusCode.UNKNOWN))[1]


def reason_for(error: CollsvcError) -> int:
    """The :class:`ErrorReason` value that stands for ``error`` on the wire (a :class:`JobEndedError`
    travels as NOT_FOUND with its reason in the details)."""
    if isinstance(error, JobEndedError):
        return Reason.ERROR_REASON_NOT_FOUND
    for cls in type(error).__mro__:
        if cls in _BY_TYPE:
            return _BY_TYPE[cls][0]
    return Reason.ERROR_REASON_UNSPECIFIED


def error_details(error: CollsvcError) -> dict[str, Any]:
    """The structured attributes of ``error`` as a JSON-able dict (sent in trailing metadata)."""
    if isinstance(error, RankFailedError):
        return {"ranks": error.ranks, "hosts": error.hosts}
    if isinstance(error, CollectiveTimeoutError):
        return {"waiting_on": error.waiting_on}
    if isinstance(error, CollectiveMismatchError):
        return {"details": {str(k): v for k, v in error.details.items()}}
    if isinstance(error, AbortedError):
        return {"reason": error.reason}
    if isinstance(error, JobEndedError):
        return {"ended": error.reason, "ranks": error.ranks}
    return {}


def build_error(reason: int, message: str, details: Mapping[str, Any] | None = None) -> CollsvcError:
    """Builds the exception for a wire ``reason`` with its structured ``details``."""
    details = details or {}
    cls = _BY_REASON.get(reason, (CollsvcError, grpc.StatusCode.UNKNOWN))[0]
    if cls is RankFailedError:
        return RankFailedError(message, details.get("ranks", ()), details.get("hosts", ()))
    if cls is CollectiveTimeoutError:
        return CollectiveTimeoutError(message, details.get("waiting_on", ()))
    if cls is CollectiveMismatchError:
        raw = details.get("details", {})
        return CollectiveMismatchError(message, {int(k): v for k, v in raw.items()})
    if cls is AbortedError:
        return AbortedError(message, str(details.get("reason", "")))
    return cls(message)


def error_from_rpc(exc: grpc.RpcError, what: str) -> CollsvcError | ValueError:
    """Translates a failed gRPC call into the matching collsvc error.

    Args:
        exc: the error raised by a gRPC stub call.
        what: a short description of the call for the message, e.g. "join job 'default'".

    Returns:
        The exception to raise (the caller chains it with ``from exc``). INVALID_ARGUMENT and
        NOT_FOUND replies become ``ValueError``, except a NOT_FOUND for a job that ended, which becomes
        :class:`JobEndedError`; transport failures become :class:`RendezvousError`.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    trailing: tuple[Any, ...] = ()
    if hasattr(exc, "trailing_metadata"):
        trailing = tuple(exc.trailing_metadata() or ())
    meta = {k: v for k, v in trailing}
    reason_name = meta.get(REASON_METADATA_KEY)
    message = f"{what}: {detail}"
    if reason_name:
        reason = Reason.Value(reason_name) if reason_name in Reason.keys() else 0  # noqa: SIM118 - protobuf enum wrapper
        raw = meta.get(DETAILS_METADATA_KEY, "")
        details = json.loads(raw) if raw else {}
        if reason == Reason.ERROR_REASON_NOT_FOUND and isinstance(details, dict) and "ended" in details:
            return JobEndedError(message, str(details["ended"]), [int(r) for r in details.get("ranks", [])])
        if reason in (Reason.ERROR_REASON_INVALID_ARGUMENT, Reason.ERROR_REASON_NOT_FOUND):
            return ValueError(message)
        return build_error(reason, message, details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceLimitError(message)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(message)
    if code == grpc.StatusCode.UNAVAILABLE and "handshake" in (detail or "").lower():
        # gRPC reports a failed TLS handshake (untrusted certificate, TLS against a plaintext port) as
        # UNAVAILABLE, like an unreachable server; its details text is the only way to tell them apart.
        return AuthenticationError(f"{what}: TLS handshake failed: {detail}")
    return RendezvousError(f"{what}: coordinator unreachable or failed ({code.name}): {detail}")


__all__ = [
    "AbortedError",
    "AuthenticationError",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CollsvcError",
    "JobEndedError",
    "RankFailedError",
    "RendezvousError",
    "ResourceLimitError",
    "build_error",
    "error_details",
    "error_from_rpc",
    "reason_for",
    "status_for",
]
