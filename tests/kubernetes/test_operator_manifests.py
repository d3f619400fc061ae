"""The operator manifests of deploy/k8s/operators (a JobSet, a Kubeflow Trainer ClusterTrainingRuntime
and a TrainJob on it) checked by the real API server with the upstream CRDs installed
(``../shared/k8s/crds``): a server-side dry run validates each against the CRD's schema and its CEL
rules. No JobSet or Trainer controller runs here: these are validated, not run (docs/deploy.md)."""

from __future__ import annotations

import json

import pytest

from tests.containers.engine import ROOT
from tests.kubernetes.cluster import Kube
from tests.kubernetes.conftest import FIXTURE

OPERATORS = ROOT / "deploy" / "k8s" / "operators"
NAMESPACE = "collsvc-dry-run"
MANIFESTS = ["jobset.yaml", "kubeflow-trainer-runtime.yaml", "trainjob-example.yaml"]


@pytest.fixture(scope="module")
def with_crds(kube: Kube) -> Kube:
    for crd in sorted((FIXTURE / "crds").glob("*.yaml")):
        kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd), timeout=180)
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
    kube.kubectl("create", "namespace", NAMESPACE, check=False)
    return kube


def dry_run(kube: Kube, text: str) -> tuple[bool, str]:
    import subprocess

    proc = subprocess.run(
        ["kubectl", "--kubeconfig", str(kube.kubeconfig), "apply", "--dry-run=server", "-n", NAMESPACE,
         "-o", "json", "-f", "-"],
        input=text, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", MANIFESTS)
def test_operator_manifest_passes_a_server_side_dry_run(with_crds: Kube, name: str) -> None:
    ok, out = dry_run(with_crds, (OPERATORS / name).read_text())
    assert ok, out
    applied = json.loads(out)
    assert applied["metadata"]["name"] in ("collsvc", "collsvc-example")


def test_the_dry_run_rejects_what_the_crds_forbid(with_crds: Kube) -> None:
    """The check has teeth: a failure-policy action the JobSet API does not know is refused."""
    text = (OPERATORS / "jobset.yaml").read_text().replace("action: FailJobSet", "action: FailEverything")
    ok, out = dry_run(with_crds, text)
    assert not ok and "FailEverything" in out, out
