"""Mutual TLS: a client certificate signed by the CA is required (certificates made with openssl)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from collsvc.options import TlsFiles
from collsvc.proto.v1 import coordinator_pb2 as pb
from collsvc.proto.v1 import coordinator_pb2_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _key_and_csr(directory: Path, name: str, cn: str) -> None:
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(directory / f"{name}.key"), "-out", str(directory / f"{name}.csr"), "-subj", f"/CN={cn}",
    )  # fmt: skip


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "1", "-subj", "/CN=collsvc-test-ca",
    )  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        _key_and_csr(d, name, "localhost" if name == "server" else "rank")
        _openssl(
            "x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
            "-CAcreateserial", "-out", str(d / f"{name}.pem"), "-days", "1", "-extfile", str(d / "san.ext"),
        )  # fmt: skip
    return d


def test_mutual_tls(certs: Path, start_coordinator: Callable[..., Any]) -> None:
    tls = TlsFiles(cert=str(certs / "server.pem"), key=str(certs / "server.key"), ca=str(certs / "ca.pem"))
    thread, _ = start_coordinator(token=None, tls=tls)
    ca = (certs / "ca.pem").read_bytes()
    good = grpc.ssl_channel_credentials(ca, (certs / "client.key").read_bytes(), (certs / "client.pem").read_bytes())
    with grpc.secure_channel(thread.address, good) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        stub.SetKey(pb.SetKeyRequest(job_id="j", key="k", value=b"v"), timeout=10)
        assert stub.GetKey(pb.GetKeyRequest(job_id="j", key="k"), timeout=10).value == b"v"

    without_client_cert = grpc.ssl_channel_credentials(ca)
    with grpc.secure_channel(thread.address, without_client_cert) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetKey(pb.GetKeyRequest(job_id="j", key="k"), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
