"""``collsvc.init`` and the module-level functions that act on the default communicator.

A process holds at most one default communicator. ``init`` called again while it is open returns it
when the arguments name the same job, and raises :class:`RendezvousError` when they name another one
(``destroy`` first), so a library that calls ``init`` defensively never tries to join a job twice.

A process that ends normally without ``destroy`` (its script returns, ``sys.exit``, or Ctrl-C's
``KeyboardInterrupt``) leaves the job at interpreter exit, so the coordinator sees a clean departure.
One that dies of an uncaught exception keeps the old meaning: its heartbeat stream closes without a
leave and the coordinator marks it failed. Ranks of ``collsvc run`` (``COLLSVC_LEAVE_ON_SIGTERM=1``)
also leave when the launcher stops them with SIGTERM.

Both hooks act only in the process that joined. A child forked from it (a DataLoader or pool worker,
``os.fork()``) inherits them: there they do nothing, SIGTERM kills the child by default again, and the
inherited communicator raises :class:`ForkedChildError` (see ``collsvc/client/fork_guard.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from collsvc.client import fork_guard
from collsvc.client.communicator import WORLD, Communicator
from collsvc.client.connect import connect
from collsvc.config import leave_on_sigterm, resolve_init
from collsvc.errors import CollsvcError, RendezvousError
from collsvc.options import InitOptions
from collsvc.types import ReduceOp

log = logging.getLogger(__name__)

_default: Communicator | None = None
_lock = threading.Lock()
_leave_at_exit_registered = False
_ignoring_sigterm = False  # _leave_at_exit set SIGTERM to SIG_IGN


def init(
    coordinator: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    backend: str = "auto",
    timeout: float = 300.0,
    token: str | None = None,
    job_id: str | None = None,
) -> Communicator:
    """Joins a job and returns its world communicator (also the process-wide default).

    Arguments left None come from the environment (see ``collsvc.config``). Called again while the
    default communicator is open, it returns that communicator when the arguments name the same job
    (same coordinator, job id, world size, backend, timeout and token, and no other rank); it never
    joins twice.

    Raises:
        ValueError: no coordinator or world size given or found in the environment, or a bad value;
            under mpirun without a coordinator, ranks on more than one host.
        RendezvousError: this process already joined another job (call ``collsvc.destroy()`` first),
            world-size disagreement, duplicate rank, full job, device clash, or no coordinator within
            ``timeout``.
        AuthenticationError: missing or wrong token, or TLS refused.
        BackendUnavailableError: ``backend="nccl"`` without CuPy or a GPU.
        ForkedChildError: this process was forked from a rank (a DataLoader or pool worker): it cannot
            join a job, nor use the communicator it inherited.
    """
    if coordinator is None:  # under mpirun with no coordinator given, its local rank 0 starts one
        from collsvc._mpirun_coordinator import coordinator_for_mpirun

        found = coordinator_for_mpirun(timeout, token)
        if found is not None:
            coordinator, token = found
    try:
        options = resolve_init(coordinator, world_size, rank, backend, timeout, token, job_id)
    except ValueError:
        # A bare init() from code that runs after the job was joined with explicit arguments, where
        # the environment names no job: it can only mean the joined one.
        bare = (coordinator, world_size, rank, token, job_id) == (None,) * 5 and (backend, timeout) == ("auto", 300.0)
        current = _default
        if bare and current is not None and _is_open(current):
            return current
        raise
    return init_with(options)


def init_with(options: InitOptions) -> Communicator:
    """:func:`init` with options already resolved (``collsvc.config.resolve_init``), for callers that
    adjust one first (the elastic layer bounds a re-form's join by its own timeout).

    Raises:
        The errors of :func:`init`, except the argument checks.
    """
    global _default
    fork_guard.check_member("collsvc.init()")  # before the lock: the parent may have held it at the fork
    with _lock:  # held across the join: two threads calling init at once must not join twice
        if _default is not None and _is_open(_default):
            _check_same_job(_default, options)
            log.info(
                "job %s rank %d: init called again with the same job; returning the existing communicator",
                options.job_id,
                _default.rank,
            )
            return _default
        job = connect(options)
        _default = Communicator(job, WORLD, [m.rank for m in job.members])
        _register_leave_at_exit()
        if leave_on_sigterm():
            _install_sigterm_leave()
        return _default


def _is_open(comm: Communicator) -> bool:
    # A world communicator closed directly (comm.close() rather than destroy()) no longer counts.
    return not comm.closed


def _check_same_job(comm: Communicator, wanted: InitOptions) -> None:
    """Raises RendezvousError naming every argument in which ``wanted`` differs from the joined job."""
    joined = comm.job.options
    differences = [
        f"{name} {getattr(wanted, name)!r} (joined with {getattr(joined, name)!r})"
        for name in ("coordinator", "job_id", "world_size", "backend", "timeout")
        if getattr(wanted, name) != getattr(joined, name)
    ]
    if wanted.token != joined.token:
        differences.append("another token")
    if wanted.rank is not None and wanted.rank != comm.rank:
        differences.append(f"rank {wanted.rank} (joined as rank {comm.rank})")
    if differences:
        raise RendezvousError(
            f"this process already joined job {joined.job_id!r} as rank {comm.rank} of {comm.size} "
            f"at {joined.coordinator}; init was called again with {', '.join(differences)}. "
            "Call collsvc.destroy() before joining another job."
        )


def _register_leave_at_exit() -> None:
    global _leave_at_exit_registered
    if not _leave_at_exit_registered:
        atexit.register(_leave_at_exit)
        _leave_at_exit_registered = True


def _install_sigterm_leave() -> None:
    """Makes SIGTERM leave the job before the process dies of it, where SIGTERM still kills by default.

    ``collsvc run`` stops its ranks with SIGTERM (Ctrl-C, another rank's failure, ``--timeout``); a
    stopped rank then departs cleanly instead of being reported failed by the coordinator. A handler
    the script installed itself is left alone, and only the main thread can install one.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _leave_then_die)


def _leave_then_die(signum: int, frame: FrameType | None) -> None:
    # Only the Leave call (bounded at 5 s), not destroy(), and without the progress snapshot: the
    # interrupted code may hold any of their locks. The coordinator keeps the last heartbeat's progress.
    # Then the signal's default action, so the exit status still says "killed by SIGTERM".
    # A forked child that still has this handler (forked from another thread) dies without leaving.
    signal.signal(signum, signal.SIG_DFL)
    comm = _default
    if comm is not None and _is_open(comm) and not fork_guard.forked_child():
        comm.job.leave_now()
    os.kill(os.getpid(), signum)


def _after_fork_in_child() -> None:
    """A forked child of a rank is killed by SIGTERM as it would be without collsvc: the launcher stops
    a rank's process group with it, and a child that left the job for its rank, or ignored it, outlived
    the job. A child forked from a thread other than the main one cannot change handlers; there
    :func:`_leave_then_die` itself does no more than the default action."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if handler is _leave_then_die or (_ignoring_sigterm and handler is signal.SIG_IGN):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _leave_at_exit() -> None:
    """Leaves the job when the interpreter ends normally with the default communicator still open.

    An uncaught exception other than KeyboardInterrupt is a crash: the process then ends without
    leaving, and the coordinator reports it failed as before (``sys.last_value`` is set by Python
    when it prints an uncaught exception, just before the exit handlers run). A forked child that
    ends (``os.fork()`` then ``sys.exit``) is no member: it leaves nothing.
    """
    global _ignoring_sigterm
    if fork_guard.forked_child():
        return
    if signal.getsignal(signal.SIGTERM) is _leave_then_die:
        # The process is on its way out with its own exit status, which tells the launcher whether
        # this rank failed by itself (sys.exit(1)) or not; a stop requested now must not turn that
        # into "killed by SIGTERM". SIG_IGN, unlike a Python handler, outlives interpreter shutdown.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _ignoring_sigterm = True
    crash = getattr(sys, "last_value", None)
    interactive = hasattr(sys, "ps1")  # an interactive session keeps the last error of any statement
    if crash is not None and not interactive and not isinstance(crash, KeyboardInterrupt):
        return
    try:
        destroy()
    except Exception as exc:  # noqa: BLE001 - an exit handler must not raise; the stream end tells the rest
        log.info("collsvc: leaving the job at exit failed: %s", exc)


def is_initialized() -> bool:
    """Whether ``init`` ran and ``destroy`` has not."""
    return _default is not None


def default_communicator() -> Communicator:
    """The communicator ``init`` made.

    Raises:
        CollsvcError: ``init`` has not been called.
    """
    if _default is None:
        raise CollsvcError("collsvc is not initialized: call collsvc.init() first")
    return _default


def get_rank() -> int:
    """This process's rank in the default communicator."""
    return default_communicator().rank


def get_world_size() -> int:
    """The size of the default communicator."""
    return default_communicator().size


def get_local_rank() -> int:
    """This process's rank among the default communicator's ranks on this host."""
    return default_communicator().local_rank


def destroy() -> None:
    """Closes the default communicator (leaves the job); a later ``init`` may join another job.

    In a forked child it forgets the communicator it inherited and leaves nothing: the rank is the member.
    """
    global _default
    if fork_guard.forked_child():  # the parent may have held the lock at the fork
        comm, _default = _default, None
        if comm is not None:
            comm.close()  # only marks it closed here (Job.close)
        return
    with _lock:
        comm, _default = _default, None
    if comm is not None:
        comm.close()


def all_reduce(
    x: Any, op: ReduceOp = ReduceOp.SUM, *, out: Any = None, async_op: bool = False, compression: str | None = None
) -> Any:
    """:meth:`Communicator.all_reduce` on the default communicator."""
    return default_communicator().all_reduce(x, op, out=out, async_op=async_op, compression=compression)


def reduce(x: Any, dst: int, op: ReduceOp = ReduceOp.SUM, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.reduce` on the default communicator."""
    return default_communicator().reduce(x, dst, op, out=out, async_op=async_op)


def broadcast(x: Any, src: int = 0, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.broadcast` on the default communicator."""
    return default_communicator().broadcast(x, src, out=out, async_op=async_op)


def all_gather(x: Any, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.all_gather` on the default communicator."""
    return default_communicator().all_gather(x, out=out, async_op=async_op)


def reduce_scatter(
    x: Any, op: ReduceOp = ReduceOp.SUM, *, out: Any = None, async_op: bool = False, compression: str | None = None
) -> Any:
    """:meth:`Communicator.reduce_scatter` on the default communicator."""
    return default_communicator().reduce_scatter(x, op, out=out, async_op=async_op, compression=compression)


def gather(x: Any, dst: int, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.gather` on the default communicator."""
    return default_communicator().gather(x, dst, out=out, async_op=async_op)


def scatter(x: Any, src: int, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.scatter` on the default communicator."""
    return default_communicator().scatter(x, src, out=out, async_op=async_op)


def all_to_all(x: Any, *, out: Any = None, async_op: bool = False) -> Any:
    """:meth:`Communicator.all_to_all` on the default communicator."""
    return default_communicator().all_to_all(x, out=out, async_op=async_op)


def send(x: Any, dst: int, tag: int = 0) -> None:
    """:meth:`Communicator.send` on the default communicator."""
    default_communicator().send(x, dst, tag)


def recv(src: int, tag: int = 0, *, out: Any = None, shape: Any = None, dtype: Any = None) -> Any:
    """:meth:`Communicator.recv` on the default communicator."""
    return default_communicator().recv(src, tag, out=out, shape=shape, dtype=dtype)


def barrier(timeout: float | None = None) -> None:
    """:meth:`Communicator.barrier` on the default communicator."""
    default_communicator().barrier(timeout)


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """:meth:`Communicator.broadcast_object` on the default communicator."""
    return default_communicator().broadcast_object(obj, src)


def all_gather_object(obj: Any) -> list[Any]:
    """:meth:`Communicator.all_gather_object` on the default communicator."""
    return default_communicator().all_gather_object(obj)


def new_group(ranks: list[int], name: str | None = None) -> Communicator | None:
    """:meth:`Communicator.new_group` on the default communicator."""
    return default_communicator().new_group(ranks, name)


def find_group(name: str) -> list[int]:
    """:meth:`Communicator.find_group` on the default communicator."""
    return default_communicator().find_group(name)
