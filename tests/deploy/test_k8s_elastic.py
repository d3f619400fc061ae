"""The Job spec of each kustomization, read statically: the base fails the Job on any rank's failure, the
elastic overlay replaces a failed rank and loses it for good only after its replacements, with the
knobs of ``collsvc run --min-ranks M --max-restarts K``. What the Job controller then does with these
specs is tested on a real cluster (tests/kubernetes/test_cluster.py)."""

from __future__ import annotations

import pytest

from tests.deploy.test_deploy_files import ELASTIC, ELASTIC_WORKER, KUSTOMIZATIONS, _job_parts, rendered

DISRUPTION_IGNORED = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


@pytest.mark.parametrize("name", sorted(set(KUSTOMIZATIONS) - ELASTIC))
def test_k8s_job_fails_at_the_first_failed_rank(name: str) -> None:
    job, pod, _ = _job_parts(rendered(name))
    spec = job["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    # An eviction, preemption or drain is not the program's fault: tried first, not counted.
    assert rules[0] == DISRUPTION_IGNORED
    # Any non-zero exit of the worker fails the Job at once (not one rank retried alone).
    (fail,) = [r for r in rules if r["action"] == "FailJob"]
    assert fail["onExitCodes"] == {"containerName": "worker", "operator": "NotIn", "values": [0]}
    assert spec["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"


@pytest.mark.parametrize("name", sorted(ELASTIC))
def test_k8s_elastic_job_replaces_failed_ranks(name: str) -> None:
    """K = backoffLimitPerIndex replacements per rank, N - M = maxFailedIndexes ranks lost for good;
    the worker starts through the rejoin module."""
    job, pod, worker = _job_parts(rendered(name))
    spec = job["spec"]
    world = int(spec["completions"])
    restarts, may_lose = int(spec["backoffLimitPerIndex"]), int(spec["maxFailedIndexes"])
    assert restarts >= 1 and 0 <= may_lose < world, "at least one replacement, at least one rank left"
    assert "backoffLimit" not in spec, "an explicit backoffLimit would fail the Job on the failures of all ranks"
    assert pod["restartPolicy"] == "Never"  # required by backoffLimitPerIndex
    assert worker["command"] + worker["args"][:1] == ELASTIC_WORKER
    assert spec["podFailurePolicy"]["rules"] == [DISRUPTION_IGNORED]
