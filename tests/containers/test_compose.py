"""docker/compose.yaml on one host, run for real with the commands docs/deploy.md gives: a 4-rank job
over the compose network, the same job in one container over shared memory, and the coordinator's
production shape (non-root, read-only root, restart on crash, graceful SIGTERM, health = serving)."""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.conftest import compose_down, compose_env
from tests.containers.engine import ROOT, Engine, run

WORLD_SIZE = 4
COMPOSE = ["docker/compose.yaml"]
COMPOSE_SHM = ["docker/compose.yaml", "docker/compose.shm.yaml"]
JOB_TIMEOUT_S = 240


def compose_job(files: list[str], env: dict[str, str], host: str | None = None) -> subprocess.CompletedProcess[str]:
    """``scripts/compose_job.sh -f FILE...``, the documented way to run a compose job."""
    argv = ["scripts/compose_job.sh"]
    for name in files:
        argv += ["-f", name]
    return run(argv, host=host, env=env, cwd=ROOT, check=False, timeout=JOB_TIMEOUT_S)


def assert_job_succeeded(proc: subprocess.CompletedProcess[str], world_size: int, workers: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    finished = re.findall(r"^worker \S+: exited, exit code (\d+)$", proc.stdout, re.M)
    assert finished == ["0"] * workers, out[-6000:]
    assert f"job outcome: succeeded ({workers} of {workers} workers finished, all exit code 0)" in proc.stdout
    # Rank 0's result, printed after training: the cut-off that --abort-on-container-exit caused.
    assert f"weights identical on all {world_size} ranks: True" in proc.stdout, out[-6000:]
    assert "(matches: True)" in proc.stdout


def container(project_env: dict[str, str], service: str, engine: Engine) -> str:
    proc = run(
        ["docker", "compose", "-f", COMPOSE[0], "ps", "--all", "--quiet", service],
        host=engine.host, env=project_env, cwd=ROOT,
    )  # fmt: skip
    (cid,) = proc.stdout.split()
    return cid


def inspect(engine: Engine, cid: str, template: str) -> str:
    return engine.docker("inspect", "--format", template, cid).stdout.strip()


def scrape(address: str) -> str:
    """The text of ``http://ADDRESS/metrics``."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def wait_for(what: str, predicate: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} within {timeout:g}s"
        time.sleep(0.25)  # polling a container's state: the engine offers no event for it here


@pytest.fixture(scope="module")
def network_job(
    engine: Engine, image: str, token_file: Path
) -> Iterator[tuple[subprocess.CompletedProcess[str], dict[str, str]]]:
    """The 4-rank job over the compose network; its coordinator stays up for the shape checks."""
    env = compose_env(token_file, "csvnet", WORLD_SIZE=str(WORLD_SIZE))
    try:
        yield compose_job(COMPOSE, env, engine.host), env
    finally:
        compose_down(COMPOSE, env, engine.host)


@pytest.mark.timeout(900)
def test_four_rank_job_over_the_compose_network(
    network_job: tuple[subprocess.CompletedProcess[str], dict[str, str]],
) -> None:
    proc, _ = network_job
    assert_job_succeeded(proc, WORLD_SIZE, workers=WORLD_SIZE)


@pytest.mark.timeout(900)
def test_coordinator_production_shape(
    engine: Engine, network_job: tuple[subprocess.CompletedProcess[str], dict[str, str]]
) -> None:
    proc, env = network_job
    assert proc.returncode == 0, proc.stdout[-3000:]
    cid = container(env, "coordinator", engine)
    # Health means serving, from the host through the loopback-published port, without a token.
    port = run(
        ["docker", "compose", "-f", COMPOSE[0], "port", "coordinator", "29400"], env=env, cwd=ROOT
    ).stdout.strip()
    assert port.startswith("127.0.0.1:")
    run(["collsvc", "health", "--coordinator", port], timeout=30)
    if "--metrics-port" in (ROOT / COMPOSE[0]).read_text():
        # Prometheus /metrics, published on the host's loopback too.
        metrics = run(["docker", "compose", "-f", COMPOSE[0], "port", "coordinator", "9464"], env=env, cwd=ROOT)
        assert "collsvc_" in scrape(metrics.stdout.strip())
    # Non-root, read-only root file system, writable /tmp, no capabilities.
    assert engine.docker("exec", cid, "id", "-u").stdout.strip() == "10001"
    assert engine.docker("exec", cid, "touch", "/app/x", check=False).returncode != 0
    engine.docker("exec", cid, "touch", "/tmp/x")
    assert inspect(engine, cid, "{{.HostConfig.ReadonlyRootfs}} {{.HostConfig.CapDrop}}") == "true [ALL]"
    # A crash restarts it (restart: unless-stopped) and it becomes healthy again.
    restarts = int(inspect(engine, cid, "{{.RestartCount}}"))
    pid = int(inspect(engine, cid, "{{.State.Pid}}"))
    run(["kill", "-KILL", str(pid)])
    wait_for("the coordinator restarted", lambda: int(inspect(engine, cid, "{{.RestartCount}}")) > restarts, 60)
    wait_for(
        "the restarted coordinator is healthy",
        lambda: inspect(engine, cid, "{{.State.Health.Status}}") == "healthy",
        90,
    )
    # SIGTERM (docker stop) ends it gracefully: exit code 0, well before the 20 s SIGKILL.
    started = time.monotonic()
    engine.docker("stop", "--time", "20", cid, timeout=60)
    took = time.monotonic() - started
    assert inspect(engine, cid, "{{.State.ExitCode}}") == "0"
    assert took < 15, f"docker stop took {took:.1f}s: SIGTERM did not stop the coordinator"


@pytest.mark.timeout(900)
def test_shared_memory_job_in_one_container(engine: Engine, image: str, token_file: Path) -> None:
    env = compose_env(token_file, "csvshm", WORLD_SIZE=str(WORLD_SIZE))
    try:
        proc = compose_job(COMPOSE_SHM, env, engine.host)
        assert_job_succeeded(proc, WORLD_SIZE, workers=1)
    finally:
        compose_down(COMPOSE_SHM, env, engine.host)


@pytest.mark.timeout(600)
def test_failed_job_reports_the_exit_codes(engine: Engine, image: str, token_file: Path, tmp_path: Path) -> None:
    override = tmp_path / "fail.yaml"
    override.write_text('services:\n  worker:\n    command: ["-c", "import sys; sys.exit(3)"]\n')
    files = [*COMPOSE, str(override)]
    env = compose_env(token_file, "csvfail", WORLD_SIZE="2")
    try:
        proc = compose_job(files, env, engine.host)
    finally:
        compose_down(files, env, engine.host)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.findall(r"^worker \S+: exited, exit code (\d+)$", proc.stdout, re.M) == ["3", "3"]
    assert "job outcome: FAILED (2 of 2 workers finished; job exit code 3)" in proc.stdout


@pytest.mark.timeout(900)
def test_job_outlives_a_coordinator_container_restart(engine: Engine, image: str, token_file: Path) -> None:
    """Issue #19 against the compose file: the coordinator's process is SIGKILLed mid-training, the
    restart policy brings it back, the members re-register, and every worker finishes with exit 0."""
    files = [*COMPOSE, "tests/containers/compose.restart.yaml"]
    env = compose_env(token_file, "csvrestart", WORLD_SIZE="3", TRAIN_SECONDS="14")
    argv = ["scripts/compose_job.sh", "-f", files[0], "-f", files[1]]
    full_env = {**os.environ, **env, **({"DOCKER_HOST": engine.host} if engine.host else {})}
    job = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        logs = ["docker", "compose", "-f", files[0], "-f", files[1], "logs", "worker"]
        wait_for(
            "every worker training",
            lambda: run(logs, host=engine.host, env=env, cwd=ROOT, check=False).stdout.count(" training") >= 3,
            120,
        )
        cid = container(env, "coordinator", engine)
        pid = int(inspect(engine, cid, "{{.State.Pid}}"))
        run(["kill", "-KILL", str(pid)])
        out, _ = job.communicate(timeout=JOB_TIMEOUT_S)
        restarts = int(inspect(engine, cid, "{{.RestartCount}}"))
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        compose_down(files, env, engine.host)
    assert restarts >= 1, out[-4000:]
    assert job.returncode == 0, out[-6000:]
    assert "job outcome: succeeded (3 of 3 workers finished, all exit code 0)" in out, out[-6000:]
    match = re.search(r"restart job: (\d+) steps, all sums correct, longest step ([\d.]+)s", out)
    assert match is not None, out[-6000:]
    print(f"MEASURED coordinator container restart: {match.group(1)} steps, longest step {match.group(2)}s")
