"""Backend selection from fabricated member tables: the same decision on every rank, errors before NCCL."""

from __future__ import annotations

import sys

import pytest

from collsvc.client import devices
from collsvc.client.backends.nccl.probe import INSTALL_HINT
from collsvc.client.devices import choose_backend
from collsvc.errors import BackendUnavailableError, RendezvousError
from collsvc.proto.v1 import common_pb2


def _gpu(rank: int, uuid: str, host: str = "h0", index: int = 0) -> common_pb2.Member:
    device = common_pb2.DeviceIdentity(kind="cuda", uuid=uuid, pci_bus_id=f"00000000:{index:02x}:00.0", index=index)
    return common_pb2.Member(rank=rank, host=host, device=device)


def _cpu(rank: int, host: str = "h0") -> common_pb2.Member:
    return common_pb2.Member(rank=rank, host=host, device=common_pb2.DeviceIdentity(kind="cpu"))


@pytest.fixture
def have_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "cupy_available", lambda: True)


@pytest.fixture
def no_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "cupy_available", lambda: False)


DISTINCT = [_gpu(0, "GPU-aaaa", index=0), _gpu(1, "GPU-bbbb", index=1), _gpu(2, "GPU-cccc", host="h1")]
SHARED = [_gpu(0, "GPU-aaaa"), _gpu(1, "GPU-bbbb", index=1), _gpu(2, "GPU-aaaa")]


def test_ring_is_ring_whatever_the_devices(no_cupy: None) -> None:
    assert choose_backend("ring", DISTINCT, 0)[0] == "ring"


def test_auto_with_distinct_gpus_is_nccl(no_cupy: None) -> None:
    # auto decides from the table alone, so every rank agrees
    name, reason = choose_backend("auto", DISTINCT, 1)
    assert name == "nccl"
    assert "own GPU" in reason


def test_auto_with_shared_gpu_is_ring_and_names_both_ranks() -> None:
    name, reason = choose_backend("auto", SHARED, 0)
    assert name == "ring"
    assert "ranks 0 and 2" in reason and "GPU-aaaa" in reason and "host staging" in reason


def test_auto_with_a_cpu_member_is_ring() -> None:
    name, reason = choose_backend("auto", [_gpu(0, "GPU-aaaa"), _cpu(1, host="h9")], 0)
    assert name == "ring"
    assert "rank 1 (h9)" in reason


def test_auto_without_members_is_ring() -> None:
    assert choose_backend("auto", [], 0)[0] == "ring"


def test_same_pci_bus_on_different_hosts_is_not_shared_without_uuid() -> None:
    a = _gpu(0, "", host="h0", index=0)
    b = _gpu(1, "", host="h1", index=0)
    assert choose_backend("auto", [a, b], 0)[0] == "nccl"
    c = _gpu(2, "", host="h0", index=0)
    assert choose_backend("auto", [a, b, c], 0)[0] == "ring"


def test_nccl_without_cupy_raises_with_install_hint(no_cupy: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # absent even where CuPy is installed
    with pytest.raises(BackendUnavailableError) as info:
        choose_backend("nccl", DISTINCT, 0)
    assert INSTALL_HINT in str(info.value)
    assert "pip install 'collsvc[cuda12]'" in str(info.value)


def test_nccl_with_shared_gpu_names_both_ranks_and_the_uuid(have_cupy: None) -> None:
    with pytest.raises(RendezvousError) as info:
        choose_backend("nccl", SHARED, 1)
    message = str(info.value)
    assert "ranks 0 (h0) and 2 (h0)" in message
    assert "GPU-aaaa" in message


def test_nccl_with_a_cpu_member_names_it(have_cupy: None) -> None:
    with pytest.raises(RendezvousError, match=r"rank 1 \(h1\)"):
        choose_backend("nccl", [_gpu(0, "GPU-aaaa"), _cpu(1, host="h1")], 0)


def test_nccl_with_distinct_gpus(have_cupy: None) -> None:
    assert choose_backend("nccl", DISTINCT, 2)[0] == "nccl"


def test_unknown_backend_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="gloo"):
        choose_backend("gloo", DISTINCT, 0)
