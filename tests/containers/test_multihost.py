"""docker/compose.multihost.yaml across two hosts: two Docker engines, each in its own network namespace
(its own addresses, host name and engine), joined by a bridge. Host A runs the coordinator and two
workers, host B two workers: a world of 4, shared memory within each host and gRPC across. The
commands are the ones docs/deploy.md gives for host A and host B."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator

import pytest

from tests.containers.conftest import compose_down, compose_env
from tests.containers.engine import ROOT, Engine, copy_image, namespace_engine
from tests.containers.test_compose import JOB_TIMEOUT_S
from tests.netns import topology

MULTIHOST = ["docker/compose.multihost.yaml"]
WORKERS_PER_HOST = 2
WORLD_SIZE = 2 * WORKERS_PER_HOST


@pytest.fixture(scope="module")
def two_hosts(engine: Engine, image: str) -> Iterator[dict[str, tuple[topology.Host, Engine]]]:
    reason = topology.available()
    if reason:
        pytest.skip(reason)
    with (
        topology.hosts(["a", "b"]) as hosts,
        namespace_engine("host-a", hosts["a"].namespace, "collsvc-host-a") as engine_a,
        namespace_engine("host-b", hosts["b"].namespace, "collsvc-host-b") as engine_b,
    ):
        copy_image(image, engine, engine_a)
        copy_image(image, engine, engine_b)
        yield {"a": (hosts["a"], engine_a), "b": (hosts["b"], engine_b)}


def start_job(argv: list[str], env: dict[str, str], engine: Engine) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, **env, "DOCKER_HOST": engine.host or ""}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


@pytest.mark.timeout(900)
def test_two_hosts_two_engines(two_hosts: dict[str, tuple[topology.Host, Engine]], token_file: object) -> None:
    host_a, engine_a = two_hosts["a"]
    host_b, engine_b = two_hosts["b"]
    common = {
        "COORDINATOR_ADDR": f"{host_a.address}:29400",
        "WORLD_SIZE": str(WORLD_SIZE),
        "WORKERS_PER_HOST": str(WORKERS_PER_HOST),
        "PEER_PORT": "0",
        "WORKER_IPC": "host",
    }
    env_a = compose_env(token_file, "csvmha", ADVERTISE_ADDR=host_a.address, **common)  # type: ignore[arg-type]
    env_b = compose_env(token_file, "csvmhb", ADVERTISE_ADDR=host_b.address, **common)  # type: ignore[arg-type]
    script = ["scripts/compose_job.sh", "-f", MULTIHOST[0]]
    jobs = {}
    try:
        jobs["a"] = start_job([*script, "--profile", "coordinator"], env_a, engine_a)
        jobs["b"] = start_job(script, env_b, engine_b)
        outputs = {}
        for name, proc in jobs.items():
            outputs[name], _ = proc.communicate(timeout=JOB_TIMEOUT_S)
        for name, proc in jobs.items():
            assert proc.returncode == 0, f"host {name}:\n{outputs[name][-5000:]}"
            finished = re.findall(r"^worker \S+: exited, exit code (\d+)$", outputs[name], re.M)
            assert finished == ["0"] * WORKERS_PER_HOST, outputs[name][-5000:]
        both = outputs["a"] + outputs["b"]
        assert f"weights identical on all {WORLD_SIZE} ranks: True" in both, both[-5000:]
        assert "(matches: True)" in both
    finally:
        for proc in jobs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        compose_down(MULTIHOST, {**env_a, "COMPOSE_PROFILES": "coordinator"}, engine_a.host)
        compose_down(MULTIHOST, env_b, engine_b.host)
