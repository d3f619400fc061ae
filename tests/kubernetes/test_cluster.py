"""The kustomizations of deploy/k8s applied as shipped (only the token and the image tag replaced, and
the scenario's patches of the Job) on a real single-node Kubernetes, judged by the cluster's own state
(``kubectl get -o json``) and the pods' logs. Each test prints ``MEASURED`` lines: times from the apply
(or from the disruption) as the cluster and the logs record them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.kubernetes.cluster import (
    COORDINATORS,
    Kube,
    condition,
    finished,
    index_of,
    logged_at,
    run_script_patch,
    stamp,
    world_patch,
)
from tests.kubernetes.elastic_pod_job import reference

HERE = Path(__file__).parent
TRAIN_FOR = (HERE / "train_for.py").read_text()
ELASTIC_JOB = (HERE / "elastic_pod_job.py").read_text()
JOB_TIMEOUT_S = 150.0


@pytest.fixture
def cluster(kube: Kube) -> Kube:
    kube.reset()
    return kube


def by_index(kube: Kube) -> dict[int, dict[str, Any]]:
    """The worker pods that are not being deleted, by completion index (the newest when several)."""
    pods: dict[int, dict[str, Any]] = {}
    for pod in sorted(kube.pods(), key=lambda p: p["metadata"]["creationTimestamp"]):
        if not pod["metadata"].get("deletionTimestamp"):
            pods[index_of(pod)] = pod
    return pods


def wait_finished(kube: Kube, timeout: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        job = kube.job()
        return job if finished(job) else None

    return kube.until("the Job to finish", done, timeout, kube.story)


def wait_logged(kube: Kube, world: int, text: str, timeout: float = 90.0) -> dict[int, str]:
    """Waits until each rank's pod logged ``text``; returns the pod names by index."""

    def logged() -> dict[int, str] | None:
        pods = by_index(kube)
        if len(pods) < world:
            return None
        names = {i: p["metadata"]["name"] for i, p in pods.items()}
        return names if all(text in kube.logs(n) for n in names.values()) else None

    return kube.until(f"every rank to log {text!r}", logged, timeout, kube.story)


def coordinator_ready_at(kube: Kube) -> float:
    (pod,) = [p for p in kube.pods(COORDINATORS) if not p["metadata"].get("deletionTimestamp")]
    ready = condition(pod, "Ready")
    assert ready is not None, kube.story()
    return stamp(ready["lastTransitionTime"])


@pytest.mark.parametrize("world", [2, 4])
def test_base_job_completes(cluster: Kube, world: int) -> None:
    """The base as shipped (world 2), and at world 4 with the three world-size fields changed together
    and 250m CPU per rank (4 x 500m does not fit a 2-CPU node)."""
    applied = cluster.apply("base", world_patch(world, "250m") if world != 2 else None)
    job = wait_finished(cluster)
    story = cluster.story()
    assert finished(job) == "Complete", story
    assert job["status"].get("succeeded") == world and not job["status"].get("failed"), story
    pods = by_index(cluster)
    rank0 = cluster.logs(pods[0]["metadata"]["name"])
    assert f"weights identical on all {world} ranks: True" in rank0, story
    assert "(matches: True)" in rank0, story
    # Workers that started before the Service routed or its name resolved still joined on their
    # first stream: none lost the coordinator at start.
    for pod in pods.values():
        assert "lost the coordinator" not in cluster.logs(pod["metadata"]["name"]), story
    ready = coordinator_ready_at(cluster) - applied
    training = logged_at(cluster.logs(pods[0]["metadata"]["name"], timestamps=True), r"epoch +0 ") or float("nan")
    complete = stamp(job["status"]["completionTime"]) - applied
    print(
        f"MEASURED base world {world}: coordinator Ready {ready:.1f}s, first step done {training - applied:.1f}s, "
        f"Job Complete {complete:.0f}s after the apply"
    )


def test_base_job_fails_when_a_worker_pod_is_deleted(cluster: Kube) -> None:
    """A collective job cannot go on without a member: the base fails the Job at once (its pod failure
    policy), every survivor names the lost rank, and nothing is left running."""
    cluster.apply("base", run_script_patch(TRAIN_FOR, {"TRAIN_SECONDS": "120"}))
    names = wait_logged(cluster, 2, "training")
    for name in names.values():  # the Job controller deletes the survivors' pods when it fails the Job
        cluster.follow(name)
    victim = 1
    deleted = cluster.delete_pod(names[victim])  # SIGTERM ends it at once (the base shares the PID namespace)
    job = wait_finished(cluster, 90)
    story = cluster.story()
    failed = condition(job, "Failed")
    assert failed is not None, story
    assert failed["reason"] == "PodFailurePolicy", (failed, story)  # not the activeDeadlineSeconds
    assert stamp(failed["lastTransitionTime"]) - deleted < job["spec"]["activeDeadlineSeconds"], story

    def nothing_running() -> list[dict[str, Any]] | None:
        pods = cluster.get("pods")["items"]
        workers = [p for p in pods if p["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
        return workers if all(p["status"].get("phase") != "Running" for p in workers) else None

    cluster.until("no worker pod Running", nothing_running, 60, cluster.story)
    survivors = [name for index, name in names.items() if index != victim]
    for name in survivors:
        assert re.search(rf"\brank {victim}\b", cluster.logs(name)), (name, story)
    print(
        f"MEASURED base worker pod deleted: Job Failed ({failed['reason']}) "
        f"{stamp(failed['lastTransitionTime']) - deleted:.0f}s after the delete"
    )


def test_elastic_job_readmits_a_deleted_worker_pod(cluster: Kube) -> None:
    """The elastic overlay: a worker pod deleted mid-training; the Job controller makes a new pod for its
    index, which rejoins the running job; every rank ends with the same weights, those of training
    without the failure."""
    world, victim = 2, 1
    cluster.apply("overlays/elastic", run_script_patch(ELASTIC_JOB, {"ELASTIC_SECONDS": "15"}, keep_command=True))
    names = wait_logged(cluster, world, f"of {world} training")
    # As an operator deletes it, with the pod's grace period: the worker is not the pod's PID 1, so
    # SIGTERM ends it at once (as PID 1 it ignored SIGTERM, trained on for 30 s and could finish first).
    deleted = cluster.delete_pod(names[victim])
    job = wait_finished(cluster, 240)
    story = cluster.story()
    assert finished(job) == "Complete", story
    pods = by_index(cluster)
    replacement = pods[victim]["metadata"]["name"]
    assert replacement != names[victim], story
    failures = pods[victim]["metadata"]["annotations"].get("batch.kubernetes.io/job-index-failure-count")
    assert failures == "1", story
    replacement_log = cluster.logs(replacement)
    assert "already runs; joining it as a newcomer" in replacement_log, story
    finals = {}
    for index, pod in pods.items():
        (line,) = [ln for ln in cluster.logs(pod["metadata"]["name"]).splitlines() if ln.startswith("finished: ")]
        finals[index] = json.loads(line.removeprefix("finished: "))
    assert sorted(f["rank"] for f in finals.values()) == list(range(world)), story
    first = finals[0]
    assert all(f["size"] == world and f["step"] == first["step"] and f["w"] == first["w"] for f in finals.values())
    assert max(abs(a - b) for a, b in zip(first["w"], reference(first["step"]), strict=True)) < 1e-9, story
    stamped = cluster.logs(replacement, timestamps=True)
    created = stamp(pods[victim]["metadata"]["creationTimestamp"]) - deleted
    admitted = logged_at(stamped, rf"rank \d+ of {world} training from step") or float("nan")
    print(
        f"MEASURED elastic worker pod deleted: replacement pod created {created:.1f}s, admitted "
        f"{admitted - deleted:.1f}s after the delete; longest step of any rank "
        f"{max(f['longest_step_s'] for f in finals.values())}s; {first['step']} steps"
    )


def test_job_outlives_a_deleted_coordinator_pod(cluster: Kube) -> None:
    """The coordinator's pod deleted mid-training: the Deployment makes a new one (new IP, same Service),
    the members re-register with it, and the Job completes."""
    cluster.apply("base", run_script_patch(TRAIN_FOR, {"TRAIN_SECONDS": "12"}))
    wait_logged(cluster, 2, "training")
    (old,) = cluster.pods(COORDINATORS)
    deleted = cluster.delete_pod(old["metadata"]["name"])
    job = wait_finished(cluster, 240)
    story = cluster.story()
    assert finished(job) == "Complete", story
    rank0 = cluster.logs(by_index(cluster)[0]["metadata"]["name"])
    match = re.search(r"trained: (\d+) steps, all sums correct, longest step ([\d.]+)s", rank0)
    assert match is not None, story
    assert "re-registered with the coordinator" in rank0, story
    ready = coordinator_ready_at(cluster) - deleted
    print(
        f"MEASURED coordinator pod deleted: new coordinator Ready {ready:.1f}s after the delete; "
        f"{match.group(1)} steps, longest step (the stall) {match.group(2)}s"
    )


def test_a_world_that_does_not_fit_the_node(cluster: Kube) -> None:
    """World 4 at the base's 500m per rank on a 2-CPU node: one rank stays Pending (Insufficient cpu);
    rank 0 names it while it waits, and the Job ends at its activeDeadlineSeconds."""
    deadline = 25  # rank 0 logs who has not joined every 10 s of its wait: at least once before this
    patch = world_patch(4) + [{"op": "replace", "path": "/spec/activeDeadlineSeconds", "value": deadline}]
    applied = cluster.apply("base", patch)

    def pending() -> list[int] | None:
        pods = by_index(cluster)
        if len(pods) < 4:
            return None
        stuck = [i for i, p in pods.items() if (c := condition_false(p, "PodScheduled")) and c == "Unschedulable"]
        return stuck or None

    unscheduled = cluster.until("a pod to be Unschedulable", pending, 60, cluster.story)
    names = {i: p["metadata"]["name"] for i, p in by_index(cluster).items()}
    assert 0 not in unscheduled, cluster.story()
    missing = ", ".join(str(i) for i in unscheduled)
    word = "rank" if len(unscheduled) == 1 else "ranks"
    expected = f"not joined: {word} {missing}"
    # Read rank 0's log while its pod lives (the Job controller deletes the pods at the deadline); a
    # follower started before the container runs would end at once with nothing kept.
    rank0 = cluster.until(
        f"rank 0 to log {expected!r}",
        lambda: log if expected in (log := cluster.logs(names[0])) else None,
        deadline + 30,
        cluster.story,
    )
    job = wait_finished(cluster, deadline + 60)
    story = cluster.story()
    failed = condition(job, "Failed")
    assert failed is not None and failed["reason"] == "DeadlineExceeded", story
    assert "deadline" in failed["message"], story
    assert expected in rank0, story
    print(
        f"MEASURED world 4 on a 2-CPU node: ranks {unscheduled} Unschedulable; Job Failed "
        f"({failed['reason']}) {stamp(failed['lastTransitionTime']) - applied:.0f}s after the apply"
    )


def condition_false(obj: dict[str, Any], kind: str) -> str | None:
    """The reason of the object's condition ``kind`` when it is False."""
    for cond in obj.get("status", {}).get("conditions", []) or []:
        if cond["type"] == kind and cond["status"] == "False":
            return str(cond.get("reason", ""))
    return None
