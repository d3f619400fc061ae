"""What went wrong in a job: failed and departed members, an abort, a collective mismatch.

:class:`FailureRecord` is the part of a :class:`~collsvc.server.state.jobs.Job` that remembers failures
and turns them into the error every later step of the job must end with.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Any

from collsvc.errors import AbortedError, CollectiveMismatchError, RankFailedError
from collsvc.server.state.common import Member

log = logging.getLogger(__name__)


class FailureRecord:
    """Failures of one job. The job supplies its members, its groups and its phase changes.

    Args:
        job_id: for messages.
    """

    members: list[Member]

    def __init__(self, job_id: str) -> None:
        self._record_job_id = job_id
        self.failed_ranks: list[int] = []
        self.failure_reason = ""
        self.left_ranks: dict[int, None] = {}  # ordered set
        self.abort_reason: str | None = None
        self.abort_rank = -1
        self.mismatch: dict[str, Any] = {}
        self.mismatch_reason = ""
        self.failure_counts: dict[str, int] = {}  # kind -> count, for the metrics endpoint

    # Supplied by the job.
    def _fail_phase(self) -> None:
        raise NotImplementedError

    def _abort_phase(self) -> None:
        raise NotImplementedError

    def group_contains(self, name: str, rank: int) -> bool:
        raise NotImplementedError

    @property
    def broken(self) -> bool:
        """Whether anything failed already (later failures are mostly its consequences)."""
        return bool(self.failure_reason or self.mismatch_reason or self.abort_reason)

    def record_failed(self, failed: Sequence[Member], reason: str) -> None:
        """Records members newly marked FAILED (one warning for the cause, the rest at INFO)."""
        level = logging.INFO if self.broken else logging.WARNING
        for member in failed:
            self.failed_ranks.append(member.rank)
            log.log(level, "job %s rank %d (%s): failed: %s", self._record_job_id, member.rank, member.host, reason)
        if not self.failure_reason:
            self.failure_reason = reason
        self.count_failure("rank_failed", len(failed))

    def abort(self, reason: str, rank: int) -> bool:
        """Aborts the job; returns False when it was already aborted."""
        if self.abort_reason is not None:
            return False
        self._abort_phase()
        self.abort_reason = reason or "aborted"
        self.abort_rank = rank
        self.count_failure("aborted")
        log.warning("job %s: aborted by rank %d: %s", self._record_job_id, rank, self.abort_reason)
        return True

    def merge_mismatch(self, details: dict[str, Any], reason: str) -> dict[str, Any]:
        """Merges one reporter's ``{rank: signature}`` map into the job's; returns the merged map."""
        self._fail_phase()
        if not self.mismatch:
            self.count_failure("mismatch")
        self.mismatch.update(details)
        if not self.mismatch_reason:
            self.mismatch_reason = reason or "collective mismatch"
        return self.mismatch

    def count_failure(self, kind: str, count: int = 1) -> None:
        """Counts ``count`` failures of ``kind`` (rank_failed, aborted, mismatch, barrier_timeout)."""
        self.failure_counts[kind] = self.failure_counts.get(kind, 0) + count

    @property
    def failure_text(self) -> str:
        """A one-line account of what went wrong, "" when nothing did."""
        parts = []
        if self.abort_reason is not None:
            parts.append(f"aborted by rank {self.abort_rank}: {self.abort_reason}")
        if self.failed_ranks:
            parts.append(f"ranks {self.failed_ranks} failed: {self.failure_reason}")
        if self.mismatch:
            parts.append(f"collective mismatch: {self.mismatch_reason}")
        return "; ".join(parts)

    def check_healthy(self, group: str, excused: Collection[int] = ()) -> None:
        """Raises the error every collective step in ``group`` must end with, if the job is broken.

        ``excused``: ranks whose clean departure does not break this step (they had arrived at the
        barrier before leaving, so they left because it failed for them: blaming them would name a
        victim; the waiters time out instead, naming who never arrived).

        Raises:
            AbortedError: the job was aborted.
            RankFailedError: a member failed, or a member of ``group`` left.
            CollectiveMismatchError: a member reported mismatched collectives.
        """
        job_id = self._record_job_id
        if self.abort_reason is not None:
            raise AbortedError(
                f"job {job_id!r} was aborted by rank {self.abort_rank}: {self.abort_reason}", self.abort_reason
            )
        if self.failed_ranks:
            hosts = [self.members[r].host for r in self.failed_ranks]
            raise RankFailedError(
                f"job {job_id!r}: rank(s) {self.failed_ranks} on {hosts} failed: {self.failure_reason}",
                self.failed_ranks,
                hosts,
            )
        if self.left_ranks:
            left = [r for r in self.left_ranks if self.group_contains(group, r) and r not in excused]
            if left:
                hosts = [self.members[r].host for r in left]
                raise RankFailedError(f"job {job_id!r}: rank(s) {left} on {hosts} left group {group!r}", left, hosts)
        if self.mismatch:
            details = {int(k): v for k, v in self.mismatch.items() if str(k).lstrip("-").isdigit()}
            raise CollectiveMismatchError(f"job {job_id!r}: {self.mismatch_reason}", details)
