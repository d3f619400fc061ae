"""What the Kubernetes Job controller does when a pod of an Indexed Job fails, from the Job's spec.

The rules, as the Job controller applies them (kubernetes.io/docs/concepts/workloads/controllers/job):
the pod failure policy's rules are tried in order and the first that matches decides (``Ignore``: a
new pod, the failure not counted; ``FailJob``; ``FailIndex``; ``Count``); no match counts the failure.
A counted failure then meets the backoff limits: ``backoffLimitPerIndex`` fails the index after that
many failures of it, and the Job once more than ``maxFailedIndexes`` indexes failed; ``backoffLimit``
(default 6, or unlimited with ``backoffLimitPerIndex``) fails the Job after that many failures in
all. Otherwise the index gets a new pod, whose ``batch.kubernetes.io/job-index-failure-count``
annotation counts its index's failures (with ``backoffLimitPerIndex``).

Only what the tests need: exit codes of one container, pod conditions, restartPolicy Never.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RESTART = "restart"  # a new pod for the index
FAIL_INDEX = "fail-index"  # the index failed for good; the others go on
FAIL_JOB = "fail-job"  # the Job failed; its running pods are terminated
DEFAULT_BACKOFF_LIMIT = 6
UNLIMITED = 2**31 - 1
FAILURE_COUNT_ANNOTATION = "batch.kubernetes.io/job-index-failure-count"


def _rule_matches(rule: dict[str, Any], container: str, exit_code: int, conditions: set[str]) -> bool:
    on_exit = rule.get("onExitCodes")
    if on_exit:
        if exit_code == 0 or on_exit.get("containerName", container) != container:
            return False  # only containers that failed count, as in the controller
        inside = exit_code in on_exit["values"]
        return inside if on_exit["operator"] == "In" else not inside
    wanted = {c["type"] for c in rule.get("onPodConditions", []) if c.get("status", "True") == "True"}
    return bool(wanted & conditions)


@dataclass
class IndexedJob:
    """One Indexed Job's failure bookkeeping, as the Job controller keeps it."""

    spec: dict[str, Any]
    failures: dict[int, int] = field(default_factory=dict)  # counted failures per index
    failed_indexes: set[int] = field(default_factory=set)
    counted: int = 0  # counted failures in all

    def pod_failed(self, index: int, container: str, exit_code: int, conditions: frozenset[str] = frozenset()) -> str:
        """What the controller does after the pod of ``index`` failed: RESTART, FAIL_INDEX or FAIL_JOB."""
        assert self.spec["completionMode"] == "Indexed"
        assert self.spec["template"]["spec"]["restartPolicy"] == "Never"
        per_index = self.spec.get("backoffLimitPerIndex")
        action = "Count"
        for rule in self.spec.get("podFailurePolicy", {}).get("rules", []):
            if _rule_matches(rule, container, exit_code, set(conditions)):
                action = rule["action"]
                break
        if action == "Ignore":
            return RESTART
        if action == "FailJob":
            return FAIL_JOB
        self.counted += 1
        self.failures[index] = self.failures.get(index, 0) + 1
        backoff_limit = self.spec.get("backoffLimit", UNLIMITED if per_index is not None else DEFAULT_BACKOFF_LIMIT)
        if self.counted > backoff_limit:
            return FAIL_JOB
        if per_index is None:
            assert action != "FailIndex", "FailIndex needs backoffLimitPerIndex"
            return RESTART
        if action == "FailIndex" or self.failures[index] > per_index:
            self.failed_indexes.add(index)
            if len(self.failed_indexes) > self.spec.get("maxFailedIndexes", UNLIMITED):
                return FAIL_JOB
            return FAIL_INDEX
        return RESTART

    def annotations(self, index: int) -> dict[str, str]:
        """The annotations the controller gives the next pod of ``index``."""
        out = {"batch.kubernetes.io/job-completion-index": str(index)}
        if self.spec.get("backoffLimitPerIndex") is not None:
            out[FAILURE_COUNT_ANNOTATION] = str(self.failures.get(index, 0))
        return out
