"""The NCCL backend's logic over an in-process fake of CuPy/NCCL (``fake_cupy.py``); runs without a GPU.

Not marked ``gpu``: it checks planning (dtype views, bool/complex mapping, AVG, bitwise folds), routing of
the send/recv-based collectives, the unique-id exchange, and the timeout/failure/abort paths, at world
sizes 1 and 3 with one thread per rank. Whether real NCCL agrees is for ``test_nccl_single_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from collsvc.client.backends.base import Call, GroupSpec, Signature
from collsvc.client.backends.nccl import backend as nccl_module
from collsvc.client.backends.nccl.backend import NcclBackend
from collsvc.client.backends.nccl.dtypes import Mode, plan_reduction
from collsvc.client.backends.nccl.watchdog import Pending, Watchdog, wait_for
from collsvc.errors import AbortedError, CollectiveTimeoutError, CollsvcError, RankFailedError
from collsvc.types import BITWISE_OPS, ReduceOp, check_op_dtype, numpy_dtype
from tests.gpu import fake_cupy
from tests.gpu.cupy_contract import COMMUNICATOR_METHODS, MEMCPY_DEVICE_TO_DEVICE, NCCL_CONSTANTS, parameters

DTYPES = ["bool", "int8", "uint8", "int32", "uint32", "int64", "uint64"]
DTYPES += ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


class KV:
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout=timeout):
                raise CollectiveTimeoutError(f"key {key} never set")
            return self.data[key]


class Barriers:
    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.barriers: dict[str, threading.Barrier] = {}

    def __call__(self, name: str, timeout: float) -> None:
        with self.lock:
            barrier = self.barriers.setdefault(name, threading.Barrier(self.size))
        barrier.wait(timeout)


class Failure:
    def __init__(self) -> None:
        self.recorded: BaseException | None = None

    def error(self) -> BaseException | None:
        return self.recorded


@pytest.fixture(autouse=True)
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(nccl_module, "load_cupy", fake_cupy.make)
    fake_cupy.Event.never_done = False
    yield
    fake_cupy.Gate(True).release()  # a test that held operations in flight leaves them finished


def make_backends(size: int, failure: Failure | None = None) -> list[NcclBackend]:
    kv, barriers = KV(), Barriers(size)
    return [NcclBackend(r, size, kv, barriers, 5.0, failure or Failure(), watchdog_grace=0.2) for r in range(size)]


def call(index: int, size: int, op: str, dtype: str, shape: tuple[int, ...], reduce_op: str = "", seq: int = 1) -> Call:
    group = GroupSpec("world", tuple(range(size)), index)
    return Call(group, "world", seq, Signature(op, dtype, shape, reduce_op), time.monotonic() + 5.0)


def run_ranks(backends: list[NcclBackend], fn: Callable[[NcclBackend, int], Any]) -> list[Any]:
    results: list[Any] = [None] * len(backends)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = fn(backends[i], i)
        except BaseException as exc:  # shipped to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(backends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    if errors:
        raise errors[0]
    return results


def host_values(dtype: str, rank: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(rank + 7)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.startswith(("int", "uint")):
        return rng.integers(1, 6, n).astype(numpy_dtype(dtype))
    if dtype.startswith("complex"):
        return (rng.integers(-4, 5, n) + 1j * rng.integers(-4, 5, n)).astype(dtype)
    return rng.integers(-8, 9, n).astype(numpy_dtype(dtype))


def device(host: np.ndarray) -> fake_cupy.FakeArray:
    """What the communicator hands the backend: flat, with bfloat16 as a uint16 view."""
    if host.dtype == np.dtype(ml_dtypes.bfloat16):
        return fake_cupy.asfake(host.view(np.uint16).copy())
    return fake_cupy.asfake(host.copy())


def back(dev: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(dev).view(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.asarray(dev)


def reference(op: ReduceOp, inputs: list[np.ndarray]) -> np.ndarray:
    wide = [x.astype(np.float64) if x.dtype == np.dtype(ml_dtypes.bfloat16) else x for x in inputs]
    if op is ReduceOp.AVG:
        result = np.add.reduce(wide) / len(wide)
    else:
        ufunc = {
            ReduceOp.SUM: np.add,
            ReduceOp.PRODUCT: np.multiply,
            ReduceOp.MIN: np.minimum,
            ReduceOp.MAX: np.maximum,
            ReduceOp.BAND: np.bitwise_and,
            ReduceOp.BOR: np.bitwise_or,
            ReduceOp.BXOR: np.bitwise_xor,
        }[op]
        result = ufunc.reduce(wide)
    return np.asarray(result).astype(inputs[0].dtype)


def valid(op: ReduceOp, dtype: str) -> bool:
    try:
        check_op_dtype(op, numpy_dtype(dtype))
    except TypeError:
        return False
    return not (dtype.startswith("complex") and op is ReduceOp.PRODUCT)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    if want.dtype.kind in "fc" or want.dtype == np.dtype(ml_dtypes.bfloat16):
        np.testing.assert_allclose(got.astype(np.complex128), want.astype(np.complex128), rtol=1e-2)
    else:
        np.testing.assert_array_equal(got, want)


CASES = [(op, dt) for op in ReduceOp for dt in DTYPES if valid(op, dt)]


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize(("op", "dtype"), CASES, ids=[f"{o.name}-{d}" for o, d in CASES])
def test_all_reduce_matches_numpy(size: int, op: ReduceOp, dtype: str) -> None:
    inputs = [host_values(dtype, r, 10) for r in range(size)]
    backends = make_backends(size)

    def body(b: NcclBackend, i: int) -> np.ndarray:
        buf = device(inputs[i])
        b.all_reduce(call(i, size, "all_reduce", dtype, (10,), op.value), buf, op)
        return back(buf, dtype)

    for got in run_ranks(backends, body):
        assert_same(got, reference(op, inputs))


@pytest.mark.parametrize(
    ("op", "dtype"), [(ReduceOp.SUM, "float32"), (ReduceOp.BXOR, "int32"), (ReduceOp.AVG, "complex64")]
)
def test_reduce_and_reduce_scatter(op: ReduceOp, dtype: str) -> None:
    size, n = 3, 4
    inputs = [host_values(dtype, r, size * n) for r in range(size)]
    want = reference(op, inputs)

    def body(b: NcclBackend, i: int) -> tuple[np.ndarray, np.ndarray]:
        buf = device(inputs[i])
        b.reduce(call(i, size, "reduce", dtype, (size * n,), op.value, seq=1), buf, op, 1)
        out = fake_cupy.asfake(np.empty(n, dtype=inputs[i].dtype))
        b.reduce_scatter(
            call(i, size, "reduce_scatter", dtype, (size * n,), op.value, seq=2), device(inputs[i]), out, op
        )
        return np.asarray(buf), np.asarray(out)

    results = run_ranks(make_backends(size), body)
    assert_same(results[1][0], want)
    for i, (_, block) in enumerate(results):
        assert_same(block, want[i * n : (i + 1) * n])


def test_data_movement_collectives_at_size_3() -> None:
    size, n = 3, 4
    inputs = [np.arange(size * n, dtype=np.int16) + 100 * r for r in range(size)]  # int16 moves as bytes

    def body(b: NcclBackend, i: int) -> dict[str, np.ndarray]:
        got: dict[str, np.ndarray] = {}
        buf = device(inputs[i])
        b.broadcast(call(i, size, "broadcast", "int16", (size * n,), seq=1), buf, 2)
        got["broadcast"] = np.asarray(buf)
        out = fake_cupy.asfake(np.empty(size * size * n, dtype=np.int16))
        b.all_gather(call(i, size, "all_gather", "int16", (size * n,), seq=2), device(inputs[i]), out)
        got["all_gather"] = np.asarray(out)
        gathered = fake_cupy.asfake(np.zeros(size * size * n, dtype=np.int16)) if i == 0 else None
        b.gather(call(i, size, "gather", "int16", (size * n,), seq=3), device(inputs[i]), gathered, 0)
        if gathered is not None:
            got["gather"] = np.asarray(gathered)
        block = fake_cupy.asfake(np.empty(n, dtype=np.int16))
        b.scatter(
            call(i, size, "scatter", "int16", (size * n,), seq=4),
            device(inputs[i]) if i == 1 else None,
            block,
            1,
        )
        got["scatter"] = np.asarray(block)
        a2a = fake_cupy.asfake(np.empty(size * n, dtype=np.int16))
        b.all_to_all(call(i, size, "all_to_all", "int16", (size * n,), seq=5), device(inputs[i]), a2a)
        got["all_to_all"] = np.asarray(a2a)
        if i == 0:
            b.send(call(i, size, "send", "int16", (n,), seq=6), device(inputs[0][:n]), 2)
        if i == 2:
            received = fake_cupy.asfake(np.empty(n, dtype=np.int16))
            b.recv(call(i, size, "recv", "int16", (n,), seq=6), received, 0)
            got["recv"] = np.asarray(received)
        return got

    results = run_ranks(make_backends(size), body)
    everything = np.concatenate(inputs)
    assert (results[0]["gather"] == everything).all()
    assert (results[2]["recv"] == inputs[0][:n]).all()
    for i, got in enumerate(results):
        assert (got["broadcast"] == inputs[2]).all()
        assert (got["all_gather"] == everything).all()
        assert (got["scatter"] == inputs[1][i * n : (i + 1) * n]).all()
        want = np.concatenate([inputs[j][i * n : (i + 1) * n] for j in range(size)])
        assert (got["all_to_all"] == want).all()


@pytest.mark.parametrize("generation", [13, 14])
def test_unique_id_is_published_once_per_group(generation: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy >= 14 hands the id over as bytes, older CuPy as a tuple of signed chars; both must work."""
    monkeypatch.setattr(nccl_module, "load_cupy", lambda: fake_cupy.make(generation))
    backends = make_backends(2)
    run_ranks(
        backends,
        lambda b, i: b.broadcast(call(i, 2, "broadcast", "uint8", (3,)), device(np.zeros(3, np.uint8)), 0),
    )
    kv = backends[0]._kv
    assert isinstance(kv, KV) and list(kv.data) == ["nccl/world/uid"] and len(kv.data["nccl/world/uid"]) == 128


def test_the_fake_matches_the_recorded_cupy_contract() -> None:
    """``test_cupy_library.py`` pins the same tables to the real CuPy."""
    cupy, nccl = fake_cupy.make()
    for name, expected in COMMUNICATOR_METHODS.items():
        assert parameters(getattr(nccl.NcclCommunicator, name)) == expected, name
    assert {n: getattr(nccl, n) for n in NCCL_CONSTANTS} == NCCL_CONSTANTS
    assert cupy.cuda.runtime.memcpyDeviceToDevice == MEMCPY_DEVICE_TO_DEVICE
    assert isinstance(nccl.get_unique_id(), bytes)
    with pytest.raises(TypeError, match="commId"):
        nccl.NcclCommunicator(1, tuple(nccl.get_unique_id()), 0)


def test_an_array_on_another_gpu_than_the_one_reported_is_refused() -> None:
    """The duplicate-GPU check ran on the reported device; an array elsewhere would void it."""
    b = NcclBackend(0, 1, KV(), Barriers(1), 5.0, Failure(), device=1)  # the fake's arrays live on GPU 0
    with pytest.raises(ValueError, match=r"rank 0: all_reduce got an array on GPU 0, but this rank reported GPU 1"):
        b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum"), device(np.ones(4, np.float32)), ReduceOp.SUM)
    assert isinstance(b._kv, KV) and b._kv.data == {}  # refused before NCCL was touched
    b.close()


def test_unsupported_reductions_are_type_errors() -> None:
    (b,) = make_backends(1)
    with pytest.raises(TypeError, match="int16") as info:
        b.all_reduce(call(0, 1, "all_reduce", "int16", (4,), "sum"), device(np.zeros(4, np.int16)), ReduceOp.SUM)
    assert "float32" in str(info.value)  # names what is supported
    with pytest.raises(TypeError, match="complex"):
        plan_reduction(ReduceOp.PRODUCT, "complex64", 22105)
    with pytest.raises(TypeError):
        plan_reduction(ReduceOp.BAND, "float32", 22105)


def test_plans() -> None:
    assert plan_reduction(ReduceOp.AVG, "float32", 20900).mode is Mode.SUM_THEN_DIVIDE
    assert plan_reduction(ReduceOp.AVG, "float32", 22105, has_avg=False).mode is Mode.SUM_THEN_DIVIDE
    assert plan_reduction(ReduceOp.AVG, "float32", 22105).nccl_op == "NCCL_AVG"
    assert plan_reduction(ReduceOp.SUM, "bool", 22105).nccl_op == "NCCL_MAX"
    assert plan_reduction(ReduceOp.PRODUCT, "bool", 22105).nccl_op == "NCCL_MIN"
    assert plan_reduction(ReduceOp.SUM, "complex128", 22105).factor == 2
    for op in BITWISE_OPS:
        assert plan_reduction(op, "int64", 22105).mode is Mode.FOLD
    with pytest.raises(TypeError, match="2.10"):
        plan_reduction(ReduceOp.SUM, "bfloat16", 20800)


def test_avg_fallback_divides_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    backends = make_backends(3)
    for b in backends:
        b._has_avg = False
    inputs = [host_values("float32", r, 6) for r in range(3)]

    def body(b: NcclBackend, i: int) -> np.ndarray:
        buf = device(inputs[i])
        b.all_reduce(call(i, 3, "all_reduce", "float32", (6,), "avg"), buf, ReduceOp.AVG)
        return np.asarray(buf)

    for got in run_ranks(backends, body):
        np.testing.assert_allclose(got, np.mean(inputs, axis=0), rtol=1e-6)


def short_call(seq: int, seconds: float, shape: tuple[int, ...] = (4,)) -> Call:
    group = GroupSpec("world", (0,), 0)
    return Call(group, "world", seq, Signature("all_reduce", "float32", shape, "sum"), time.monotonic() + seconds)


def test_a_call_returns_before_the_gpu_finished_it() -> None:
    """Return after enqueue: the operation stays in flight (watched) until the GPU finishes it."""
    (b,) = make_backends(1)
    buf = device(np.ones(4, np.float32))
    gate = fake_cupy.hold()
    b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum"), buf, ReduceOp.SUM)  # returns at once
    (pending,) = b._watchdog.unfinished()
    assert not pending.done() and pending.error is None
    gate.release()
    b.synchronize()  # nothing to raise
    b._watchdog.check_once(time.monotonic())
    assert b._watchdog.unfinished() == []
    b.close()


def test_blocking_mode_waits_on_the_host() -> None:
    """COLLSVC_NCCL_BLOCKING_WAIT=1 (blocking=True): the caller itself waits and raises the timeout."""
    b = NcclBackend(0, 1, KV(), Barriers(1), 5.0, Failure(), watchdog_grace=0.2, blocking=True)
    buf = device(np.ones(4, np.float32))
    b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum"), buf, ReduceOp.SUM)  # creates the comm
    fake_cupy.hold()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"all_reduce\(float32\[4\], sum\)") as info:
        b.all_reduce(short_call(2, 0.2), buf, ReduceOp.SUM)
    assert time.monotonic() - start < 2.0
    assert info.value.waiting_on == []
    assert b._comms["world"].comm.aborted
    with pytest.raises(CollectiveTimeoutError):  # later calls fail at once
        b.broadcast(call(0, 1, "broadcast", "float32", (4,), seq=3), buf, 0)
    b.close()


def test_an_operation_stuck_past_its_deadline_aborts_and_the_next_call_raises() -> None:
    """The watchdog aborts the communicator at the deadline; the report (the Job's on_failure, which
    asks the coordinator who is late) gets the stuck call, and its error is what every later call,
    settle (Work.wait) and synchronize raise."""
    reported = threading.Event()
    calls: list[Call] = []

    def report(c: Call, error: CollsvcError) -> CollsvcError:
        calls.append(c)
        reported.set()
        return CollectiveTimeoutError(f"{error}; waiting on rank 1", [{"rank": 1, "host": "h1"}])

    b = NcclBackend(0, 1, KV(), Barriers(1), 5.0, Failure(), report=report)
    buf = device(np.ones(4, np.float32))
    b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum"), buf, ReduceOp.SUM)
    fake_cupy.hold()
    start = time.monotonic()
    b.all_reduce(short_call(2, 0.2), buf, ReduceOp.SUM)  # stuck on the "GPU", but the call returns
    assert time.monotonic() - start < 0.2
    assert reported.wait(5.0)
    assert [c.seq for c in calls] == [2] and calls[0].signature.op == "all_reduce"
    assert b._comms["world"].comm.aborted
    for raising in (
        lambda: b.broadcast(call(0, 1, "broadcast", "float32", (4,), seq=3), buf, 0),
        b.settle,
        b.synchronize,
    ):
        with pytest.raises(CollectiveTimeoutError, match="waiting on rank 1") as info:
            raising()
        assert info.value.waiting_on == [{"rank": 1, "host": "h1"}]
    b.close()


def test_a_recorded_rank_failure_fails_the_queued_work() -> None:
    failure = Failure()
    (b,) = make_backends(1, failure)
    buf = device(np.ones(4, np.float32))
    gate = fake_cupy.hold()
    for seq in (1, 2, 3):
        b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum", seq=seq), buf, ReduceOp.SUM)
    queued = b._watchdog.unfinished()
    assert len(queued) == 3
    failure.recorded = RankFailedError("rank 3 died", [3], ["h3"])
    b._watchdog.check_once(time.monotonic())  # what the watchdog thread does every few milliseconds
    assert all(isinstance(p.error, RankFailedError) for p in queued)
    assert b._comms["world"].comm.aborted
    with pytest.raises(RankFailedError) as info:
        b.synchronize()
    assert info.value.ranks == [3]
    with pytest.raises(RankFailedError):
        b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum", seq=4), buf, ReduceOp.SUM)
    gate.release()
    b.close()


def test_synchronize_waits_and_raises_a_timeout_itself() -> None:
    """An explicit wait for completion: synchronize() raises the timeout when it is the one to see it."""
    (b,) = make_backends(1)
    b._watchdog.stop()  # only synchronize() watches here
    buf = device(np.ones(4, np.float32))
    b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum"), buf, ReduceOp.SUM)
    fake_cupy.hold()
    b.all_reduce(short_call(2, 0.2), buf, ReduceOp.SUM)
    with pytest.raises(CollectiveTimeoutError, match="seq 2"):
        b.synchronize()
    with pytest.raises(CollectiveTimeoutError):
        b.settle()
    b.close()


def test_reform_aborts_the_old_communicators_and_makes_new_ones() -> None:
    """Elasticity: a member of three fails with work in flight; the survivors' communicators are aborted,
    closing them does not wait for that work, and the next generation (a new job: new key/value store,
    two members) gets new communicators that work."""
    failure = Failure()
    old = make_backends(3, failure)
    inputs = [np.full(4, r + 1, np.float32) for r in range(3)]
    run_ranks(
        old,
        lambda b, i: b.all_reduce(call(i, 3, "all_reduce", "float32", (4,), "sum"), device(inputs[i]), ReduceOp.SUM),
    )
    old_comms = [b._comms["world"] for b in old]
    fake_cupy.hold()
    run_ranks(
        old,
        lambda b, i: b.all_reduce(
            call(i, 3, "all_reduce", "float32", (4,), "sum", seq=2), device(inputs[i]), ReduceOp.SUM
        ),
    )
    failure.recorded = RankFailedError("rank 2 died", [2], ["h2"])
    for b in old[:2]:
        b._watchdog.check_once(time.monotonic())
        b.close()
    assert all(gc.comm.aborted for gc in old_comms[:2])
    fake_cupy.Gate(True).release()  # later operations finish again
    new = make_backends(2)

    def reduce_in_new_generation(b: NcclBackend, i: int) -> np.ndarray:
        buf = device(inputs[i])
        b.all_reduce(call(i, 2, "all_reduce", "float32", (4,), "sum"), buf, ReduceOp.SUM)
        return np.asarray(buf)

    got = run_ranks(new, reduce_in_new_generation)
    for g in got:
        np.testing.assert_array_equal(g, np.full(4, 3, np.float32))
    new_comms = [b._comms["world"] for b in new]
    assert not any(gc.comm.aborted for gc in new_comms)
    assert {id(gc.comm) for gc in new_comms}.isdisjoint(id(gc.comm) for gc in old_comms)
    for b in new:
        b.synchronize()
        b.close()
    old[2].close()


def test_abort_fails_later_calls() -> None:
    (b,) = make_backends(1)
    buf = device(np.ones(4, np.float32))
    b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum"), buf, ReduceOp.SUM)
    b.abort(AbortedError("stop", reason="stop"))
    with pytest.raises(AbortedError):
        b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum", seq=2), buf, ReduceOp.SUM)
    b.close()
    b.close()


def test_watchdog_fails_an_operation_stuck_past_its_deadline() -> None:
    failed: list[CollsvcError] = []
    watchdog = Watchdog(Failure())
    p = Pending("all_reduce(float32[4], sum)", deadline=100.0, timeout=1.0, on_fail=lambda e, _: failed.append(e))
    watchdog.watch(p)
    watchdog.check_once(now=99.9)
    assert not failed
    watchdog.check_once(now=100.1)
    assert isinstance(p.error, CollectiveTimeoutError) and failed == [p.error]
    blocking = Pending("x", deadline=100.0, timeout=1.0, on_fail=lambda e, _: failed.append(e), grace=0.5)
    watchdog.watch(blocking, lane=1)  # a caller waiting itself acts first; the watchdog after the grace
    watchdog.check_once(now=100.2)
    assert blocking.error is None
    watchdog.check_once(now=100.6)
    assert isinstance(blocking.error, CollectiveTimeoutError)
    watchdog.stop()


def test_wait_polls_without_sleeping_first_then_sleeps_briefly() -> None:
    """A small operation is seen done within microseconds (no sleep, whose shortest real length is tens
    of microseconds); a long one is polled with sleeps of at most 200 us, so it is seen done soon after."""
    now = [0.0]
    sleeps: list[float] = []
    polls = [0]

    def clock() -> float:
        now[0] += 5e-6  # each poll takes 5 us
        return now[0]

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    def done_after(seconds: float) -> Any:
        def done() -> bool:
            polls[0] += 1
            return now[0] >= seconds

        return done

    pending = Pending("all_reduce", 10.0, 10.0, lambda error, _: None)
    kwargs: dict[str, Any] = dict(failure=Failure(), broken=lambda: None, check_async=lambda: None, clock=clock)
    wait_for(done_after(150e-6), pending, sleep=sleep, **kwargs)
    assert sleeps == [] and polls[0] > 10
    now[0], sleeps[:] = 0.0, []
    wait_for(done_after(0.05), pending, sleep=sleep, **kwargs)
    assert sleeps and max(sleeps) <= 200e-6 and now[0] < 0.05 + 250e-6


def test_the_communicator_on_the_stand_in_takes_the_gpu_fast_path_and_raises_deferred_errors() -> None:
    """A real one-rank job (coordinator, Job, Communicator) on the NCCL backend over the stand-in, in its
    own process (``tests/gpu/stand_in_job.py``): repeated all_reduce calls reuse their plan (in place
    and into new arrays); another signature takes the general path; calls return while the "GPU" is
    stuck; then synchronize(), Work.wait() and the next call raise the timeout, recorded as the job's
    failure with the Job's own wording."""
    script = Path(__file__).resolve().parents[1] / "gpu" / "stand_in_job.py"
    root = str(script.parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["backend"] == "nccl"
    assert seen["general_in_place"] == 1  # the first call only; four repeats took the fast path
    assert seen["new_arrays"] == [True, True, True] and seen["general_after_new"] == 1
    assert seen["general_after_other_signature"] == 2
    assert seen["values"] == [list(map(float, range(8))), [1.0] * 4]
    assert seen["returned_in_s"] < 1.0  # both calls returned while the operation was stuck (timeout 2 s)
    assert seen["synchronize"] == seen["work_wait"] == seen["job_failure"] == "CollectiveTimeoutError"
    assert "all_reduce #11 in group 'world' timed out after 2s on rank 0" in seen["next_call"]


def test_closing_with_work_in_flight_aborts_rather_than_destroys() -> None:
    """ncclCommDestroy could wait forever for an operation whose peer left; a clean close does not abort."""
    (b,) = make_backends(1)
    buf = device(np.ones(4, np.float32))
    b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum"), buf, ReduceOp.SUM)
    fake_cupy.hold()
    b.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum", seq=2), buf, ReduceOp.SUM)
    gc = b._comms["world"]
    b.close()
    assert gc.comm.aborted
    fake_cupy.Gate(True).release()
    (clean,) = make_backends(1)
    clean.all_reduce(call(0, 1, "all_reduce", "float32", (4,), "sum"), buf, ReduceOp.SUM)
    gc = clean._comms["world"]
    clean.close()
    assert not gc.comm.aborted
