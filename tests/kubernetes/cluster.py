"""Talking to the test cluster: apply a kustomization of the project as shipped (only the token and
the image tag replaced, plus the patches a scenario names), read the cluster's own state back as JSON,
and the pods' logs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from tests.containers.engine import IMAGE_INPUTS as ENGINE_IMAGE_INPUTS
from tests.containers.engine import ROOT

IMAGE_INPUTS = ENGINE_IMAGE_INPUTS
NAMESPACE = "collsvc"  # what the base kustomization sets
JOB = "collsvc-train"
WORKERS = "app.kubernetes.io/component=worker"
COORDINATORS = "app.kubernetes.io/component=coordinator"
POLL_S = 0.5  # the API server is polled: `kubectl wait` cannot wait for one of several conditions
T = TypeVar("T")


def stamp(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 time (the API's, or a log line's from --timestamps)."""
    text = text.rstrip("Z")
    whole, _, frac = text.partition(".")
    return datetime.fromisoformat(whole + "+00:00").timestamp() + (float(f"0.{frac}") if frac else 0.0)


def world_patch(size: int, cpu: str | None = None) -> list[dict[str, Any]]:
    """The three places the base says to change together for another world size (and the CPU request)."""
    ops: list[dict[str, Any]] = [
        {"op": "replace", "path": "/spec/completions", "value": size},
        {"op": "replace", "path": "/spec/parallelism", "value": size},
        {"op": "replace", "path": "/spec/template/spec/containers/0/env/1", "value": {
            "name": "COLLSVC_WORLD_SIZE", "value": str(size)}},
    ]  # fmt: skip
    if cpu is not None:
        ops.append({"op": "replace", "path": "/spec/template/spec/containers/0/resources/requests/cpu", "value": cpu})
    return ops


def run_script_patch(script: str, env: dict[str, str], *, keep_command: bool = False) -> list[dict[str, Any]]:
    """The worker runs ``python -c script`` (or the elastic overlay's rejoin module on ``-c script``)."""
    ops: list[dict[str, Any]] = [
        {"op": "add", "path": "/spec/template/spec/containers/0/args", "value": ["-c", script]},
    ]
    if not keep_command:
        ops.append({"op": "replace", "path": "/spec/template/spec/containers/0/command", "value": ["python"]})
    for name, value in env.items():
        entry = {"name": name, "value": value}
        ops.append({"op": "add", "path": "/spec/template/spec/containers/0/env/-", "value": entry})
    return ops


@dataclass
class Kube:
    """The running test cluster; ``image`` is this checkout's image as loaded into it, ``token`` the job
    token the scenarios put in place of the shipped placeholder."""

    kubeconfig: Path
    image: str
    token: str
    _followers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120.0, stdin: str | None = None) -> str:
        """Runs kubectl on the cluster and returns its output.

        Raises:
            AssertionError: ``check`` and kubectl failed (with its output).
        """
        proc = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True, text=True, timeout=timeout, input=stdin, check=False,
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {proc.returncode}: {proc.stderr[-3000:]}")
        return proc.stdout

    def node_ready(self) -> bool:
        """Whether a cluster answers with its node Ready."""
        if not self.kubeconfig.exists():
            return False
        out = self.kubectl("get", "nodes", "-o", "jsonpath={.items[*].status.conditions[?(@.type=='Ready')].status}",
                           check=False, timeout=20)  # fmt: skip
        return out.strip() == "True"

    def load_image(self, work_dir: Path) -> None:
        """Imports the image tars ``cluster.sh images`` wrote into the running cluster's containerd."""
        for tar in sorted(work_dir.glob("images-app-*.tar")):
            subprocess.run(
                ["ctr", "-a", "/run/k8s-containerd/containerd.sock", "-n", "k8s.io", "images", "import", str(tar)],
                check=True, capture_output=True, timeout=300,
            )  # fmt: skip

    def reset(self) -> None:
        """Removes what a previous scenario applied (the namespace and everything in it)."""
        for proc in self._followers:
            proc.kill()
            proc.wait()
        self._followers.clear()
        # The workloads and their pods, not the namespace: the namespace controller takes 10 s or more to
        # remove one, and the next apply recreates or updates everything else. Foreground: returns once
        # the pods are gone (a worker ends at SIGTERM, the coordinator drains at once).
        self.kubectl("delete", "job,deployment", "-n", NAMESPACE, "--all", "--ignore-not-found",
                     "--cascade=foreground", "--wait=true", timeout=180)  # fmt: skip

    def apply(self, kustomization: str, patches: list[dict[str, Any]] | None = None) -> float:
        """Applies ``deploy/k8s/<kustomization>`` with the token and image tag replaced and the JSON
        patches for the Job; returns the time (epoch seconds) just before the apply."""
        target = ROOT / "deploy" / "k8s" / kustomization
        name, _, tag = self.image.partition(":")
        with tempfile.TemporaryDirectory(prefix="collsvc-k8s-") as folder:
            here = Path(folder)
            (here / "token.txt").write_text(self.token + "\n")
            spec: dict[str, Any] = {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": NAMESPACE,
                "resources": [os.path.relpath(target, here)],
                "secretGenerator": [{"name": "collsvc-token", "behavior": "replace", "files": ["token=token.txt"]}],
                "images": [{"name": name, "newTag": tag}],
            }
            if patches:
                spec["patches"] = [{
                    "target": {"group": "batch", "version": "v1", "kind": "Job", "name": JOB},
                    "patch": json.dumps(patches),
                }]  # fmt: skip
            (here / "kustomization.yaml").write_text(json.dumps(spec))
            rendered = self.kubectl("kustomize", "--load-restrictor", "LoadRestrictionsNone", folder)
        assert f"image: {self.image}" in rendered and "PLACEHOLDER" not in rendered, rendered[:2000]
        applied_at = time.time()
        self.kubectl("apply", "-f", "-", stdin=rendered)
        return applied_at

    def get(self, *what: str) -> Any:
        """``kubectl get WHAT -o json`` in the job's namespace, parsed."""
        return json.loads(self.kubectl("get", "-n", NAMESPACE, *what, "-o", "json"))

    def job(self) -> dict[str, Any]:
        return self.get("job", JOB)  # type: ignore[no-any-return]

    def pods(self, selector: str = WORKERS) -> list[dict[str, Any]]:
        return self.get("pods", "-l", selector)["items"]  # type: ignore[no-any-return]

    def follow(self, pod: str) -> None:
        """Keeps ``pod``'s log from now on, also after the pod is deleted (see :meth:`logs`)."""
        out = open(self._followed(pod), "wb")  # noqa: SIM115 - closed when kubectl exits
        proc = subprocess.Popen(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), "logs", "-f", "--timestamps", "-n", NAMESPACE, pod],
            stdout=out, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        out.close()
        self._followers.append(proc)

    def _followed(self, pod: str) -> Path:
        return Path(tempfile.gettempdir()) / f"collsvc-k8s-{os.getpid()}-{pod}.log"

    def logs(self, pod: str, *, timestamps: bool = False) -> str:
        """The pod's log: the API's, or what :meth:`follow` kept once the pod is gone."""
        args = ["logs", "-n", NAMESPACE, pod] + (["--timestamps"] if timestamps else [])
        proc = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args], capture_output=True, text=True, timeout=60
        )
        kept = self._followed(pod)
        if proc.returncode == 0 or not kept.exists():
            return proc.stdout
        lines = kept.read_text(errors="replace").splitlines(keepends=True)
        return "".join(lines if timestamps else [line.partition(" ")[2] for line in lines])

    def delete_pod(self, pod: str) -> float:
        """Deletes a pod as an operator would (graceful, the pod's own grace period); returns when the
        delete was asked."""
        asked = time.time()
        self.kubectl("delete", "pod", "-n", NAMESPACE, pod, "--wait=false")
        return asked

    def until(self, what: str, check: Callable[[], T | None], timeout: float, explain: Callable[[], str]) -> T:
        """Polls ``check`` until it returns something other than None; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            found = check()
            if found is not None:
                return found
            assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s\n{explain()}"
            time.sleep(POLL_S)  # polling the API server: see POLL_S

    def story(self) -> str:
        """What went on, for a failure message: the Job, the pods, their logs, the namespace's events."""
        parts = [self.kubectl("get", "-n", NAMESPACE, "job,pods", "-o", "wide", check=False)]
        job = self.kubectl("get", "-n", NAMESPACE, "job", JOB, "-o", "jsonpath={.status}", check=False)
        parts.append(f"job status: {job}")
        for pod in self.get("pods")["items"]:
            name = pod["metadata"]["name"]
            parts.append(f"--- {name} ({pod['status'].get('phase')})\n{self.logs(name)[-2500:]}")
        events = self.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False)
        parts.append("--- events\n" + events[-4000:])
        return "\n".join(parts)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The object's status condition of type ``kind`` when it is True."""
    for cond in obj.get("status", {}).get("conditions", []) or []:
        if cond["type"] == kind and cond["status"] == "True":
            return cond  # type: ignore[no-any-return]
    return None


def finished(job: dict[str, Any]) -> str | None:
    """ "Complete" or "Failed" once the Job has finished, else None."""
    for kind in ("Complete", "Failed"):
        if condition(job, kind):
            return kind
    return None


def index_of(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"])


def logged_at(timestamped_log: str, pattern: str) -> float | None:
    """When the first line of ``kubectl logs --timestamps`` output matching ``pattern`` was written."""
    for line in timestamped_log.splitlines():
        when, _, text = line.partition(" ")
        if re.search(pattern, text):
            return stamp(when)
    return None
