"""All jobs on one coordinator: created on first use, dropped when nobody is left in them."""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from collections.abc import Callable

from collsvc.errors import JobEndedError, ResourceLimitError
from collsvc.options import Limits
from collsvc.server.state.common import Clock, NotFoundError
from collsvc.server.state.credentials import MemberSecrets
from collsvc.server.state.jobs import Job

log = logging.getLogger(__name__)


def _random_incarnation() -> int:
    return secrets.randbits(64)


class Registry:
    """Jobs by id.

    A job is created by its first join or key/value request (NCCL ids may be published before
    everybody joined) and dropped once every member left or failed, so the same job id can run again.

    Args:
        clock: monotonic seconds, handed to every job.
        limits: sizes and counts; ``max_jobs`` bounds how many jobs exist at once.
        incarnation: makes each job instance's random 64-bit incarnation number.
        secrets: makes and checks member secrets (random key by default: jobs do not outlive this).
    """

    def __init__(
        self,
        *,
        clock: Clock,
        limits: Limits,
        incarnation: Callable[[], int] = _random_incarnation,
        secrets: MemberSecrets | None = None,
    ) -> None:
        self.secrets = secrets or MemberSecrets.random()
        self._clock = clock
        self._limits = limits
        self._incarnation = incarnation
        self._jobs: dict[str, Job] = {}
        # job id -> (why it ended, the ranks that caused it) of the jobs dropped lately, newest last, so
        # that a member still using one learns why it is gone (JobEndedError) rather than "no job".
        self._ended: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def find(self, job_id: str) -> Job | None:
        """The job ``job_id``, or None."""
        return self._jobs.get(job_id)

    def get(self, job_id: str) -> Job:
        """The job ``job_id``.

        Raises:
            JobEndedError: the job ended and was dropped lately (it says why, and which ranks caused it).
            NotFoundError: no such job on this coordinator.
        """
        job = self._jobs.get(job_id)
        if job is None:
            ended = self._ended.get(job_id)
            if ended is not None:
                reason, ranks = ended
                raise JobEndedError(f"job {job_id!r} ended on this coordinator: {reason}", reason, ranks)
            raise NotFoundError(f"no job {job_id!r} on this coordinator")
        return job

    def get_or_create(self, job_id: str) -> Job:
        """The job ``job_id``, created if it does not exist.

        Raises:
            ValueError: empty job id.
            ResourceLimitError: the coordinator already holds ``max_jobs`` jobs.
        """
        job = self._jobs.get(job_id)
        if job is not None:
            return job
        if not job_id:
            raise ValueError("job_id must not be empty")
        if len(self._jobs) >= self._limits.max_jobs:
            raise ResourceLimitError(f"this coordinator already holds the maximum of {self._limits.max_jobs} jobs")
        self._ended.pop(job_id, None)  # the id names a new job now
        job = Job(job_id, clock=self._clock, limits=self._limits, incarnation=self._incarnation(), secrets=self.secrets)
        self._jobs[job_id] = job
        log.debug("job %s: created (incarnation %x)", job_id, job.incarnation)
        return job

    def drop_if_finished(self, job: Job) -> bool:
        """Forgets ``job`` when nobody is left in it; returns whether it was dropped."""
        if not job.finished or self._jobs.get(job.job_id) is not job:
            return False
        del self._jobs[job.job_id]
        self._ended.pop(job.job_id, None)
        self._ended[job.job_id] = ended_reason(job)
        while len(self._ended) > self._limits.max_jobs:
            self._ended.popitem(last=False)
        log.info("job %s: finished (%s); state dropped", job.job_id, job.state)
        return True

    def jobs(self) -> list[Job]:
        """Every job, in creation order."""
        return list(self._jobs.values())


def ended_reason(job: Job) -> tuple[str, list[int]]:
    """Why a finished ``job`` ended, in words, and the ranks that caused it ([] when none did)."""
    if job.abort_reason is not None:
        return f"aborted: {job.abort_reason}", []
    if job.failed_ranks:
        ranks = ", ".join(str(r) for r in job.failed_ranks)
        return f"rank {ranks} failed: {job.failure_reason}", list(job.failed_ranks)
    if job.mismatch_reason:
        return f"collective mismatch: {job.mismatch_reason}", []
    return "every member left", []
