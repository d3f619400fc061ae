"""A job's lifecycle: one explicit phase, changed only by the named transitions in one table.

::

    JOINING ──complete──► RUNNING ──fail──► FAILED ──abort──► ABORTED
       ▲                    ▲  │                                 ▲
       │                    │  └────────────abort────────────────┘
    (first join)   recovered│
                            │
    RECOVERING ─────────────┘   (a restarted coordinator rebuilds the job from its members)

A job is created JOINING by its first join, or RECOVERING when a member of a running job re-registers
with a coordinator that restarted. Every change of phase goes through :meth:`Lifecycle.apply`, so the
table below is the whole story; a transition the table does not name is a bug in the caller and
raises. Elastic re-forming will add its transitions here.
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger(__name__)


class JobPhase(enum.Enum):
    """Where a job is in its life (the value is what ``collsvc status`` shows)."""

    JOINING = "joining"  # members are arriving; no ranks yet
    RUNNING = "running"  # every member joined and has its rank
    RECOVERING = "recovering"  # rebuilt after a coordinator restart; members are re-registering
    FAILED = "failed"  # a member failed or members called mismatched collectives
    ABORTED = "aborted"  # a member aborted the job


class JobAction(enum.Enum):
    """The named transitions."""

    COMPLETE = "complete"  # the last member joined: ranks assigned
    RECOVERED = "recovered"  # every member re-registered, or the recovery window closed
    FAIL = "fail"  # a member failed, or a mismatch was reported
    ABORT = "abort"  # a member aborted the job


# (phase, action) -> next phase. A pair not listed is not allowed.
TRANSITIONS: dict[tuple[JobPhase, JobAction], JobPhase] = {
    (JobPhase.JOINING, JobAction.COMPLETE): JobPhase.RUNNING,
    (JobPhase.JOINING, JobAction.ABORT): JobPhase.ABORTED,
    (JobPhase.RECOVERING, JobAction.RECOVERED): JobPhase.RUNNING,
    (JobPhase.RUNNING, JobAction.FAIL): JobPhase.FAILED,
    (JobPhase.RUNNING, JobAction.ABORT): JobPhase.ABORTED,
    (JobPhase.FAILED, JobAction.FAIL): JobPhase.FAILED,
    (JobPhase.FAILED, JobAction.ABORT): JobPhase.ABORTED,
    (JobPhase.ABORTED, JobAction.FAIL): JobPhase.ABORTED,
    (JobPhase.ABORTED, JobAction.ABORT): JobPhase.ABORTED,
}


class IllegalTransitionError(RuntimeError):
    """A caller asked for a transition the table does not allow (a bug, never a user error)."""


class Lifecycle:
    """The phase of one job and the one place that changes it.

    Args:
        job_id: for log lines.
        phase: where the job starts (JOINING, or RECOVERING for a rebuilt job).
    """

    def __init__(self, job_id: str, phase: JobPhase = JobPhase.JOINING) -> None:
        self._job_id = job_id
        self.phase = phase

    def allows(self, action: JobAction) -> bool:
        """Whether ``action`` is a legal transition from the current phase."""
        return (self.phase, action) in TRANSITIONS

    def apply(self, action: JobAction) -> JobPhase:
        """Moves to the phase ``action`` leads to, and returns it.

        Raises:
            IllegalTransitionError: the table has no such transition from the current phase.
        """
        target = TRANSITIONS.get((self.phase, action))
        if target is None:
            raise IllegalTransitionError(f"job {self._job_id!r}: cannot {action.value} while {self.phase.value}")
        if target is not self.phase:
            log.debug("job %s: %s -> %s (%s)", self._job_id, self.phase.value, target.value, action.value)
        self.phase = target
        return target
