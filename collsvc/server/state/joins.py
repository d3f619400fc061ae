"""Waiting Join calls counted per client, so that one client cannot hold every job slot.

A Join waits until its job has every member. Joins that never complete (abandoned, misconfigured or
hostile) keep their job, and so a slot of ``max_jobs``, for as long as they wait. Counting them per
client address bounds what one client can take: at most ``max_joining_jobs_per_client`` jobs still
gathering members, and ``max_pending_joins_per_client`` waiting members in all (a JoinBatch counts
each). A client whose calls end (completed, timed out, cancelled, or its connection closed) gets its
share back at once.
"""

from __future__ import annotations

from collsvc.errors import ResourceLimitError
from collsvc.options import Limits


class JoinQuota:
    """Waiting Join calls by client address and job.

    Args:
        limits: supplies ``max_joining_jobs_per_client`` and ``max_pending_joins_per_client``.
    """

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._waiting: dict[str, dict[str, int]] = {}  # client -> job id -> waiting calls

    def waiting(self, client: str) -> int:
        """How many members ``client`` has waiting in Join calls."""
        return sum(self._waiting.get(client, {}).values())

    def admit(self, client: str, job_id: str, members: int = 1) -> None:
        """Counts ``members`` more waiting members of ``client`` in ``job_id`` (one Join, or the members
        of one JoinBatch); pair it with :meth:`release`.

        Raises:
            ResourceLimitError: ``client`` already waits in ``max_joining_jobs_per_client`` other jobs,
                or would have more than ``max_pending_joins_per_client`` members waiting.
        """
        jobs = self._waiting.get(client, {})
        limits = self._limits
        if job_id not in jobs and len(jobs) >= limits.max_joining_jobs_per_client:
            raise ResourceLimitError(
                f"client {client} already waits in {len(jobs)} jobs that are still gathering members "
                f"(Limits.max_joining_jobs_per_client = {limits.max_joining_jobs_per_client}); "
                f"refusing a Join to job {job_id!r} until one of them completes or gives up"
            )
        if sum(jobs.values()) + members > limits.max_pending_joins_per_client:
            raise ResourceLimitError(
                f"client {client} would have more than {limits.max_pending_joins_per_client} members waiting "
                f"in Join calls (Limits.max_pending_joins_per_client)"
            )
        self._waiting[client] = jobs
        jobs[job_id] = jobs.get(job_id, 0) + members

    def release(self, client: str, job_id: str, members: int = 1) -> None:
        """Forgets ``members`` waiting members of ``client`` in ``job_id`` (their call completed, failed
        or was cancelled)."""
        jobs = self._waiting.get(client)
        if jobs is None or job_id not in jobs:
            return
        jobs[job_id] -= members
        if jobs[job_id] <= 0:
            del jobs[job_id]
        if not jobs:
            del self._waiting[client]
