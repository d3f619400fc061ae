"""Local device identity: CPU without CuPy/GPU, never raising, and the CUDA UUID format."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import pytest

from collsvc.client import devices


def test_local_device_without_gpu_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_cupy", lambda: None)
    device = devices.local_device(3)
    assert device.kind == "cpu"
    assert device.uuid == ""


def test_local_device_on_this_machine_never_raises() -> None:
    device = devices.local_device(None)
    assert device.kind in ("cpu", "cuda")
    if device.kind == "cuda":
        assert device.uuid.startswith(("GPU-", "MIG-"))


def test_local_device_swallows_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> Any:
        raise RuntimeError("driver exploded")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=broken)))
    monkeypatch.setattr(devices, "_cupy", lambda: fake)
    assert devices.local_device(0).kind == "cpu"


def _fake_cupy(count: int, current: int) -> Any:
    uuid = bytes(range(16))

    class Device:
        def __init__(self, index: int) -> None:
            self.pci_bus_id = f"0000:{index + 0x10:02X}:00.0"

    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: count,
        getDevice=lambda: current,
        getDeviceProperties=lambda i: {"uuid": uuid},
    )
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=Device))


def test_local_device_uses_local_rank_modulo_count_and_cuda_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_cupy", lambda: _fake_cupy(count=2, current=0))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # NVML missing: the UUID comes from CUDA
    device = devices.local_device(3)
    assert device.kind == "cuda"
    assert device.index == 1
    assert device.pci_bus_id == "0000:11:00.0"
    assert device.uuid == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_local_device_without_hint_uses_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_cupy", lambda: _fake_cupy(count=4, current=2))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert devices.local_device(None).index == 2


def test_cupy_available_is_cached() -> None:
    assert devices.cupy_available() is devices.cupy_available()
    assert devices.cupy_available.cache_info().hits >= 1


def test_importing_collsvc_does_not_import_cupy() -> None:
    import subprocess

    code = (
        "import sys, collsvc, collsvc.client.devices, collsvc.client.backends.nccl.backend; "
        "assert 'cupy' not in sys.modules, 'cupy imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class _Stream:
    def __init__(self, cuda: _ThreadLocalCuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def use(self) -> None:
        self.cuda.local.stream = self.name

    def __enter__(self) -> None:
        self.previous = self.cuda.current()[1]
        self.use()

    def __exit__(self, *exc: object) -> None:
        self.cuda.local.stream = self.previous


class _ThreadLocalCuda:
    """CUDA's current device and CuPy's current stream, per thread, as the real ones are."""

    def __init__(self) -> None:
        self.local = threading.local()

    def current(self) -> tuple[int, str]:
        return getattr(self.local, "device", 0), getattr(self.local, "stream", "null")

    def _entering(self, attribute: str, value: Any) -> Any:  # the device only
        local = self.local

        class Entered:
            def __enter__(self) -> None:
                self.previous = getattr(local, attribute, 0)  # on the entering thread, as CUDA does
                setattr(local, attribute, value)

            def __exit__(self, *exc: object) -> None:
                setattr(local, attribute, self.previous)

        return Entered()

    def Device(self, index: int | None = None) -> Any:  # noqa: N802 - CuPy's name
        return self._entering("device", self.current()[0] if index is None else index)

    def Stream(self, name: str) -> Any:  # noqa: N802 - CuPy's name
        return _Stream(self, name)

    def get_current_stream(self) -> Any:
        return _Stream(self, self.current()[1])


def test_caller_gpu_context_carries_the_callers_device_and_stream_to_the_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = _ThreadLocalCuda()
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    seen: dict[str, tuple[int, str]] = {}
    with cuda.Device(3), cuda.Stream("caller-stream"):
        enter = devices.caller_gpu_context()

    def worker() -> None:
        seen["before"] = cuda.current()
        with enter():
            seen["inside"] = cuda.current()
        seen["after"] = cuda.current()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"before": (0, "null"), "inside": (3, "caller-stream"), "after": (0, "null")}


def test_caller_gpu_context_is_a_no_op_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with devices.caller_gpu_context()():
        pass
