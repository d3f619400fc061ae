"""Docker engines for the container tests: the machine's engine (started here when none runs), and one
engine per network namespace for the two-host compose run.

An engine this module starts is stopped again, and the firewall state it changed (iptables tables,
the FORWARD policy, IP forwarding, the docker0 bridge) is put back as it was. Installing the engine
(``scripts/install_docker.sh``) needs root and apt; without them, or when the engine cannot start, the
tests skip and say why.

Cached between runs, under ``$COLLSVC_CONTAINER_CACHE`` (default ``~/.cache/collsvc-containers``): the
base image's root file system (``scripts/build_base_image.sh``), the compose plugin's package, the data
roots of the namespace engines; images are reused when the hash of what they are built from matches.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("COLLSVC_CONTAINER_CACHE", str(Path.home() / ".cache" / "collsvc-containers")))
BASE_IMAGE = "collsvc-base:bookworm"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# What docker/Dockerfile copies from the build context (see .dockerignore).
IMAGE_INPUTS = ("docker/Dockerfile", "pyproject.toml", "README.md", "collsvc", "examples")


class EngineUnavailable(Exception):
    """This machine cannot run a Docker engine; the message says why."""


def run(
    argv: list[str], *, host: str | None = None, timeout: float = 300.0, check: bool = True, **kw: object
) -> subprocess.CompletedProcess[str]:
    """Runs a command (with ``DOCKER_HOST`` set to ``host`` when given) and returns its output.

    Raises:
        AssertionError: ``check`` and the command failed; the message has its output.
    """
    env = dict(os.environ)
    if host:
        env["DOCKER_HOST"] = host
    env.update(kw.pop("env", {}) or {})  # type: ignore[call-overload]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False, **kw)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc  # type: ignore[no-any-return]


def engine_answers(host: str | None = None) -> bool:
    """Whether a Docker engine answers at ``host`` (default: the docker CLI's default)."""
    if not shutil.which("docker"):
        return False
    return (
        run(["docker", "version", "--format", "{{.Server.Version}}"], host=host, check=False, timeout=30).returncode
        == 0
    )


def _wait_until_answers(proc: subprocess.Popen[bytes], host: str | None, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not engine_answers(host):
        if proc.poll() is not None:
            raise EngineUnavailable(f"dockerd exited with {proc.returncode}: {log.read_text()[-1500:]}")
        if time.monotonic() > deadline:
            raise EngineUnavailable(f"dockerd did not answer within {START_TIMEOUT_S:g}s: {log.read_text()[-1500:]}")
        time.sleep(0.2)  # polling a daemon's socket: there is no event to wait on


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------- firewall


@dataclass(frozen=True)
class FirewallState:
    """What a Docker engine changes on the host: the iptables tables and IP forwarding."""

    iptables: str
    ip_forward: str

    @classmethod
    def capture(cls) -> FirewallState:
        saved = run(["iptables-save"], check=False).stdout if shutil.which("iptables-save") else ""
        return cls(saved, Path("/proc/sys/net/ipv4/ip_forward").read_text().strip())

    def restore(self) -> None:
        """Puts every table back as captured; tables created since are emptied (built-in chains ACCEPT)."""
        if shutil.which("iptables-restore"):
            before = _tables(self.iptables)
            now = run(["iptables-save"], check=False).stdout
            text = self.iptables
            for table, chains in _tables(now).items():
                if table not in before:
                    text += f"*{table}\n" + "".join(f"{chain} ACCEPT [0:0]\n" for chain in chains) + "COMMIT\n"
            if text.strip():
                run(["iptables-restore"], input=text)
        Path("/proc/sys/net/ipv4/ip_forward").write_text(self.ip_forward + "\n")


def _tables(saved: str) -> dict[str, list[str]]:
    """``{table: [":CHAIN POLICY", ...]}`` of the built-in chains in iptables-save output."""
    tables: dict[str, list[str]] = {}
    current: list[str] = []
    for line in saved.splitlines():
        if line.startswith("*"):
            current = tables.setdefault(line[1:], [])
        elif line.startswith(":") and line.split()[1] != "-":
            current.append(line.split()[0])
    return tables


# --------------------------------------------------------------------------------------- engines


@dataclass
class Engine:
    """A Docker engine the tests talk to; ``host`` is its ``DOCKER_HOST`` (None: the CLI default)."""

    host: str | None
    started: bool
    proc: subprocess.Popen[bytes] | None = None
    firewall: FirewallState | None = None
    _cleanups: list[list[str]] = field(default_factory=list)

    def docker(
        self, *args: str, timeout: float = 300.0, check: bool = True, **kw: object
    ) -> subprocess.CompletedProcess[str]:
        return run(["docker", *args], host=self.host, timeout=timeout, check=check, **kw)

    def image_id(self, image: str) -> str | None:
        proc = self.docker("image", "inspect", "--format", "{{.Id}}", image, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None

    def stop(self) -> None:
        """Stops the engine if this module started it, and restores the firewall state."""
        if self.proc is not None:
            _stop(self.proc)
        for argv in self._cleanups:
            run(argv, check=False)
        if self.firewall is not None:
            self.firewall.restore()


def _install() -> None:
    if os.geteuid() != 0:
        raise EngineUnavailable("no Docker engine answers and installing one needs root")
    if not shutil.which("apt-get"):
        raise EngineUnavailable("no Docker engine answers and this machine has no apt-get to install one")
    proc = run(["bash", str(ROOT / "scripts" / "install_docker.sh")], check=False, timeout=600)
    if proc.returncode != 0:
        raise EngineUnavailable(f"scripts/install_docker.sh failed: {(proc.stdout + proc.stderr)[-1500:]}")


def machine_engine() -> Engine:
    """The machine's Docker engine: the running one, else one installed if needed and started here.

    Raises:
        EngineUnavailable: no engine runs and none can be installed or started (the reason says why).
    """
    if engine_answers() and run(["docker", "compose", "version"], check=False).returncode == 0:
        return Engine(host=None, started=False)
    if not shutil.which("dockerd") or not shutil.which("debootstrap") or not _compose_present():
        _install()
    if engine_answers():
        return Engine(host=None, started=False)
    if os.geteuid() != 0:
        raise EngineUnavailable("no Docker engine answers and starting one needs root")
    CACHE.mkdir(parents=True, exist_ok=True)
    firewall = FirewallState.capture()
    had_bridge = Path("/sys/class/net/docker0").exists()
    log = CACHE / "dockerd.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    engine = Engine(host=None, started=True, proc=proc, firewall=firewall)
    if not had_bridge:
        engine._cleanups.append(["ip", "link", "delete", "docker0"])
    try:
        _wait_until_answers(proc, None, log)
    except BaseException:
        engine.stop()
        raise
    return engine


def _compose_present() -> bool:
    return bool(shutil.which("docker")) and run(["docker", "compose", "version"], check=False).returncode == 0


@contextmanager
def namespace_engine(name: str, namespace: str, hostname: str) -> Iterator[Engine]:
    """A Docker engine whose containers live in network namespace ``namespace`` ("a host").

    The engine runs with its own data root (cached: images loaded once stay), exec root and socket, no
    bridge and no iptables rules: containers use host networking, i.e. the namespace's network. Its
    own UTS namespace gives it (and its host-network containers) the host name ``hostname``.
    ``ip netns exec`` would remount /sys, after which dockerd fails with "Devices cgroup isn't
    mounted", hence nsenter.
    """
    data_root = CACHE / "engines" / name
    exec_root = Path(f"/run/collsvc-docker-{name}")
    socket = f"/run/collsvc-docker-{name}.sock"
    data_root.mkdir(parents=True, exist_ok=True)
    log = CACHE / f"dockerd-{name}.log"
    dockerd = (
        f"hostname {hostname} && exec dockerd --data-root {data_root} --exec-root {exec_root} -H unix://{socket} "
        f"--pidfile /run/collsvc-docker-{name}.pid --bridge=none --iptables=false --ip-forward=false --ip-masq=false"
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "sh", "-c", dockerd],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    engine = Engine(host=f"unix://{socket}", started=True, proc=proc)
    try:
        _wait_until_answers(proc, engine.host, log)
        yield engine
    finally:
        engine.stop()


def copy_image(image: str, source: Engine, target: Engine) -> None:
    """Makes ``image`` exist in ``target`` as in ``source`` (``docker save | docker load`` when it differs)."""
    if target.image_id(image) == source.image_id(image):
        return
    env = dict(os.environ)
    saver_env = dict(env)
    saver_env.pop("DOCKER_HOST", None)
    if source.host:
        saver_env["DOCKER_HOST"] = source.host
    loader_env = dict(env)
    loader_env["DOCKER_HOST"] = target.host or ""
    saver = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE, env=saver_env)
    loaded = subprocess.run(
        ["docker", "load", "-q"], stdin=saver.stdout, capture_output=True, text=True, env=loader_env
    )
    assert saver.stdout is not None
    saver.stdout.close()
    assert saver.wait() == 0 and loaded.returncode == 0, f"docker save | docker load failed: {loaded.stderr}"


# ---------------------------------------------------------------------------------------- images


def content_hash(paths: tuple[str, ...], *extra: str) -> str:
    """SHA-256 (16 hex digits) over the files under ``paths`` (relative to the repo) and ``extra``."""
    digest = hashlib.sha256()
    for item in extra:
        digest.update(item.encode() + b"\0")
    for rel in paths:
        top = ROOT / rel
        files = sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top]
        for path in files:
            if "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo", ".so"):
                continue
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def build_images(engine: Engine, image: str) -> str:
    """Builds the base image (unless ``COLLSVC_TEST_BASE_IMAGE`` names one) and the project image ``image``.

    The commands are docs/deploy.md's, plus a label with the hash of the build inputs: when ``image``
    already carries the current hash it is reused as it is. Returns the BASE_IMAGE it was built from.

    Raises:
        AssertionError: a build failed (with its output).
        EngineUnavailable: no base image can be built here.
    """
    base = os.environ.get("COLLSVC_TEST_BASE_IMAGE", "")
    if not base:
        base = BASE_IMAGE
        if not shutil.which("debootstrap"):
            if os.geteuid() != 0:
                raise EngineUnavailable(
                    "building the base image needs root and debootstrap; where a registry answers, set "
                    "COLLSVC_TEST_BASE_IMAGE=python:3.12-slim"
                )
            _install()
        run(["scripts/build_base_image.sh", base], host=engine.host, cwd=ROOT, timeout=900)
    inputs = content_hash(IMAGE_INPUTS, engine.image_id(base) or base)
    label = engine.docker(
        "image", "inspect", "--format", '{{index .Config.Labels "org.collsvc.inputs"}}', image, check=False
    )
    if label.returncode != 0 or label.stdout.strip() != inputs:
        engine.docker(
            "build", "-f", "docker/Dockerfile", "--build-arg", f"BASE_IMAGE={base}", "-t", image,
            "--label", f"org.collsvc.inputs={inputs}", ".",
            cwd=ROOT, env={"DOCKER_BUILDKIT": "0"}, timeout=900,
        )  # fmt: skip
    return base
