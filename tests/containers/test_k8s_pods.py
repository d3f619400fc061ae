"""What the real-cluster suite (tests/kubernetes) cannot test, run with the rendered manifests as the
pods they describe (see ``pods.py``): NetworkPolicy (the test cluster's CNI does not enforce it) admits
the workers and nobody else, and the gpu overlay's differences on the CPU image (the test cluster has
no GPU, so its pods would stay Pending). The Job controller, the scheduler, restarts of pods and the
Service routing are tested on a real cluster in tests/kubernetes."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.containers.engine import Engine
from tests.containers.pods import Cluster, Pod, cpu_cores, probe_grpc
from tests.containers.test_compose import scrape
from tests.deploy.test_deploy_files import one, rendered

JOB_TIMEOUT_S = 240.0
SMALL_NODE_CPUS = 2.0
# What a 2-CPU node's system pods (kube-proxy, CNI, DNS) request, roughly: leave it free.
SYSTEM_RESERVE_CPUS = 0.5
WORKER_LABELS = {"app.kubernetes.io/name": "collsvc", "app.kubernetes.io/component": "worker"}


def job_parts(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    deployment = one(docs, "Deployment", "collsvc-coordinator")
    job = one(docs, "Job", "collsvc-train")
    return deployment, job, job["spec"]["template"]


def worker_pod(cluster: Cluster, job: dict[str, Any], index: int) -> Pod:
    """The pod the Job controller makes for completion index ``index``."""
    name = job["metadata"]["name"]
    uid = "0d7c6f3e-1b2a-4a5b-9c8d-7e6f5a4b3c2d"  # the Job's uid, shared by its pods
    return cluster.pod(
        f"{name}-{index}-x7k2p",
        job["spec"]["template"],
        ip_suffix=20 + index,
        hostname=f"{name}-{index}",  # Indexed Job pods with a subdomain get $(job-name)-$(index)
        annotations={"batch.kubernetes.io/job-completion-index": str(index)},
        extra_labels={
            "controller-uid": uid,
            "batch.kubernetes.io/controller-uid": uid,
            "job-name": name,
            "batch.kubernetes.io/job-name": name,
            "batch.kubernetes.io/job-completion-index": str(index),
        },
        env_extra={"JOB_COMPLETION_INDEX": str(index)},
    )


def coordinator_pod(cluster: Cluster, deployment: dict[str, Any]) -> Pod:
    return cluster.pod("collsvc-coordinator-6d5f8b7c9-q4w2z", deployment["spec"]["template"], ip_suffix=10)


def probe_port(deployment: dict[str, Any], probe: str) -> int:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return int(container[probe]["grpc"]["port"])


def wait_ready(cluster: Cluster, pod: Pod, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = probe_grpc(f"{pod.ip}:{port}")
        if result.returncode == 0:
            return
        assert time.monotonic() < deadline, (
            f"readiness probe never passed: {result.stdout}{result.stderr}\n{cluster.logs(pod.name)}"
        )
        time.sleep(0.5)  # the kubelet probes periodically too (periodSeconds)


@pytest.fixture
def cluster(engine: Engine, image: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("running pods needs root: NetworkPolicy rules (nsenter, iptables) and Secret file ownership")
    overlay = getattr(request, "param", "base")
    tag = f"{os.getpid() % 100000}{overlay[0]}"
    subnet = f"10.233.{(os.getpid() + len(overlay)) % 250}"
    made = Cluster(engine, rendered(overlay), tag=tag, subnet=subnet, workdir=tmp_path)
    try:
        yield made
    finally:
        made.close()


# The gpu overlay's worker image is the CUDA one; here (no GPU) the CPU image stands in for it, which is
# enough to run the overlay's differences: /dev/shm emptyDir, resources, tolerations are ignored.
CPU_STAND_IN = {"collsvc-cuda:0.1.0": "collsvc:0.1.0"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cluster", ["gpu"], indirect=True)
def test_indexed_job_completes_through_the_service_name(cluster: Cluster) -> None:
    deployment, job, template = job_parts(cluster.docs)
    world = int(job["spec"]["completions"])
    assert job["spec"]["parallelism"] == world
    coordinator = coordinator_pod(cluster, deployment)
    workers = [worker_pod(cluster, job, i) for i in range(world)]
    # Not a worker: the NetworkPolicies must keep it out.
    idle = {**template["spec"]["containers"][0], "command": ["sleep", "infinity"], "args": [], "env": []}
    labels = {"app.kubernetes.io/name": "collsvc", "app.kubernetes.io/component": "debug"}
    stranger = cluster.pod(
        "debug-shell",
        {"metadata": {"labels": labels}, "spec": {**template["spec"], "containers": [idle]}},
        ip_suffix=99,
    )
    cluster.register(coordinator, *workers, stranger)
    cluster.start(coordinator)
    # The readiness probe's port serves (the Service only routes to ready pods), the liveness probe's too.
    wait_ready(cluster, coordinator, probe_port(deployment, "readinessProbe"), 60)
    assert probe_grpc(f"{coordinator.ip}:{probe_port(deployment, 'livenessProbe')}").returncode == 0
    for pod in workers:
        cluster.start(pod, CPU_STAND_IN)
    deadline = min(float(job["spec"].get("activeDeadlineSeconds", JOB_TIMEOUT_S)), JOB_TIMEOUT_S)
    codes = {pod.name: cluster.wait_exit(pod.name, deadline) for pod in workers}
    logs = {pod.name: cluster.logs(pod.name) for pod in workers}
    assert set(codes.values()) == {0}, f"exit codes {codes}:\n" + "\n".join(
        f"--- {n}\n{t[-3000:]}" for n, t in logs.items()
    )
    # Rank = completion index: pod 0 is rank 0, the one that prints the result.
    assert f"weights identical on all {world} ranks: True" in logs[workers[0].name], logs[workers[0].name]
    assert "(matches: True)" in logs[workers[0].name]
    # The metrics port, where the pod declares one, serves Prometheus text to the node (a scraper's view).
    (coordinator_container,) = deployment["spec"]["template"]["spec"]["containers"]
    for port in coordinator_container.get("ports", []):
        if port["name"] == "metrics":
            assert "collsvc_" in scrape(f"{coordinator.ip}:{port['containerPort']}")
    # NetworkPolicy: a pod that is not a worker cannot reach the coordinator's gRPC port.
    cluster.start(stranger, CPU_STAND_IN)
    probe = cluster.engine.docker(
        "exec", f"{cluster.network}-{stranger.name}", "collsvc", "health", "--coordinator", "collsvc-coordinator:29400",
        "--timeout", "5", check=False, timeout=60,
    )  # fmt: skip
    assert probe.returncode != 0, "a non-worker pod reached the coordinator despite the NetworkPolicy"
    # Refused by the policy's rule: the name resolved and the coordinator still runs (the node reaches it).
    assert "Connection refused" in probe.stdout + probe.stderr, probe.stdout + probe.stderr
    assert probe_grpc(f"{coordinator.ip}:29400").returncode == 0


def test_requests_fit_a_small_node() -> None:
    for overlay in ("base",):
        deployment, job, template = job_parts(rendered(overlay))
        (worker,) = template["spec"]["containers"]
        (coordinator,) = deployment["spec"]["template"]["spec"]["containers"]
        world = int(job["spec"]["parallelism"])
        total = world * cpu_cores(worker["resources"]["requests"]["cpu"]) + cpu_cores(
            coordinator["resources"]["requests"]["cpu"]
        )
        assert total <= SMALL_NODE_CPUS - SYSTEM_RESERVE_CPUS, f"{overlay}: {total} CPUs requested"
        assert "memory" in worker["resources"]["limits"] and "memory" in coordinator["resources"]["limits"]
        assert job["spec"]["activeDeadlineSeconds"] > 0
