"""The Job spec of each kustomization, as the Kubernetes Job controller applies it when a worker pod
fails (``job_controller.py``): the base fails the Job on any rank's failure; the elastic overlay replaces
a failed rank and loses it for good only after its replacements, with the knobs of ``collsvc run
--min-ranks M --max-restarts K``."""

from __future__ import annotations

import pytest

from tests.deploy.job_controller import FAIL_INDEX, FAIL_JOB, FAILURE_COUNT_ANNOTATION, RESTART, IndexedJob
from tests.deploy.test_deploy_files import ELASTIC, ELASTIC_WORKER, KUSTOMIZATIONS, _job_parts, rendered

SIGKILL_EXIT = 137  # a container whose process was SIGKILLed


@pytest.mark.parametrize("name", sorted(set(KUSTOMIZATIONS) - ELASTIC))
def test_k8s_job_fails_at_the_first_failed_rank(name: str) -> None:
    job, _, _ = _job_parts(rendered(name))
    assert IndexedJob(job["spec"]).pod_failed(1, "worker", SIGKILL_EXIT) == FAIL_JOB
    # An eviction, preemption or drain is not the program's fault: the rank gets a new pod.
    evicted = IndexedJob(job["spec"]).pod_failed(1, "worker", SIGKILL_EXIT, frozenset({"DisruptionTarget"}))
    assert evicted == RESTART


@pytest.mark.parametrize("name", sorted(ELASTIC))
def test_k8s_elastic_job_replaces_failed_ranks(name: str) -> None:
    """The knobs of ``collsvc run --min-ranks M --max-restarts K``: K = backoffLimitPerIndex replacements
    per rank, N - M = maxFailedIndexes ranks lost for good; the worker starts through the rejoin module."""
    job, pod, worker = _job_parts(rendered(name))
    spec = job["spec"]
    world = int(spec["completions"])
    restarts, may_lose = int(spec["backoffLimitPerIndex"]), int(spec["maxFailedIndexes"])
    assert restarts >= 1 and 0 <= may_lose < world, "at least one replacement, at least one rank left"
    assert "backoffLimit" not in spec, "an explicit backoffLimit would fail the Job on the failures of all ranks"
    assert pod["restartPolicy"] == "Never"  # required by backoffLimitPerIndex
    assert worker["command"] + worker["args"][:1] == ELASTIC_WORKER
    assert not [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    controller = IndexedJob(spec)
    # Rank 1 is killed: replaced K times (each replacement's annotation counts the failures), then lost.
    for failure in range(1, restarts + 1):
        assert controller.pod_failed(1, "worker", SIGKILL_EXIT) == RESTART
        assert controller.annotations(1)[FAILURE_COUNT_ANNOTATION] == str(failure)
    assert controller.pod_failed(1, "worker", SIGKILL_EXIT) == (FAIL_INDEX if may_lose >= 1 else FAIL_JOB)
    # An eviction is not counted; losing more than maxFailedIndexes ranks fails the Job.
    assert controller.pod_failed(0, "worker", SIGKILL_EXIT, frozenset({"DisruptionTarget"})) == RESTART
    verdict = RESTART
    for index in range(world):
        while verdict != FAIL_JOB and index not in controller.failed_indexes:
            verdict = controller.pod_failed(index, "worker", 1)
    assert verdict == FAIL_JOB and len(controller.failed_indexes) == may_lose + 1, controller.failed_indexes
