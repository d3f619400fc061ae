"""An in-process stand-in for the parts of CuPy and ``cupy.cuda.nccl`` the NCCL backend uses.

Arrays are numpy arrays with CuPy's ``.data.ptr`` and ``.device.id``; every "stream" is synchronous
(data moves when the call is made), but completion is modelled: :func:`hold` keeps the operations
enqueued after it "in flight" (their events not done) until released, as a GPU still running them would;
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


class Gate:
    """Whether the kernels enqueued while it was current have finished (see :func:`hold`)."""

    def __init__(self, finished: bool) -> None:
        self.finished = finished

    def release(self) -> None:
        """The held kernels finish; kernels enqueued from now on finish at once again."""
        global _gate
        self.finished = True
        _gate = _OPEN


_OPEN = Gate(True)
_gate = _OPEN


def hold() -> Gate:
    """Every operation enqueued from now on stays in flight (its events not done) until ``release()``:
    the data moves at once, as everywhere in this stand-in, but the GPU reports it unfinished."""
    global _gate
    _gate = Gate(False)
    return _gate


class Event:
    never_done = False  # tests flip this to simulate a kernel waiting for a dead peer

    __slots__ = ("_gate",)

    def __init__(self, disable_timing: bool = False) -> None:
        self._gate = _OPEN

    def record(self, stream: Any = None) -> None:
        self._gate = _gate

    @property
    def done(self) -> bool:
        return not Event.never_done and self._gate.finished


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
        if w.size == 1:
            return [mine]
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
        if self.world.size == 1:  # every reduction of one member is that member's data: NCCL copies it
            if sendbuf != recvbuf:
                ctypes.memmove(recvbuf, sendbuf, count * DTYPES[datatype](0).itemsize)
            return
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


class ndarray:  # noqa: N801 - CuPy's name, which collsvc.arrays recognises CuPy arrays by
    """The stand-in's array as ``import cupy`` gives it: not a numpy array (``type(x).__module__`` is
    ``cupy``), over host memory that stands for the device's; what it does not define it takes from numpy."""

    # Plain attributes, read as cheaply as CuPy's own (C-level) ones, so a host-cost measurement
    # through this stand-in does not count the stand-in's attribute lookups as collsvc's.
    __slots__ = ("_a", "data", "device", "dtype", "shape", "size", "nbytes", "flags", "ndim")

    def __init__(self, a: np.ndarray) -> None:
        self._a = a
        self.data = types.SimpleNamespace(ptr=a.ctypes.data)
        self.device = _DEVICE_0
        self.dtype, self.shape, self.size, self.nbytes, self.flags, self.ndim = (
            a.dtype,
            a.shape,
            a.size,
            a.nbytes,
            a.flags,
            a.ndim,
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self._a if dtype is None else self._a.astype(dtype)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._a, name)
        if callable(value):

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                result = value(*args, **kwargs)
                return ndarray(result) if isinstance(result, np.ndarray) else result

            return wrapped
        return value

    def __getitem__(self, key: Any) -> Any:
        result = self._a[key]
        return ndarray(result) if isinstance(result, np.ndarray) else result

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[key] = np.asarray(value)

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"stand-in cupy {self._a!r}"


ndarray.__module__ = "cupy"
_DEVICE_0 = types.SimpleNamespace(id=0)


def _wrap(a: Any) -> ndarray:
    return ndarray(np.ascontiguousarray(a))


class _CurrentDevice:
    """``cupy.cuda.Device(index)``: a context manager, with the attributes the device probe reads."""

    __slots__ = ("id",)

    def __init__(self, index: int | None = None) -> None:
        self.id = 0 if index is None else index

    @property
    def pci_bus_id(self) -> str:
        return f"0000:{self.id:02x}:00.0"

    def __enter__(self) -> _CurrentDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def use(self) -> None:
        pass


class _UsableStream(Stream):
    def use(self) -> None:
        pass


def install() -> Any:
    """Puts the stand-in in ``sys.modules`` as ``cupy``, ``cupy.cuda`` and ``cupy.cuda.nccl``, so the
    whole library (device probe, array adaptation, the Communicator, the torch layer) takes it for CuPy
    on one GPU, as a process with CuPy and a GPU would. Returns the ``cupy`` module. For host-cost
    measurements and tests without a GPU; it moves data synchronously like the rest of this stand-in."""
    import sys

    fake, nccl = make()
    stream = _UsableStream()
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    nccl_module = types.ModuleType("cupy.cuda.nccl")
    nccl_module.__dict__.update(vars(nccl))
    runtime = fake.cuda.runtime
    runtime.getDevice = lambda: 0
    runtime.getDeviceProperties = lambda index: {"uuid": bytes(range(16))}
    cuda.__dict__.update(
        Device=_CurrentDevice,
        Stream=_UsableStream,
        Event=Event,
        get_current_stream=lambda: stream,
        runtime=runtime,
        nccl=nccl_module,
    )

    def empty(shape: Any, dtype: Any = np.float64) -> ndarray:
        return ndarray(np.empty(shape, dtype=dtype))

    def array(a: Any, copy: bool = True, order: str = "C", dtype: Any = None) -> ndarray:
        return ndarray(np.array(np.asarray(a), copy=copy, order=order, dtype=dtype))

    cupy.__dict__.update(
        __version__="14.0.0-stand-in",
        ndarray=ndarray,
        cuda=cuda,
        empty=empty,
        array=array,
        asarray=lambda a, dtype=None: a if isinstance(a, ndarray) and dtype is None else _wrap(np.asarray(a, dtype)),
        ascontiguousarray=lambda a: a if a.flags.c_contiguous else _wrap(np.asarray(a)),
        asnumpy=lambda a: np.array(np.asarray(a)),
        ones=lambda shape, dtype=np.float64: ndarray(np.ones(shape, dtype=dtype)),
        bitwise_and=np.bitwise_and,
        bitwise_or=np.bitwise_or,
        bitwise_xor=np.bitwise_xor,
    )
    sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl_module})
    return cupy
