"""The per-client count of waiting Joins (collsvc/server/state/joins.py), without a network."""

from __future__ import annotations

import pytest

from collsvc.errors import ResourceLimitError
from collsvc.options import Limits
from collsvc.server.state.joins import JoinQuota


def test_jobs_per_client_are_capped_and_given_back() -> None:
    quota = JoinQuota(Limits(max_joining_jobs_per_client=2))
    quota.admit("10.0.0.1", "a")
    quota.admit("10.0.0.1", "b")
    quota.admit("10.0.0.1", "a")  # another member of a job it already waits in: no new job
    with pytest.raises(ResourceLimitError, match=r"client 10\.0\.0\.1 already waits in 2 jobs.*'c'"):
        quota.admit("10.0.0.1", "c")
    quota.admit("10.0.0.2", "c")  # other clients are not affected
    quota.release("10.0.0.1", "b")
    quota.admit("10.0.0.1", "c")
    assert quota.waiting("10.0.0.1") == 3


def test_waiting_calls_per_client_are_capped() -> None:
    quota = JoinQuota(Limits(max_pending_joins_per_client=3))
    for _ in range(3):
        quota.admit("h", "big-job")
    with pytest.raises(ResourceLimitError, match="max_pending_joins_per_client"):
        quota.admit("h", "big-job")
    for _ in range(3):
        quota.release("h", "big-job")
    assert quota.waiting("h") == 0
    quota.release("h", "big-job")  # an extra release is harmless
    quota.admit("h", "big-job")
