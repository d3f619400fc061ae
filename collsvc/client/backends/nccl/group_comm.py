"""Loading CuPy's NCCL, and creating one NCCL communicator per group with a bounded wait.

``NcclCommunicator(...)`` (ncclCommInitRank) blocks until every member called it and cannot be
cancelled, so nothing calls it before all members passed a coordinator barrier, and even then it runs on
a helper thread the caller waits for with the call's deadline: a member that dies between the barrier
and the init costs a leaked daemon thread, never a hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from collsvc.client.backends.base import GroupSpec
from collsvc.client.backends.nccl.dtypes import NCCL_P2P_MIN_VERSION
from collsvc.client.backends.nccl.watchdog import FailureSource, as_collsvc_error
from collsvc.errors import CollectiveTimeoutError, CollsvcError

UID_BYTES = 128

Barrier = Callable[[str, float], None]
"""``barrier(name, timeout)``: returns once every member of the group entered the named barrier."""


class KeyValueLike(Protocol):
    """The job's key/value store (the coordinator's), as the NCCL backend needs it."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float) -> bytes:
        """Waits up to ``timeout`` seconds for ``key`` to be set and returns its value."""
        ...


def nccl_version(nccl: Any) -> int:
    try:
        return int(nccl.get_version())
    except Exception:
        return 0


def has_p2p(nccl: Any) -> bool:
    return nccl_version(nccl) >= NCCL_P2P_MIN_VERSION and hasattr(nccl.NcclCommunicator, "send")


def unique_id(nccl: Any) -> bytes:
    """``ncclGetUniqueId`` as the 128 bytes the key/value store carries.

    CuPy >= 14 returns ``bytes``; older CuPy returns a tuple of C ``char`` values (signed on x86-64).

    Raises:
        CollsvcError: NCCL returned an id of another length.
    """
    raw = nccl.get_unique_id()
    return _checked(bytes(raw) if isinstance(raw, (bytes, bytearray)) else bytes(int(v) & 0xFF for v in raw))


def _checked(data: bytes) -> bytes:
    if len(data) != UID_BYTES:
        raise CollsvcError(f"NCCL unique id has {len(data)} bytes, expected {UID_BYTES}")
    return data


def _as_chars(data: bytes, signed: bool) -> tuple[int, ...]:
    return tuple(b - 256 if signed and b > 127 else b for b in data)


def new_communicator(nccl: Any, size: int, data: bytes, index: int) -> Any:
    """``NcclCommunicator(size, id, index)`` with the id in the form this CuPy takes.

    CuPy >= 14 takes ``bytes``; older CuPy takes a tuple of C ``char`` values, signed on x86-64 and
    unsigned on aarch64. A wrong form fails in argument conversion (``TypeError``/``OverflowError``),
    before ``ncclCommInitRank`` runs, so trying the forms in turn is safe.

    Raises:
        CollsvcError: ``data`` is not 128 bytes.
        Exception: whatever NCCL raises (``NcclError``), e.g. for a duplicate GPU.
    """
    _checked(data)
    try:
        return nccl.NcclCommunicator(size, data, index)
    except TypeError:
        pass
    try:
        return nccl.NcclCommunicator(size, _as_chars(data, signed=True), index)
    except OverflowError:
        return nccl.NcclCommunicator(size, _as_chars(data, signed=False), index)


class GroupComm:
    """One group's NCCL communicator, the device it is bound to and its dedicated stream.

    ``lock`` is held while enqueuing and while polling the asynchronous error, so ``abort`` (from the
    watchdog or another thread) does not free the communicator under a running call, unless that call
    is stuck past the grace period: then it aborts anyway, which is what releases the stuck call.
    """

    def __init__(self, comm: Any, stream: Any, device: int, group: GroupSpec) -> None:
        self.comm = comm
        self.stream = stream
        self.device = device
        self.group = group
        self.lock = threading.Lock()
        self.aborted = False
        self.lane = id(self)  # the watchdog's queue of this communicator's operations
        self.stream_ptr = int(stream.ptr)
        self.ready: Any = None  # the event the stream waits on before each operation (set at creation)

    def check_async(self) -> None:
        with self.lock:
            if not self.aborted:
                self.comm.check_async_error()

    def abort(self, wait: float) -> None:
        got = self.lock.acquire(timeout=wait)
        try:
            if not self.aborted:
                self.aborted = True
                self.comm.abort()
        finally:
            if got:
                self.lock.release()

    def destroy(self) -> None:
        with self.lock:
            if not self.aborted:
                self.aborted = True
                self.comm.destroy()


def create_group_comm(
    cupy: Any,
    nccl: Any,
    group: GroupSpec,
    device: int,
    *,
    kv: KeyValueLike,
    barrier: Barrier,
    failure: FailureSource,
    deadline: float,
) -> GroupComm:
    """Exchanges the unique id, waits for every member, then creates the communicator.

    Raises:
        CollectiveTimeoutError: the init did not finish by ``deadline``.
        CollsvcError: NCCL refused (a duplicate GPU, say), or the id exchange/barrier failed.
    """

    def remaining() -> float:
        return max(0.0, deadline - time.monotonic())

    key = f"nccl/{group.name}/uid"
    if group.index == 0:
        data = unique_id(nccl)
        kv.set(key, data)
    else:
        data = kv.get(key, remaining())
    barrier(f"nccl-init/{group.name}", remaining())

    result: dict[str, Any] = {}

    def init() -> None:
        try:
            with cupy.cuda.Device(device):
                result["comm"] = new_communicator(nccl, group.size, data, group.index)
                result["stream"] = cupy.cuda.Stream(non_blocking=True)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=init, name=f"collsvc-nccl-init-{group.name}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.01)
        recorded = failure.error()
        if recorded is not None and thread.is_alive():
            raise as_collsvc_error(recorded, f"init of group {group.name!r}")
        if time.monotonic() >= deadline and thread.is_alive():
            raise CollectiveTimeoutError(
                f"nccl communicator init for group {group.name!r} did not finish in time (ranks {list(group.ranks)})",
                waiting_on=[],
            )
    if "error" in result:
        exc = result["error"]
        raise CollsvcError(f"nccl communicator init for group {group.name!r} failed: {exc}") from exc
    gc = GroupComm(result["comm"], result["stream"], device, group)
    with cupy.cuda.Device(device):
        gc.ready = cupy.cuda.Event(disable_timing=True)
    return gc
