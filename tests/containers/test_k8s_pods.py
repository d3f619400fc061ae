"""The rendered Kubernetes manifests (base, and the gpu overlay on the CPU image), run as the pods they
describe (see ``pods.py``): the coordinator Deployment's pod behind its Service name, then the Indexed
Job's pods, which rendezvous through that name and complete. Also: the readiness probe means serving,
NetworkPolicy admits the peers and nobody else, the requests fit a 2-CPU node, and ranks whose peers
never start say which ranks have not joined (and so does ``collsvc status``). And the failures the
manifests ride out: the coordinator's process killed mid-training (its pod restarts it, issue #19), and
a worker pod of the elastic overlay killed mid-training, replaced as the Job controller would and
rejoining the job (issue #14)."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.containers.elastic_pod_job import reference
from tests.containers.engine import Engine, run
from tests.containers.pods import Cluster, Pod, cpu_cores, probe_grpc
from tests.containers.test_compose import scrape
from tests.deploy.job_controller import RESTART, IndexedJob
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


def worker_pod(cluster: Cluster, job: dict[str, Any], index: int, controller: IndexedJob | None = None) -> Pod:
    """The pod the Job controller makes for completion index ``index`` (after the failures ``controller`` counted)."""
    name = job["metadata"]["name"]
    uid = "0d7c6f3e-1b2a-4a5b-9c8d-7e6f5a4b3c2d"  # the Job's uid, shared by its pods
    controller = controller or IndexedJob(job["spec"])
    attempt = controller.failures.get(index, 0)  # a new pod per failure: new name, new IP
    return cluster.pod(
        f"{name}-{index}-{'x7k2p' if not attempt else f'r{attempt}q9m'}",
        job["spec"]["template"],
        ip_suffix=20 + index + 30 * attempt,
        hostname=f"{name}-{index}",  # Indexed Job pods with a subdomain get $(job-name)-$(index)
        annotations=controller.annotations(index),
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
@pytest.mark.parametrize("cluster", ["base", "gpu"], indirect=True)
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


@pytest.mark.timeout(600)
def test_waiting_rank_and_status_name_the_ranks_that_never_joined(cluster: Cluster, token_file: Path) -> None:
    deployment, job, _ = job_parts(cluster.docs)
    world = int(job["spec"]["completions"])
    assert world >= 2
    coordinator = coordinator_pod(cluster, deployment)
    only_rank_0 = worker_pod(cluster, job, 0)  # the others stay Pending ("Insufficient cpu")
    cluster.register(coordinator, only_rank_0)
    cluster.start(coordinator)
    wait_ready(cluster, coordinator, probe_port(deployment, "readinessProbe"), 60)
    cluster.start(only_rank_0)
    expected = (
        "not joined: rank 1 (1 of 2 joined)" if world == 2 else f"not joined: ranks 1-{world - 1} (1 of {world} joined)"
    )
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    secret_name = next(v["secret"]["secretName"] for v in volumes if "secret" in v)  # with kustomize's hash suffix
    token = cluster.secret_files(secret_name)["token"]
    token_path = token_file.parent / "k8s-token"
    token_path.write_bytes(token)
    deadline = time.monotonic() + 120
    status = ""
    while expected not in status:
        assert time.monotonic() < deadline, f"collsvc status never said {expected!r}:\n{status}"
        status = run(
            ["collsvc", "status", "--coordinator", f"{coordinator.ip}:29400", "--token-file", str(token_path)],
            check=False, timeout=30,
        ).stdout  # fmt: skip
        time.sleep(0.5)  # polling the status a user would look at
    while expected not in cluster.logs(only_rank_0.name):
        assert time.monotonic() < deadline, f"rank 0 never logged {expected!r}:\n{cluster.logs(only_rank_0.name)}"
        time.sleep(0.5)


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


# ------------------------------------------------------------------- failures the manifests ride out

yaml = pytest.importorskip("yaml")
HERE = Path(__file__).parent
TRAIN_SECONDS = "14"


def with_worker(
    job: dict[str, Any], *, args: list[str], env: dict[str, str], command: list[str] | None = None
) -> dict[str, Any]:
    """A copy of ``job`` whose worker container runs ``[command] args`` with ``env`` added to its env."""
    changed = copy.deepcopy(job)
    (container,) = changed["spec"]["template"]["spec"]["containers"]
    if command is not None:
        container["command"] = command
    container["args"] = args
    container["env"] = container.get("env", []) + [{"name": k, "value": v} for k, v in env.items()]
    return changed


def wait_for_logs(cluster: Cluster, pods: list[Pod], text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for pod in pods:
        while text not in cluster.logs(pod.name):
            assert time.monotonic() < deadline, f"{pod.name} never logged {text!r}:\n{cluster.logs(pod.name)}"
            time.sleep(0.25)  # polling a container's output: the engine offers no event for a line


def explain(cluster: Cluster, pods: list[Pod], codes: dict[str, int]) -> str:
    return f"exit codes {codes}:\n" + "\n".join(f"--- {p.name}\n{cluster.logs(p.name)[-3000:]}" for p in pods)


@pytest.mark.timeout(900)
def test_job_outlives_a_coordinator_pod_restart(cluster: Cluster) -> None:
    """Issue #19 against the Kubernetes manifests: the coordinator's process is SIGKILLed mid-training;
    its pod's ``restartPolicy: Always`` starts it again in the same pod (same IP behind the same
    Service name, same token), the members re-register, and every worker finishes with exit 0."""
    deployment, job, _ = job_parts(cluster.docs)
    assert deployment["spec"]["template"]["spec"]["restartPolicy"] == "Always"
    # The training loop of the compose variant: all_reduce every step, a barrier every 20 steps.
    compose_worker = yaml.safe_load((HERE / "compose.restart.yaml").read_text())["services"]["worker"]
    training = with_worker(
        job, command=["python"], args=["-c", compose_worker["command"][0]], env={"TRAIN_SECONDS": TRAIN_SECONDS}
    )
    world = int(job["spec"]["completions"])
    coordinator = coordinator_pod(cluster, deployment)
    workers = [worker_pod(cluster, training, i) for i in range(world)]
    cluster.register(coordinator, *workers)
    cluster.start(coordinator)
    wait_ready(cluster, coordinator, probe_port(deployment, "readinessProbe"), 60)
    for pod in workers:
        cluster.start(pod)
    wait_for_logs(cluster, workers, " training", 120)
    restarts = cluster.app_state(coordinator.name, "RestartCount")
    run(["kill", "-KILL", str(cluster.app_state(coordinator.name, "Pid"))])
    killed_at = time.time()
    codes = {pod.name: cluster.wait_exit(pod.name, JOB_TIMEOUT_S) for pod in workers}
    assert set(codes.values()) == {0}, explain(cluster, workers, codes)
    assert cluster.app_state(coordinator.name, "RestartCount") > restarts, cluster.logs(coordinator.name)
    wait_ready(cluster, coordinator, probe_port(deployment, "readinessProbe"), 60)  # serving again
    # Rank = completion index: pod 0 is rank 0, which prints the summary.
    match = re.search(
        r"restart job: (\d+) steps, all sums correct, longest step ([\d.]+)s", cluster.logs(workers[0].name)
    )
    assert match is not None, explain(cluster, workers, codes)
    assert "re-registered with the coordinator" in cluster.logs(workers[0].name), explain(cluster, workers, codes)
    # The outage: the kill, the restarted process's start, its first line saying it serves again.
    started = cluster.engine.docker(
        "inspect", "--format", "{{.State.StartedAt}}", f"{cluster.network}-{coordinator.name}"
    ).stdout.strip()
    listening = [
        docker_time(line.split(" ", 1)[0])
        for line in cluster.logs(coordinator.name, timestamps=True).splitlines()
        if "coordinator listening on" in line
    ]
    restarted, serving = docker_time(started) - killed_at, listening[-1] - killed_at
    print(
        f"MEASURED coordinator pod restart: {match.group(1)} steps, longest step {match.group(2)}s; after the "
        f"kill the process restarted at {restarted:.2f}s, served at {serving:.2f}s"
    )


ELASTIC_VICTIM = 0  # the completion index whose pod is killed: rank 0, whose state the others started from


@pytest.mark.timeout(900)
@pytest.mark.parametrize("cluster", ["elastic"], indirect=True)
def test_a_restarted_worker_pod_rejoins_the_elastic_job(cluster: Cluster) -> None:
    """Issue #14: a worker pod of the elastic Indexed Job is killed mid-training; the Job controller (its
    rules applied to the manifest's spec) makes a new pod for that index with the same environment,
    which rejoins the running job as a newcomer; every rank ends with the same weights."""
    deployment, job, template = job_parts(cluster.docs)
    (container,) = template["spec"]["containers"]
    assert container["command"] == ["python", "-m", "collsvc.elastic.rejoin"], container["command"]
    script = (HERE / "elastic_pod_job.py").read_text()
    training = with_worker(job, args=["-c", script], env={"ELASTIC_SECONDS": "10"})
    world = int(job["spec"]["completions"])
    controller = IndexedJob(training["spec"])
    coordinator = coordinator_pod(cluster, deployment)
    workers = [worker_pod(cluster, training, i, controller) for i in range(world)]
    cluster.register(coordinator, *workers)
    cluster.start(coordinator)
    wait_ready(cluster, coordinator, probe_port(deployment, "readinessProbe"), 60)
    for pod in workers:
        cluster.start(pod)
    wait_for_logs(cluster, workers, f"of {world} training", 120)
    victim = workers[ELASTIC_VICTIM]
    run(["kill", "-KILL", str(cluster.app_state(victim.name, "Pid"))])
    killed_at = time.time()
    exit_code = cluster.wait_exit(victim.name, 60)
    assert exit_code == 128 + signal.SIGKILL, cluster.logs(victim.name)
    assert controller.pod_failed(ELASTIC_VICTIM, container["name"], exit_code) == RESTART
    cluster.terminate(victim.name)
    replacement = worker_pod(cluster, training, ELASTIC_VICTIM, controller)
    assert replacement.ip != victim.ip and replacement.annotations["batch.kubernetes.io/job-index-failure-count"] == "1"
    cluster.register(replacement)
    cluster.start(replacement)
    finishing = [pod for pod in workers if pod is not victim] + [replacement]
    codes = {pod.name: cluster.wait_exit(pod.name, JOB_TIMEOUT_S) for pod in finishing}
    why = explain(cluster, [*finishing, victim], codes)
    assert set(codes.values()) == {0}, why
    assert "already runs; joining it as a newcomer" in cluster.logs(replacement.name), why
    finals = {}
    for pod in finishing:
        (line,) = [ln for ln in cluster.logs(pod.name).splitlines() if ln.startswith("finished: ")]
        finals[pod.name] = json.loads(line.removeprefix("finished: "))
    assert sorted(f["rank"] for f in finals.values()) == list(range(world)), why  # the replacement admitted
    first = finals[finishing[0].name]
    assert all(f["size"] == world and f["step"] == first["step"] and f["w"] == first["w"] for f in finals.values()), why
    expected = reference(first["step"])
    assert max(abs(a - b) for a, b in zip(first["w"], expected, strict=True)) < 1e-9, why
    # From the kill: the survivors' re-formed membership (none when the replacement was in time for
    # their first re-form), then the replacement's admission.
    reformed = training_started(cluster.logs(finishing[0].name, timestamps=True), world - 1)
    replacement_log = cluster.logs(replacement.name, timestamps=True)
    asked = logged_at(replacement_log, r"collsvc\.elastic\.rejoin: .* already runs; .*")
    admitted = logged_at(replacement_log, rf"rank \d+ of {world} training from step \d+")
    assert asked is not None and admitted is not None, why
    survivors = "n/a" if reformed is None else f"{reformed - killed_at:.2f}s"
    print(
        f"MEASURED elastic pod restart: survivors training again {survivors} after the kill; the replacement "
        f"found the job running {asked - killed_at:.2f}s and was admitted {admitted - killed_at:.2f}s after it; "
        f"{first['step']} steps, longest step {max(f['longest_step_s'] for f in finals.values())}s"
    )


def docker_time(stamp: str) -> float:
    """Seconds since the epoch of an engine time stamp (RFC 3339 in UTC, nanoseconds)."""
    return datetime.fromisoformat(stamp[:26].rstrip("Z") + "+00:00").timestamp()


def logged_at(timestamped_log: str, pattern: str) -> float | None:
    """When the first line of ``docker logs --timestamps`` output that matches ``pattern`` was written."""
    for line in timestamped_log.splitlines():
        stamp, _, text = line.partition(" ")
        if re.fullmatch(pattern, text):
            return docker_time(stamp)
    return None


def training_started(timestamped_log: str, size: int) -> float | None:
    """When the first ``rank r of SIZE training`` line was written."""
    return logged_at(timestamped_log, rf"rank \d+ of {size} training from step \d+")
