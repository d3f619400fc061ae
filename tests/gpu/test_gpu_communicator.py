"""The real Communicator on one GPU: NCCL at world size 1, CuPy arrays over the ring with several ranks
sharing the GPU, the duplicate-GPU error for backend="nccl", and a rank killed during a GPU collective.
Skipped without CuPy, NCCL and a CUDA GPU (run: pytest -m gpu tests/gpu)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import collsvc
from collsvc.client.devices import cupy_available
from tests.harness import coordinator, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy with NCCL and a CUDA GPU"),
]


def use_my_gpu(comm: collsvc.Communicator) -> None:
    """What a user script does: select the GPU this rank reported at join (its local rank's)."""
    import cupy

    cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()


def nccl_world_of_one(comm: collsvc.Communicator) -> dict[str, Any]:
    import cupy

    use_my_gpu(comm)
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    total = comm.all_reduce(x)
    assert isinstance(total, cupy.ndarray)
    assert bool(cupy.all(total == x))
    avg = comm.all_reduce(x, collsvc.AVG)
    assert bool(cupy.allclose(avg, x))
    gathered = comm.all_gather(x[:10])
    assert gathered.shape == (10,)
    # An async call runs on the communicator's worker thread, but in the caller's device and stream:
    # NCCL must see the doubling queued on that stream before it.
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        y = cupy.arange(1 << 20, dtype=cupy.float32)
        y *= 2
        comm.all_reduce(y, out=y, async_op=True).wait()
        assert float(y.sum()) == float(np.arange(1 << 20, dtype=np.float64).sum() * 2)
    # Repeated calls take the GPU fast path (backends/nccl/repeat.py), in place and into new arrays, and
    # return once enqueued; synchronize() waits for them with errors.
    z = cupy.ones(1024, dtype=cupy.float32)
    for _ in range(5):
        assert comm.all_reduce(z, out=z) is z
    fresh = comm.all_reduce(z)
    gpu = comm._repeated._gpu
    assert gpu is not None and any(plan is not None for plan in gpu._known.values())
    comm.synchronize()
    assert float(z.sum()) == 1024.0 and fresh is not z and float(fresh.sum()) == 1024.0
    return {"backend": comm.backend}


def ring_with_cupy(comm: collsvc.Communicator) -> dict[str, Any]:
    import cupy

    use_my_gpu(comm)
    x = cupy.full(1000, comm.rank + 1, dtype=cupy.float32)
    total = comm.all_reduce(x)
    assert isinstance(total, cupy.ndarray), type(total)
    assert float(total[0]) == sum(range(1, comm.size + 1))
    rows = comm.all_gather(cupy.array([comm.rank], dtype=cupy.int64))
    assert cupy.asnumpy(rows).tolist() == list(range(comm.size))
    return {"backend": comm.backend}


def nccl_rank(rank: int) -> dict[str, Any]:
    comm = collsvc.init(backend="nccl", timeout=60)
    try:
        return nccl_world_of_one(comm)
    finally:
        collsvc.destroy()


def test_nccl_backend_at_world_size_one() -> None:
    with coordinator() as (_, address):
        result = run_ranks(nccl_rank, 1, address=address, use_init=False)
    assert result.values[0]["backend"] == "nccl"


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_sharing_one_gpu_use_the_ring_with_cupy_arrays(world_size: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(ring_with_cupy, world_size, address=address, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert {v["backend"] for v in result.values} == {"ring"}


def request_nccl(rank: int) -> str:
    try:
        collsvc.init(backend="nccl", timeout=30)
    except collsvc.RendezvousError as exc:
        return str(exc)
    return "no error"


def test_backend_nccl_on_a_shared_gpu_names_both_ranks() -> None:
    with coordinator() as (_, address):
        result = run_ranks(request_nccl, 2, address=address, use_init=False, env={"CUDA_VISIBLE_DEVICES": "0"})
    for message in result.values:
        assert "0" in message and "1" in message and "GPU" in message, message


def killed_during_gpu_collective(comm: collsvc.Communicator) -> dict[str, Any]:
    import cupy

    use_my_gpu(comm)
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce(cupy.ones(1 << 20, dtype=cupy.float32))
    except collsvc.RankFailedError as exc:
        return {"ranks": exc.ranks, "seconds": time.monotonic() - start}
    return {"ranks": [], "seconds": time.monotonic() - start}


def test_rank_killed_while_others_wait_in_a_gpu_collective() -> None:
    with coordinator() as (_, address):
        result = run_ranks(killed_during_gpu_collective, 3, address=address, allow_failures=True)
    survivors = [o.value for o in result.outcomes if o.rank != 1]
    for value in survivors:
        assert value["ranks"] == [1] and value["seconds"] < 10, value
    assert np.all([o.exitcode == 0 for o in result.outcomes if o.rank != 1])
