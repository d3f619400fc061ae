"""A real single-node Kubernetes for the whole test session: the project's image built once, loaded into
the cluster, the cluster brought up before the first test of this folder and down after the last.

The cluster is the test fixture ``../shared/k8s`` beside the repository (``cluster.sh``: install, images,
up, down, wipe). Without it, or without root, the tests skip and say so; where ``CI`` is set they fail
instead, since CI runs as root with ``../shared`` beside the clone.

``COLLSVC_K8S_KEEP=1`` keeps the cluster up after the session and reuses one already up (while
working on these tests); the image is still rebuilt and loaded when this checkout changed it.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.engine import ROOT, EngineUnavailable, build_images, content_hash, machine_engine, run
from tests.kubernetes.cluster import IMAGE_INPUTS, Kube

FIXTURE = Path(os.environ.get("COLLSVC_K8S_FIXTURE", str(ROOT.parent / "shared" / "k8s")))
WORK_DIR = Path(os.environ.get("COLLSVC_K8S_DIR", "/var/tmp/collsvc-k8s"))
BUILT = "collsvc:0.1.0"
KEEP = os.environ.get("COLLSVC_K8S_KEEP") == "1"
# pytest-timeout counts the session fixture's setup (image build, cluster up) in the first test's time.
SETUP_TIMEOUT_S = 900
TEST_TIMEOUT_S = 420


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    ours = [item for item in items if Path(str(item.fspath)).is_relative_to(Path(__file__).parent)]
    for number, item in enumerate(ours):
        item.add_marker(pytest.mark.kubernetes)
        item.add_marker(pytest.mark.timeout(SETUP_TIMEOUT_S if number == 0 else TEST_TIMEOUT_S))


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the real-cluster suite cannot run in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def kube() -> Iterator[Kube]:
    """The cluster, up with this checkout's image loaded as ``collsvc:k8s-<hash of its inputs>``."""
    if not (FIXTURE / "cluster.sh").is_file():
        _unavailable(f"no Kubernetes fixture at {FIXTURE} (cluster.sh); the real-cluster tests need it")
    if os.geteuid() != 0:
        _unavailable("bringing the Kubernetes fixture up needs root")
    script = ["bash", str(FIXTURE / "cluster.sh")]
    if not (shutil.which("containerd") and shutil.which("kubectl") and Path("/opt/etcd-3.5").is_dir()):
        run([*script, "install"], timeout=600)
    try:
        engine = machine_engine()
    except EngineUnavailable as exc:
        _unavailable(f"no Docker engine to build the image with: {exc}")
    kube = Kube(WORK_DIR / "pki" / "admin.kubeconfig", "", secrets.token_hex(32))
    reuse = KEEP and kube.node_ready()
    try:
        build_images(engine, BUILT)
        kube.image = f"collsvc:k8s-{content_hash(IMAGE_INPUTS, engine.image_id(BUILT) or '')}"
        engine.docker("tag", BUILT, kube.image)
        if reuse:  # `cluster.sh images` rewrites the running cluster's configuration (kube-proxy exits)
            engine.docker("save", kube.image, "-o", str(WORK_DIR / "images-app-1.tar"), timeout=600)
        else:
            run([*script, "images", kube.image], timeout=600)
    finally:
        engine.stop()  # its firewall changes undone before the cluster programs its own
    env = {"COLLSVC_K8S_DIR": str(WORK_DIR)}
    if reuse:
        kube.load_image(WORK_DIR)
        yield kube
        return
    run([*script, "down"], env=env, check=False, timeout=300)  # what a killed session left behind
    run([*script, "wipe"], env=env, check=False, timeout=120)
    try:
        run([*script, "up"], env=env, timeout=300)
        yield kube
    finally:
        if not KEEP:
            run([*script, "down"], env=env, check=False, timeout=300)
            run([*script, "wipe"], env=env, check=False, timeout=120)
