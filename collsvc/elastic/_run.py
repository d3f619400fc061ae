"""``collsvc.elastic.run``: call a training function again, on a new membership, after a member fails."""

from __future__ import annotations

import functools
import logging
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

from collsvc.client.communicator import Communicator
from collsvc.elastic.membership import Membership
from collsvc.elastic.state import State
from collsvc.errors import CollectiveTimeoutError, RankFailedError

log = logging.getLogger(__name__)

Result = TypeVar("Result")

# Errors after which the survivors re-form: a member died or left, or stalled past the timeout (a
# stalled member is left out; when it wakes up it finds itself outside and waits to be admitted again).
_MEMBER_LOST = (RankFailedError, CollectiveTimeoutError)


def gone_for_good(departed: Mapping[int, RankFailedError]) -> set[int]:
    """Of the members that left this generation cleanly (``comm.job.departed``), those that left of
    their own accord (finished or quit). Those that left because it failed (their departure names the
    ranks at fault, not themselves) are survivors on their way to the re-form: they must be waited
    for, not planned without."""
    return {rank for rank, error in departed.items() if rank in error.ranks}


def _member_lost(error: BaseException, comm: Communicator) -> RankFailedError | CollectiveTimeoutError | None:
    """The lost-member error behind ``error``, or None when ``error`` is about something else.

    Frameworks may wrap the collective's error (DDP's backward raises a RuntimeError carrying only its
    text), so the error's chain is searched, then the failure this process recorded for the job.
    """
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, _MEMBER_LOST):
            return seen
        seen = seen.__cause__ or seen.__context__
    recorded = comm.job.failure
    if isinstance(recorded, _MEMBER_LOST):
        return recorded
    return None


class _NewcomersWaiting(Exception):  # noqa: N818 - control flow inside run(), never seen by users
    """Raised from ``State.commit()`` when every member agreed to admit waiting newcomers."""


def run(train: Callable[..., Result]) -> Callable[..., Result]:
    """Makes ``train(comm, state, ...)`` survive members failing and take in new ones.

    The decorated function is called as ``train(state, ...)``. It calls ``train(comm, state, ...)`` with
    the current communicator (first the one ``collsvc.init()`` made, after the state was broadcast from
    rank 0). When a member fails, every survivor's pending collective raises; the survivors then go back
    to the last ``state.commit()``, re-form with ranks renumbered 0..n-1 in the old order (plus admitted
    newcomers), receive the state from the lowest surviving old rank, and call ``train`` again with the
    new communicator (also the new default one). Newcomers waiting to join are admitted at the next
    ``state.commit()`` without a rollback. Communicators made from an earlier membership (sub-groups
    included) are closed; build sub-groups inside ``train``.

    ``train`` returning on every member of a membership ends the job: the decorated function returns
    its value. A newcomer (a replacement ``collsvc run --max-restarts`` started) that the job did not
    admit before it finished writes one line to stderr and exits with status 0 (``SystemExit(0)``):
    the script does not run past the decorated function.

    Args:
        train: the training function, ``train(comm, state, *args, **kwargs)``.

    Returns:
        The decorated function ``(state, *args, **kwargs) -> train's return value``.

    Raises:
        CollsvcError: from the decorated function, when ``collsvc.init()`` was not called (also under
            ``COLLSVC_ELASTIC_JOIN``: a newcomer joins a stand-in job first), or any error that is not a
            lost member (a mismatch, an abort).
        RendezvousError: no new membership formed within the job's timeout, or every member holding
            the state failed.
        SystemExit: (status 0) on a newcomer whose job finished before admitting it.
    """

    @functools.wraps(train)
    def elastic_train(state: State, *args: Any, **kwargs: Any) -> Result:
        if not isinstance(state, State):
            raise TypeError(f"the first argument must be a collsvc.elastic.State, got {type(state).__name__}")
        membership, comm = Membership.start()
        while comm is not None:
            try:
                result = _one_membership(train, comm, state, membership, args, kwargs)
            except _NewcomersWaiting:
                log.info("job %s: admitting newcomers at commit", membership.base)
                failed: set[int] = set()
            except Exception as exc:
                lost = _member_lost(exc, comm)
                if lost is None:
                    raise
                failed = set(lost.ranks) | gone_for_good(comm.job.departed)
                log.warning("job %s generation %d: %s; re-forming", membership.base, membership.generation, lost)
                _release_frames(exc)
            else:
                membership.finish(comm)
                return result
            finally:
                object.__setattr__(state, "_on_commit", None)
            state.restore()
            comm = membership.reform(failed)
        _end_late_newcomer(membership.base)

    return elastic_train


def _release_frames(error: BaseException) -> None:
    """Drops the local variables of the finished frames ``error`` (and the errors it chains) passed
    through: the failed membership's objects (a DistributedDataParallel wrapper and its gradient hooks,
    buffers) are freed now, not whenever the error is, which a process group's pending work or the job's
    first failure may keep alive. A stale DDP wrapper would still answer the parameters' gradient hooks
    in the next membership."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def _end_late_newcomer(job: str) -> NoReturn:
    """Ends a newcomer whose job finished before admitting it: one line, exit status 0. Returning None
    would run the script past its training function on a communicator it never had."""
    sys.stderr.write(f"collsvc.elastic: job {job!r} had finished before this process was admitted; exiting\n")
    sys.stderr.flush()
    raise SystemExit(0)


def _one_membership(
    train: Callable[..., Result],
    comm: Communicator,
    state: State,
    membership: Membership,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Result:
    """Runs ``train`` on one membership: state broadcast first, a barrier after it returns."""
    state.broadcast(comm, membership.state_source)
    membership.has_state = True
    comm.barrier()  # nobody trains (or fails) before every member holds the state

    def check_newcomers() -> None:
        if membership.newcomers_waiting(comm):
            raise _NewcomersWaiting

    object.__setattr__(state, "_on_commit", check_newcomers)
    result = train(comm, state, *args, **kwargs)
    comm.barrier()  # returning counts once every member returned; a failure before that re-forms
    return result
