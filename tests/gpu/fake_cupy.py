"""An in-process stand-in for the parts of CuPy and ``cupy.cuda.nccl`` the NCCL backend uses.

Arrays are numpy arrays with CuPy's ``.data.ptr`` and ``.device.id``; every "stream" is synchronous;
the NCCL communicator runs its collectives across threads (one thread per rank) through raw pointers,
as real NCCL does. It lets the backend's planning, routing and error paths run without a GPU. It is no
evidence that the backend works on real NCCL: ``test_nccl_single_gpu.py`` is.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types
from collections import defaultdict, deque
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np


class FakeArray(np.ndarray):
    @property
    def data(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(ptr=self.ctypes.data)

    @property
    def device(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(id=0)


def asfake(a: np.ndarray) -> FakeArray:
    return np.ascontiguousarray(a).view(FakeArray)


def _read(ptr: int, nbytes: int) -> bytes:
    return ctypes.string_at(ptr, nbytes)


def _write(ptr: int, data: bytes) -> None:
    ctypes.memmove(ptr, data, len(data))


class Stream:
    ptr = 1234

    def __init__(self, non_blocking: bool = False) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Event:
    never_done = False  # tests flip this to simulate a kernel waiting for a dead peer

    def __init__(self, disable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    @property
    def done(self) -> bool:
        return not Event.never_done


@contextlib.contextmanager
def Device(index: int) -> Iterator[None]:  # noqa: N802 - CuPy's name
    yield


DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16}
DTYPES.update({7: np.float32, 8: np.float64, 9: ml_dtypes.bfloat16})
OPS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}


class World:
    """The ranks of one fake communicator: a barrier to line up collectives and p2p mailboxes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots: list[Any] = [None] * size
        self.cond = threading.Condition()
        self.mail: dict[tuple[int, int], deque[bytes]] = defaultdict(deque)


_worlds: dict[tuple[int, ...], World] = {}
_worlds_lock = threading.Lock()
_local = threading.local()


class NcclCommunicator:
    """CuPy >= 14's communicator: the unique id is ``bytes`` (anything else is CuPy's ``TypeError``)."""

    def __init__(self, ndev: int, commId: Any, rank: int) -> None:  # noqa: N803 - CuPy's name
        key = self._id_key(commId)
        with _worlds_lock:
            self.world = _worlds.setdefault(key, World(ndev))
        self.rank = rank
        self.aborted = False

    @staticmethod
    def _id_key(comm_id: Any) -> bytes:
        if not isinstance(comm_id, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(comm_id).__name__})")
        assert len(comm_id) == 128
        return comm_id

    def _collective(self, mine: Any) -> list[Any]:
        w = self.world
        w.slots[self.rank] = mine
        w.barrier.wait()
        everything = list(w.slots)
        w.barrier.wait()  # nobody writes before everybody read
        return everything

    def _reduce_all(self, send: int, count: int, dt: int, op: int) -> np.ndarray:
        dtype = np.dtype(DTYPES[dt])
        parts = self._collective(_read(send, count * dtype.itemsize))
        arrays = [np.frombuffer(p, dtype=dtype).astype(np.float64 if dt == 9 else dtype) for p in parts]
        result = np.add.reduce(arrays) / self.world.size if op == 4 else OPS[op].reduce(arrays)
        return np.asarray(result).astype(dtype)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:  # noqa: N802
        _write(recvbuf, self._reduce_all(sendbuf, count, datatype, op).tobytes())

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int) -> None:
        result = self._reduce_all(sendbuf, count, datatype, op)
        if self.rank == root:
            _write(recvbuf, result.tobytes())

    def reduceScatter(  # noqa: N802
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        n = self.world.size
        result = self._reduce_all(sendbuf, recvcount * n, datatype, op).reshape(n, recvcount)
        _write(recvbuf, result[self.rank].tobytes())

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int, stream: int) -> None:
        size = count * np.dtype(DTYPES[datatype]).itemsize
        parts = self._collective(_read(sendbuff, size) if self.rank == root else None)
        _write(recvbuff, parts[root])

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:  # noqa: N802
        parts = self._collective(_read(sendbuf, count * np.dtype(DTYPES[datatype]).itemsize))
        _write(recvbuf, b"".join(parts))

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._p2p(("send", peer, _read(sendbuf, count * np.dtype(DTYPES[datatype]).itemsize)))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._p2p(("recv", peer, (recvbuf, count * np.dtype(DTYPES[datatype]).itemsize)))

    def _p2p(self, item: Any) -> None:
        queue = getattr(_local, "group", None)
        if queue is None:
            run_p2p(self, [item])
        else:
            queue.append((self, item))

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True

    def destroy(self) -> None:
        pass


def run_p2p(comm: NcclCommunicator, items: list[Any]) -> None:
    w = comm.world
    with w.cond:
        for kind, peer, payload in items:
            if kind == "send":
                w.mail[(comm.rank, peer)].append(payload)
        w.cond.notify_all()
    for kind, peer, payload in items:
        if kind == "recv":
            ptr, nbytes = payload
            with w.cond:
                assert w.cond.wait_for(lambda p=peer: w.mail[(p, comm.rank)], timeout=10)
                data = w.mail[(peer, comm.rank)].popleft()
            assert len(data) == nbytes
            _write(ptr, data)


def group_start() -> None:
    _local.group = []


def group_end() -> None:
    queue, _local.group = _local.group, None
    by_comm: dict[int, tuple[NcclCommunicator, list[Any]]] = {}
    for comm, item in queue:
        by_comm.setdefault(id(comm), (comm, []))[1].append(item)
    for comm, items in by_comm.values():
        run_p2p(comm, items)


class LegacyNcclCommunicator(NcclCommunicator):
    """CuPy < 14's communicator: the unique id is a tuple of C ``char`` values, signed on x86-64."""

    @staticmethod
    def _id_key(comm_id: Any) -> bytes:
        if not isinstance(comm_id, tuple):
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(comm_id).__name__})")
        if any(not -128 <= v <= 127 for v in comm_id):
            raise OverflowError("value too large to convert to char")
        assert len(comm_id) == 128
        return bytes(v & 0xFF for v in comm_id)


_uid_counter = iter(range(1, 1 << 30))


def get_unique_id() -> bytes:
    """Like CuPy >= 14: 128 bytes, some above 127 (as real ids have)."""
    n = next(_uid_counter)
    return bytes([200, 100, *((n >> (8 * k)) & 0xFF for k in range(4))] + [255] * 122)


def get_unique_id_legacy() -> tuple[int, ...]:
    """Like CuPy < 14: a tuple of signed chars."""
    return tuple(b - 256 if b > 127 else b for b in get_unique_id())


def make(generation: int = 14) -> tuple[Any, Any]:
    """``(cupy, nccl)`` fakes, as ``load_cupy`` returns them, modelling CuPy ``generation`` (13 or 14).

    The NCCL constants have the values of NCCL's ``nccl.h``.
    """
    legacy = generation < 14
    nccl = types.SimpleNamespace(
        available=True,
        get_version=lambda: 22105,
        get_unique_id=get_unique_id_legacy if legacy else get_unique_id,
        NcclCommunicator=LegacyNcclCommunicator if legacy else NcclCommunicator,
        groupStart=group_start,
        groupEnd=group_end,
        NCCL_INT8=0, NCCL_UINT8=1, NCCL_INT32=2, NCCL_UINT32=3, NCCL_INT64=4, NCCL_UINT64=5,
        NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_FLOAT64=8, NCCL_BFLOAT16=9,
        NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3, NCCL_AVG=4,
    )  # fmt: skip
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        memcpyDeviceToDevice=3,
        memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n),
    )
    cuda = types.SimpleNamespace(
        Device=Device,
        Stream=Stream,
        Event=Event,
        get_current_stream=lambda: Stream(),
        runtime=runtime,
        nccl=nccl,
    )
    cupy = types.SimpleNamespace(
        cuda=cuda,
        empty=lambda shape, dtype: np.empty(shape, dtype=dtype).view(FakeArray),
        bitwise_and=np.bitwise_and,
        bitwise_or=np.bitwise_or,
        bitwise_xor=np.bitwise_xor,
    )
    return cupy, nccl
