"""Which GPU this process runs on, and which backend a job uses given every member's device.

``local_device`` is what a member reports when it joins; ``choose_backend`` runs on every member over the
same member table once the job is complete, so every member reaches the same decision without talking
to the others. Nothing here imports CuPy at module import time.

A member reports kind ``"cuda"`` only when it can run the NCCL backend: CuPy imports, CuPy can load the
NCCL library, and a GPU is visible. Otherwise it reports ``"cpu"``, so ``backend="auto"`` never picks NCCL
for a job where one member could not run it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from collsvc.client.backends.nccl.probe import INSTALL_HINT, load_cupy, unavailable_reason
from collsvc.errors import BackendUnavailableError, RendezvousError
from collsvc.proto.v1 import common_pb2

log = logging.getLogger(__name__)

_BACKENDS = ("auto", "nccl", "ring")


def _cupy() -> Any:
    """CuPy when the NCCL backend can run here (``load_cupy`` succeeds); else None. Never raises."""
    try:
        return load_cupy()[0]
    except Exception:
        return None


@functools.lru_cache(maxsize=1)
def cupy_available() -> bool:
    """Whether this process can run the NCCL backend: CuPy, its NCCL library and a visible GPU (cached)."""
    return _cupy() is not None


def _why_no_gpu() -> str:
    """What stops this process from running the NCCL backend, in words (with the fix)."""
    reason = unavailable_reason()
    return reason or f"CuPy with NCCL and a visible CUDA GPU are needed ({INSTALL_HINT})"


def _uuid_from_cupy(cupy: Any, index: int) -> str:
    """``GPU-xxxxxxxx-...`` from CUDA's device properties (used when NVML is unavailable)."""
    raw = cupy.cuda.runtime.getDeviceProperties(index).get("uuid", b"")
    if isinstance(raw, str):
        raw = raw.encode("latin-1")
    if len(raw) != 16:
        return ""
    h = bytes(raw).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _uuid_from_nvml(pci_bus_id: str) -> str:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id.encode())
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    finally:
        pynvml.nvmlShutdown()


def local_device(local_rank_hint: int | None = None) -> common_pb2.DeviceIdentity:
    """The device this process will use, as reported to the coordinator.

    The CUDA ordinal is ``local_rank_hint % device_count`` when a hint is given, else the current device.
    Ordinals are the ones this process sees (``CUDA_VISIBLE_DEVICES`` applies); the PCI bus id comes from
    CUDA for that ordinal and the UUID from NVML for that bus id (or from CUDA without NVML), so both
    name the physical GPU whatever the visible-device mapping. No CUDA context is created.

    Args:
        local_rank_hint: the launcher's local rank, if any.

    Returns:
        ``DeviceIdentity(kind="cuda", uuid=..., pci_bus_id=..., index=...)``, or ``kind="cpu"`` when CuPy,
        NCCL or a GPU is missing, or on any error. Never raises.
    """
    try:
        cupy = _cupy()
        if cupy is None:
            return common_pb2.DeviceIdentity(kind="cpu")
        count = int(cupy.cuda.runtime.getDeviceCount())
        index = local_rank_hint % count if local_rank_hint is not None else int(cupy.cuda.runtime.getDevice())
        pci_bus_id = str(cupy.cuda.Device(index).pci_bus_id)
        try:
            uuid = _uuid_from_nvml(pci_bus_id)
        except Exception as exc:
            log.debug("NVML unavailable (%s); taking the GPU UUID from CUDA", exc)
            uuid = _uuid_from_cupy(cupy, index)
        return common_pb2.DeviceIdentity(kind="cuda", uuid=uuid, pci_bus_id=pci_bus_id, index=index)
    except Exception as exc:
        log.warning("could not identify the local GPU (%s); reporting a CPU device", exc)
        return common_pb2.DeviceIdentity(kind="cpu")


def caller_gpu_context() -> Callable[[], AbstractContextManager[Any]]:
    """The calling thread's current CUDA device and CuPy stream, to enter again on another thread.

    CUDA's current device and CuPy's current stream belong to a thread. A GPU collective that runs on the
    communicator's worker thread (async, or queued behind one) must allocate on the caller's device and
    order itself on the caller's stream, as it would inline.

    Returns:
        A factory of context managers that make that device and stream current on the entering thread;
        one that does nothing when CuPy sees no GPU. Never raises.
    """
    try:
        import cupy

        device = cupy.cuda.Device()
        stream = cupy.cuda.get_current_stream()
    except Exception:
        return contextlib.nullcontext

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        with device:  # a Device object of this call alone (its enter/exit stack is per object)
            previous = cupy.cuda.get_current_stream()
            stream.use()  # use(), not "with stream": the caller may be inside "with stream" right now
            try:
                yield
            finally:
                previous.use()

    return enter


def _gpu_key(member: common_pb2.Member) -> tuple[str, str]:
    """What identifies a physical GPU: its UUID, else (host, PCI bus id), else (host, ordinal)."""
    d = member.device
    if d.uuid:
        return ("", d.uuid)
    if d.pci_bus_id:
        return (member.host, d.pci_bus_id)
    return (member.host, f"cuda:{d.index}")


def _gpu_name(member: common_pb2.Member) -> str:
    d = member.device
    return d.uuid or f"{d.pci_bus_id or f'cuda:{d.index}'} on {member.host or '?'}"


def _no_gpu(members: Sequence[common_pb2.Member]) -> list[common_pb2.Member]:
    return [m for m in members if m.device.kind != "cuda"]


def _shared_gpu(members: Sequence[common_pb2.Member]) -> tuple[common_pb2.Member, common_pb2.Member] | None:
    seen: dict[tuple[str, str], common_pb2.Member] = {}
    for m in sorted(members, key=lambda m: m.rank):
        if m.device.kind != "cuda":
            continue
        key = _gpu_key(m)
        if key in seen:
            return seen[key], m
        seen[key] = m
    return None


def _ranks_text(members: Sequence[common_pb2.Member]) -> str:
    shown = ", ".join(f"{m.rank} ({m.host or '?'})" for m in members[:8])
    more = f" and {len(members) - 8} more" if len(members) > 8 else ""
    return f"rank{'s' if len(members) > 1 else ''} {shown}{more}"


def choose_backend(requested: str, members: Sequence[common_pb2.Member], my_rank: int) -> tuple[str, str]:
    """Picks the job's backend from every member's device; the same answer on every member.

    Rules: ``"ring"`` is ring. ``"auto"`` is nccl when every member has a GPU and no two members share
    one, ring otherwise. ``"nccl"`` is nccl or an error: two processes on one GPU is an error NCCL
    would report only later and less clearly ("Duplicate GPU detected"), so it is caught here, before
    NCCL is touched.

    Args:
        requested: ``"auto"``, ``"nccl"`` or ``"ring"``.
        members: every member of the job with its reported device.
        my_rank: this process's rank (for messages).

    Returns:
        ``(backend name, reason for the log)``; the name is ``"nccl"`` or ``"ring"``.

    Raises:
        ValueError: ``requested`` is not one of the three names.
        BackendUnavailableError: ``"nccl"`` was requested and this process has no CuPy, NCCL or GPU.
        RendezvousError: ``"nccl"`` was requested and a member has no GPU, or two members share a GPU.
    """
    if requested not in _BACKENDS:
        raise ValueError(f"backend must be 'auto', 'nccl' or 'ring', got {requested!r}")
    if requested == "ring":
        return "ring", "backend='ring' requested"
    if requested == "nccl" and not cupy_available():
        raise BackendUnavailableError(
            f"backend='nccl' cannot run on rank {my_rank}: {_why_no_gpu()}; or use backend='ring'"
        )
    no_gpu = _no_gpu(members)
    shared = _shared_gpu(members)
    if requested == "auto":
        if not members:
            return "ring", "no member devices known; using ring"
        if no_gpu:
            return (
                "ring",
                f"{_ranks_text(no_gpu)} {'have' if len(no_gpu) > 1 else 'has'} no usable GPU; using ring",
            )
        if shared is not None:
            a, b = shared
            return (
                "ring",
                f"ranks {a.rank} and {b.rank} share GPU {_gpu_name(a)}; using ring with host staging",
            )
        return "nccl", f"every one of {len(members)} ranks has its own GPU; using nccl"
    if no_gpu:
        raise RendezvousError(
            f"backend='nccl' needs a GPU on every rank, but {_ranks_text(no_gpu)} reported none "
            "(no CuPy, no NCCL library or no visible GPU there); use backend='auto' or 'ring'"
        )
    if shared is not None:
        a, b = shared
        raise RendezvousError(
            f"backend='nccl' needs one GPU per rank, but ranks {a.rank} ({a.host or '?'}) and {b.rank} "
            f"({b.host or '?'}) share GPU {_gpu_name(a)}; give each rank its own GPU (set LOCAL_RANK or "
            "CUDA_VISIBLE_DEVICES per rank) or use backend='ring'"
        )
    return "nccl", f"backend='nccl' requested; every one of {len(members)} ranks has its own GPU"
