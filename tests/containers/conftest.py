"""Session fixtures of the container tests: one Docker engine, the images, a job token."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.engine import ROOT, Engine, EngineUnavailable, build_images, machine_engine, run

VERSION = "0.1.0"
IMAGE = f"collsvc:{VERSION}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.containers)


@pytest.fixture(scope="package")
def engine() -> Iterator[Engine]:
    """The machine's Docker engine (started, and stopped after these tests, when none was running)."""
    try:
        found = machine_engine()
    except EngineUnavailable as exc:
        pytest.skip(f"no Docker engine: {exc}")
    try:
        yield found
    finally:
        found.stop()


@pytest.fixture(scope="package")
def image(engine: Engine) -> str:
    """``collsvc:<version>`` built from this checkout (reused when its inputs are unchanged)."""
    try:
        build_images(engine, IMAGE)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    return IMAGE


@pytest.fixture(scope="package")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job token readable by the containers' uid 10001, in a folder only root can list."""
    folder = tmp_path_factory.mktemp("secrets")
    folder.chmod(0o700)
    path = folder / "collsvc_token"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o644)
    return path


def compose_env(token_file: Path, project: str, **extra: str) -> dict[str, str]:
    """The environment of a compose command: the documented knobs plus a private project name."""
    return {
        "COLLSVC_TOKEN_PATH": str(token_file),
        "COMPOSE_PROJECT_NAME": f"{project}{os.getpid()}",
        "COMPOSE_ANSI": "never",
        # Free host ports: several compose projects may run at once (a test's and its fixture's).
        "COORDINATOR_PUBLISH": "127.0.0.1:0",
        "METRICS_PUBLISH": "127.0.0.1:0",
        **extra,
    }


def compose_down(files: list[str], env: dict[str, str], host: str | None = None) -> None:
    argv = ["docker", "compose"]
    for name in files:
        argv += ["-f", name]
    run([*argv, "down", "--timeout", "10", "--volumes"], host=host, env=env, cwd=ROOT, check=False, timeout=120)
