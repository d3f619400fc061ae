"""Kubernetes pods, run as Docker containers with what a kubelet would give them.

No cluster can be installed on the CI machines, so the rendered manifests are run here instead: each
pod is a "pause" container that owns the pod's network namespace (its IP, host name, the DNS names of
the Services that select it) plus the app container in that namespace, started with the container's
command and args (``$(VAR)`` expanded), its env (values, downward-API fields, ``JOB_COMPLETION_INDEX``
for Indexed Jobs), the Secret volume at its mountPath (mode and fsGroup), ``emptyDir`` volumes as tmpfs,
the securityContext (user, group, fsGroup, read-only root, dropped capabilities, no privilege
escalation) and the resources (memory limit, CPU limit, CPU request as shares).

NetworkPolicies are enforced with iptables in each pod's namespace: ingress to a selected pod is
allowed from the pods its rules select, on the listed ports, and from the node (kubelet probes,
``kubectl port-forward``); everything else is rejected (a real CNI drops; rejecting fails faster).
Like a CNI, the rules of every running pod are rewritten when a pod starts (a restarted pod has a new
IP) or stops.

The pod's ``restartPolicy`` is the app container's restart policy, as the kubelet applies it: the
engine starts the container again when its process exits (``Always``) or fails (``OnFailure``), in the
same pod (same IP, names and volumes). A pod that ends for good (:meth:`Cluster.terminate`) loses its
network; its app container stays for its logs.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.containers.engine import Engine, run

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
POD_DOMAIN = "svc.cluster.local"
# The kubelet restarts a container in place; the engine's restart policies do the same.
RESTART_POLICIES = {"Always": "always", "OnFailure": "on-failure", "Never": "no"}


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes, others stay."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, value)


def _memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    for suffix, scale in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * scale)
    return int(quantity)


def cpu_cores(quantity: str | int | float) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


@dataclass
class Pod:
    """One pod to run: its name, labels, annotations, spec, and the IP the test network gives it."""

    name: str
    namespace: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]
    ip: str
    hostname: str
    env_extra: dict[str, str] = field(default_factory=dict)

    @property
    def fields(self) -> dict[str, str]:
        """The downward-API fields a fieldRef may name."""
        out = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "status.podIP": self.ip,
            "spec.nodeName": "node-1",
            "spec.serviceAccountName": self.spec.get("serviceAccountName", "default"),
        }
        out.update({f"metadata.labels['{k}']": v for k, v in self.labels.items()})
        out.update({f"metadata.annotations['{k}']": v for k, v in self.annotations.items()})
        return out


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


class Cluster:
    """The rendered objects of one namespace, and the pods started from them in one Docker network."""

    def __init__(self, engine: Engine, docs: list[dict[str, Any]], *, tag: str, subnet: str, workdir: Path) -> None:
        self.engine = engine
        self.docs = docs
        self.tag = tag
        self.subnet = subnet  # "10.x.y", a /24
        self.network = f"csvk8s{tag}"
        self.workdir = workdir
        self.pods: dict[str, Pod] = {}
        self.containers: list[str] = []
        self._sandboxes: dict[str, str] = {}  # running pods: name -> pid of the pause container
        namespace = next(d for d in docs if d["kind"] == "Namespace")
        self.namespace = namespace["metadata"]["name"]
        # Kubernetes labels every namespace with its name.
        self.namespace_labels = {
            **namespace["metadata"].get("labels", {}),
            "kubernetes.io/metadata.name": self.namespace,
        }
        engine.docker("network", "create", "--subnet", f"{subnet}.0/24", "--gateway", f"{subnet}.1", self.network)

    @property
    def node_ip(self) -> str:
        """The host's address on the pod network (where kubelet probes come from)."""
        return f"{self.subnet}.1"

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def secret_files(self, name: str) -> dict[str, bytes]:
        (secret,) = [d for d in self.of_kind("Secret") if d["metadata"]["name"] == name]
        files = {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()}
        files.update({k: v.encode() for k, v in secret.get("stringData", {}).items()})
        return files

    # ------------------------------------------------------------------------------------- pods

    def pod(self, name: str, template: dict[str, Any], *, ip_suffix: int, hostname: str | None = None,
            annotations: dict[str, str] | None = None, extra_labels: dict[str, str] | None = None,
            env_extra: dict[str, str] | None = None) -> Pod:  # fmt: skip
        meta = template.get("metadata", {})
        return Pod(
            name=name,
            namespace=self.namespace,
            labels={**meta.get("labels", {}), **(extra_labels or {})},
            annotations={**meta.get("annotations", {}), **(annotations or {})},
            spec=template["spec"],
            ip=f"{self.subnet}.{ip_suffix}",
            hostname=hostname or name,
            env_extra=env_extra or {},
        )

    def _aliases(self, pod: Pod) -> list[str]:
        names = []
        for svc in self.of_kind("Service"):
            selector = svc["spec"].get("selector")
            if not selector or not selects(selector, pod.labels):
                continue
            svc_name = svc["metadata"]["name"]
            if svc["spec"].get("clusterIP") == "None":
                if pod.spec.get("subdomain") == svc_name:
                    names += [f"{pod.hostname}.{svc_name}", f"{pod.hostname}.{svc_name}.{self.namespace}.{POD_DOMAIN}"]
            else:
                # A ClusterIP Service: its name resolves to this (only) pod; ports map port -> targetPort.
                names += [svc_name, f"{svc_name}.{self.namespace}", f"{svc_name}.{self.namespace}.{POD_DOMAIN}"]
        return names

    def _policy_rules(self, pod: Pod) -> list[list[str]] | None:
        """iptables INPUT rules for the NetworkPolicies selecting ``pod`` (None: none selects it)."""
        policies = [
            p for p in self.of_kind("NetworkPolicy")
            if selects(p["spec"]["podSelector"].get("matchLabels", {}), pod.labels)
            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        ]  # fmt: skip
        if not policies:
            return None
        rules = [
            ["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
            ["-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            ["-A", "INPUT", "-s", self.node_ip, "-j", "ACCEPT"],
        ]
        for policy in policies:
            for rule in policy["spec"].get("ingress", []):
                sources: list[str] = []
                for peer in rule.get("from", []):
                    if "ipBlock" in peer:
                        raise AssertionError("ipBlock peers are not emulated")
                    if "namespaceSelector" in peer:
                        wanted = peer["namespaceSelector"].get("matchLabels", {})
                        if not selects(wanted, self.namespace_labels):
                            continue  # another namespace: none of the pods run here
                    selector = peer.get("podSelector", {}).get("matchLabels", {})
                    sources += [p.ip for p in self.pods.values() if selects(selector, p.labels)]
                for port in rule.get("ports", []):
                    for source in sources:
                        rules.append(
                            ["-A", "INPUT", "-s", source, "-p", "tcp", "--dport", str(port["port"]), "-j", "ACCEPT"]
                        )
        rules.append(["-A", "INPUT", "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"])
        return rules

    def register(self, *pods: Pod) -> None:
        """Makes ``pods`` known (their IPs and labels) before any starts, so NetworkPolicy rules can name them."""
        for pod in pods:
            self.pods[pod.name] = pod

    def _enforce_policies(self) -> None:
        """Rewrites every running pod's rules from the pods known now (``iptables-restore`` replaces the
        pod's filter table in one step, as a CNI updates its rules when pods come and go)."""
        for name, pid in self._sandboxes.items():
            rules = self._policy_rules(self.pods[name])
            if rules is None:
                continue
            table = "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
            table += "".join(" ".join(rule) + "\n" for rule in rules) + "COMMIT\n"
            run(["nsenter", "-t", pid, "-n", "iptables-restore"], input=table)

    def terminate(self, pod_name: str) -> None:
        """Ends ``pod_name`` for good, as after its last container exited: its IP and DNS names go, the
        other pods' rules forget it; the app container stays (exited) for :meth:`logs`."""
        self.engine.docker("rm", "--force", f"{self.network}-{pod_name}-pause", check=False)
        self._sandboxes.pop(pod_name, None)
        self.pods.pop(pod_name, None)
        self._enforce_policies()

    def start(self, pod: Pod, image_map: dict[str, str] | None = None) -> str:
        """Starts ``pod`` (one container: its spec must have exactly one); returns the app container's id."""
        self.pods[pod.name] = pod
        (spec_container,) = pod.spec["containers"]
        image = (image_map or {}).get(spec_container["image"], spec_container["image"])
        security = {**pod.spec.get("securityContext", {}), **spec_container.get("securityContext", {})}
        user = f"{security.get('runAsUser', '')}:{security.get('runAsGroup', '')}".strip(":")
        pause = f"{self.network}-{pod.name}-pause"
        argv = ["run", "-d", "--name", pause, "--network", self.network, "--ip", pod.ip, "--hostname", pod.hostname]
        for alias in self._aliases(pod):
            argv += ["--network-alias", alias]
        argv += ["--read-only", "--cap-drop", "ALL", "--entrypoint", "sleep", image, "infinity"]
        self.engine.docker(*argv)
        self.containers.append(pause)
        self._sandboxes[pod.name] = self.engine.docker("inspect", "--format", "{{.State.Pid}}", pause).stdout.strip()
        self._enforce_policies()
        argv = ["run", "-d", "--name", f"{self.network}-{pod.name}", "--network", f"container:{pause}"]
        argv += ["--restart", RESTART_POLICIES[pod.spec.get("restartPolicy", "Always")]]
        if user:
            argv += ["--user", user]
        if "fsGroup" in security:
            argv += ["--group-add", str(security["fsGroup"])]
        if security.get("readOnlyRootFilesystem"):
            argv.append("--read-only")
        for cap in security.get("capabilities", {}).get("drop", []):
            argv += ["--cap-drop", cap]
        for cap in security.get("capabilities", {}).get("add", []):
            argv += ["--cap-add", cap]
        if security.get("allowPrivilegeEscalation") is False:
            argv += ["--security-opt", "no-new-privileges"]
        resources = spec_container.get("resources", {})
        limits, requests = resources.get("limits", {}), resources.get("requests", {})
        if "memory" in limits:
            argv += ["--memory", str(_memory_bytes(limits["memory"]))]
        if "cpu" in limits:
            argv += ["--cpus", str(cpu_cores(limits["cpu"]))]
        if "cpu" in requests:
            argv += ["--cpu-shares", str(max(int(cpu_cores(requests["cpu"]) * 1024), 2))]
        argv += self._volumes(pod, spec_container, security)
        env = self._env(pod, spec_container)
        for name, value in env.items():
            argv += ["--env", f"{name}={value}"]
        entrypoint, args = self._argv(spec_container, image, env)
        argv += ["--entrypoint", entrypoint[0], image, *entrypoint[1:], *args]
        cid = self.engine.docker(*argv).stdout.strip()
        self.containers.append(f"{self.network}-{pod.name}")
        return cid

    def _env(self, pod: Pod, container: dict[str, Any]) -> dict[str, str]:
        env = dict(pod.env_extra)
        fields = pod.fields
        for item in container.get("env", []):
            if "valueFrom" in item:
                source = item["valueFrom"]
                if "fieldRef" in source:
                    path = source["fieldRef"]["fieldPath"]
                    assert path in fields, f"env {item['name']}: fieldRef {path} names nothing a pod has"
                    env[item["name"]] = fields[path]
                elif "secretKeyRef" in source:
                    ref = source["secretKeyRef"]
                    env[item["name"]] = self.secret_files(ref["name"])[ref["key"]].decode()
                else:
                    raise AssertionError(f"env {item['name']}: unsupported source {source}")
            else:
                env[item["name"]] = expand(str(item.get("value", "")), env)
        return env

    def _argv(self, container: dict[str, Any], image: str, env: dict[str, str]) -> tuple[list[str], list[str]]:
        config = self.engine.docker("image", "inspect", "--format", "{{json .Config}}", image).stdout
        image_config = json.loads(config)
        command = [expand(c, env) for c in container.get("command", [])]
        args = [expand(a, env) for a in container.get("args", [])]
        entrypoint = command or list(image_config.get("Entrypoint") or [])
        if not command and not args:
            args = list(image_config.get("Cmd") or [])
        assert entrypoint, "neither the container nor the image names a command"
        return entrypoint, args

    def _volumes(self, pod: Pod, container: dict[str, Any], security: dict[str, Any]) -> list[str]:
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        argv: list[str] = []
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            path = mount["mountPath"]
            if "secret" in volume:
                folder = self.workdir / f"{pod.name}-{mount['name']}-{secrets.token_hex(4)}"
                folder.mkdir(mode=0o755)
                mode = int(volume["secret"].get("defaultMode", 0o644))
                group = int(security.get("fsGroup", 0))
                for key, data in self.secret_files(volume["secret"]["secretName"]).items():
                    file = folder / key
                    file.write_bytes(data)
                    os.chown(file, 0, group)
                    file.chmod(mode)
                argv += ["--volume", f"{folder}:{path}:ro"]
            elif "emptyDir" in volume:
                size = volume["emptyDir"].get("sizeLimit")
                options = "mode=1777" + (f",size={_memory_bytes(size)}" if size else "")
                argv += ["--tmpfs", f"{path}:{options}"]
            else:
                raise AssertionError(f"volume {mount['name']}: only secret and emptyDir are emulated")
        return argv

    # -------------------------------------------------------------------------------- lifecycle

    def wait_exit(self, pod_name: str, timeout: float) -> int:
        """Waits for the app container of ``pod_name`` to exit; returns its exit code."""
        proc = self.engine.docker("wait", f"{self.network}-{pod_name}", timeout=timeout)
        return int(proc.stdout.strip())

    def logs(self, pod_name: str, *, timestamps: bool = False) -> str:
        """The app container's output (every run of it), each line prefixed with its time when asked."""
        flags = ["--timestamps"] if timestamps else []
        proc = self.engine.docker("logs", *flags, f"{self.network}-{pod_name}", check=False)
        return proc.stdout + proc.stderr

    def app_state(self, pod_name: str, field: str) -> int:
        """An integer of the app container's state: ``Pid`` (its process as the host sees it) or
        ``RestartCount`` (how often its restart policy started it again)."""
        path = "{{.RestartCount}}" if field == "RestartCount" else f"{{{{.State.{field}}}}}"
        return int(self.engine.docker("inspect", "--format", path, f"{self.network}-{pod_name}").stdout.strip())

    def close(self) -> None:
        for name in reversed(self.containers):
            self.engine.docker("rm", "--force", "--volumes", name, check=False)
        self.engine.docker("network", "rm", self.network, check=False)


def probe_grpc(address: str) -> subprocess.CompletedProcess[str]:
    """A kubelet gRPC probe: the standard health service at ``address``, no token."""
    return run(["collsvc", "health", "--coordinator", address], check=False, timeout=30)
