"""Processes forked from a rank: gRPC kept out of their way, and none of them speaking for the rank.

A training script forks all the time: torch's DataLoader workers, ``multiprocessing`` pools and
``ProcessPoolExecutor`` workers start with ``fork()`` on Linux. Two things went wrong in those children:

- **gRPC's fork handlers.** A rank always has gRPC calls in flight on background threads (the heartbeat
  stream, the peer server). grpcio is built with gRPC's fork support on; its ``pthread_atfork`` handlers
  then refuse to run ("Other threads are currently calling into gRPC, skipping fork() handlers"), and
  what its polling engine does around the fork left children aborting or crashing at random (a DataLoader
  worker "killed by signal: Aborted" in 7 of 12 runs; docs/operations.md, section 10). Those handlers
  only help a child that goes on using gRPC, which a rank's child cannot do anyway (see below). So
  :func:`keep_grpc_fork_handlers_off`, run by ``import collsvc`` before anything loads gRPC, sets
  ``GRPC_ENABLE_FORK_SUPPORT=false`` unless the environment sets it: gRPC then registers no fork
  handlers, its threads simply do not exist in the child, and a child that never calls gRPC runs as it
  would without collsvc (0 failures in the runs of docs/operations.md). gRPC reads the variable once,
  when it loads: a process that imported gRPC before collsvc keeps gRPC's default, and is warned when it
  joins a job (:func:`warn_if_grpc_forks`).
- **The rank's hooks.** A child inherits the rank's objects and hooks: leaving the job at exit, the
  SIGTERM handler of ``collsvc run``'s ranks, the failure report. They left the job with the rank's
  credentials, blamed the rank for the child's exit, or hung in gRPC while ignoring SIGTERM. Only the
  process that joined (:func:`note_member`) acts for its rank now; each hook asks :func:`forked_child`
  first, and a child's call on the inherited communicator raises :class:`ForkedChildError`
  (:func:`child_error`).

gRPC's copy in the child is inconsistent (its threads are gone, their locks may be held), so a forked
child can use neither the inherited communicator nor a new one: a process that must join a job is
started with ``spawn``.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

if TYPE_CHECKING:  # collsvc.errors loads gRPC: imported where an error is made, after the setting
    from collsvc.errors import ForkedChildError

log = logging.getLogger(__name__)

FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
_GRPC_CORE_MODULE = "grpc._cython.cygrpc"  # loading it initializes gRPC and reads its settings

_TRUE = ("1", "t", "true", "y", "yes", "on")

_member_pid = 0  # the process that joined a job (0: none did)
_grpc_forks = False  # gRPC's fork handlers may be on in this process (see keep_grpc_fork_handlers_off)


def keep_grpc_fork_handlers_off() -> None:
    """Turns gRPC's fork handlers off (``GRPC_ENABLE_FORK_SUPPORT=false``) unless the environment says
    otherwise; takes effect only when gRPC is not loaded yet. Child processes inherit the setting."""
    global _grpc_forks
    loaded = _GRPC_CORE_MODULE in sys.modules  # gRPC read its settings already
    _grpc_forks = loaded or os.environ.get(FORK_SUPPORT_ENV, "false").strip().lower() in _TRUE
    os.environ.setdefault(FORK_SUPPORT_ENV, "false")


def grpc_forks() -> bool:
    """Whether gRPC's fork handlers may be on in this process: gRPC was loaded before collsvc, or the
    environment turned them on when collsvc was imported (what gRPC read when it loaded)."""
    return _grpc_forks


def warn_if_grpc_forks(job_id: str, rank: int) -> None:
    """Logs a warning when gRPC's fork handlers may be on, once this process joined a job."""
    if grpc_forks():
        log.warning(
            "job %s rank %d: gRPC's fork handlers are on (gRPC was imported before collsvc, or %s is set): "
            "processes forked from this rank (DataLoader workers, multiprocessing pools) may crash in gRPC; "
            "import collsvc first, or set %s=false (docs/operations.md, section 10)",
            job_id, rank, FORK_SUPPORT_ENV, FORK_SUPPORT_ENV,
        )  # fmt: skip


def note_member() -> None:
    """Records this process as the one that joined: its forked children are not members."""
    global _member_pid
    _member_pid = os.getpid()


def forked_child() -> bool:
    """Whether this process was forked from one that joined a job (and so speaks for no rank)."""
    return _member_pid != 0 and os.getpid() != _member_pid


def child_error(what: str) -> ForkedChildError:
    """The error of a forked child that tried ``what`` (``"all_reduce"``, ``"collsvc.init()"``)."""
    from collsvc.errors import ForkedChildError

    return ForkedChildError(
        f"{what} in process {os.getpid()}, forked from rank process {_member_pid}: a forked child "
        "(a DataLoader or pool worker, os.fork()) is not a member of the job and cannot use the communicator "
        "it inherited, nor gRPC; run collectives in the rank's process, or start a process that must join "
        "a job with the spawn start method"
    )


def check_member(what: str) -> None:
    """Raises :class:`ForkedChildError` in a forked child (see :func:`child_error`).

    Raises:
        ForkedChildError: this process is a forked child of a member.
    """
    if forked_child():
        raise child_error(what)


class Member(Protocol):
    """What this process holds for a joined job (``client/job.py``'s ``Job``)."""

    def forked(self) -> None:
        """Called in each forked child: makes the job unusable there."""


_members: weakref.WeakSet[Member] = weakref.WeakSet()


def track(member: Member) -> None:
    """Has ``member.forked()`` called in every child forked from this process from now on."""
    _members.add(member)


def _after_fork_in_child() -> None:
    for member in list(_members):
        member.forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ChildClient:
    """Stands for a member's coordinator client in a forked child: every call raises ``error``, the
    child's :class:`ForkedChildError`, and nothing is sent (the child's copy of gRPC is unusable)."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def __getattr__(self, name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> NoReturn:
            raise self._error

        return refuse
