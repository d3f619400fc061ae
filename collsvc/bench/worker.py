"""One rank of ``collsvc bench`` (configured through the COLLSVC_BENCH environment variable).

Every size is measured with collsvc/bench/protocol.py, the protocol torch gloo's ranks use too in
benchmarks/compare_gloo.py; rank 0 writes the rows as one JSON line on its stdout.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

import collsvc
from collsvc.bench import protocol
from collsvc.types import numpy_dtype


class ResultCheckError(Exception):
    """``--check`` found a collective result that differs from the expected one."""


# One buffer set: (input, separate output), the output None where the call works in place.
BufferSet = tuple[Any, Any]


def _collective(comm: collsvc.Communicator, op: str) -> Callable[[BufferSet], object]:
    """A callable running ``op`` on one buffer set, in place (``out=x``) where torch's works in place."""
    if op == "all_reduce":
        return lambda bufs: comm.all_reduce(bufs[0], out=bufs[0])
    if op == "broadcast":
        return lambda bufs: comm.broadcast(bufs[0], 0, out=bufs[0])
    if op == "reduce":
        return lambda bufs: comm.reduce(bufs[0], 0, out=bufs[0] if comm.rank == 0 else None)
    if op == "all_gather":
        return lambda bufs: comm.all_gather(bufs[0], out=bufs[1])
    if op == "reduce_scatter":
        return lambda bufs: comm.reduce_scatter(bufs[0], out=bufs[1])
    if op == "gather":  # onto rank 0; the others' outputs stay unused
        return lambda bufs: comm.gather(bufs[0], 0, out=bufs[1] if comm.rank == 0 else None)
    if op == "scatter":  # from rank 0; the others pass no input
        return lambda bufs: comm.scatter(bufs[0] if comm.rank == 0 else None, 0, out=bufs[1])
    if op == "send_recv":
        return _send_or_recv(comm)
    return lambda bufs: comm.all_to_all(bufs[0], out=bufs[1])


def _send_or_recv(comm: collsvc.Communicator) -> Callable[[BufferSet], object]:
    """send_recv: an even rank sends its buffer to the next rank, which receives into its own; an odd
    world's last rank has no partner and does nothing."""
    rank = comm.rank
    if rank % 2 == 1:
        return lambda bufs: comm.recv(rank - 1, out=bufs[0])
    if rank + 1 < comm.size:
        return lambda bufs: comm.send(bufs[0], rank + 1)
    return lambda bufs: None


def _check(comm: collsvc.Communicator, op: str, shape: protocol.Layout, xp: Any, dtype: Any) -> None:
    """One more call of ``op`` on inputs filled with rank + 1, compared with the expected result.

    Raises:
        ResultCheckError: the result differs.
    """
    n, rank = comm.size, comm.rank
    x = xp.full(shape.in_count, rank + 1, dtype=dtype)
    total = n * (n + 1) // 2
    expected: np.ndarray[Any, Any] | None
    rank_blocks = np.repeat(np.arange(1, n + 1), shape.count // n)  # block r holds r + 1
    if op == "all_reduce":
        result, expected = comm.all_reduce(x), np.full(shape.count, total)
    elif op == "broadcast":
        result, expected = comm.broadcast(x, 0), np.full(shape.count, 1)
    elif op == "reduce":
        result = comm.reduce(x, 0)
        expected = np.full(shape.count, total) if rank == 0 else None
    elif op == "all_gather":
        result, expected = comm.all_gather(x), rank_blocks
    elif op == "reduce_scatter":
        result, expected = comm.reduce_scatter(x), np.full(shape.count // n, total)
    elif op == "gather":
        result = comm.gather(x, 0)
        expected = rank_blocks if rank == 0 else None
    elif op == "scatter":  # rank 0's input holds 1 everywhere
        block = xp.empty(shape.count // n, dtype=dtype)
        result, expected = comm.scatter(x if rank == 0 else None, 0, out=block), np.ones(shape.count // n)
    elif op == "send_recv":  # rank r receives r (its sender's rank + 1); senders and the idle get None
        result = _send_or_recv(comm)((x, None))  # what recv returned; None from send and the idle rank
        comm.barrier()  # no rank moves on (or leaves, after the last size) while its receiver still waits
        expected = np.full(shape.count, rank) if rank % 2 == 1 else None
    else:
        result, expected = comm.all_to_all(x), rank_blocks
    if expected is None:
        if result is not None:
            raise ResultCheckError(f"{op} returned an array on rank {rank}, not the destination")
        return
    got = np.asarray(result.get() if hasattr(result, "get") else result, dtype=np.float64).reshape(-1)
    if got.shape != expected.shape or not np.array_equal(got, expected):
        raise ResultCheckError(f"{op} on rank {rank}: got {got[:8]}..., expected {expected[:8]}...")


def _synchronized(launch: Callable[[BufferSet], object], xp: Any) -> Callable[[BufferSet], object]:
    """``launch`` followed by waiting for the GPU stream, so the timed call includes the GPU's work."""

    def run(bufs: BufferSet) -> None:
        launch(bufs)
        xp.cuda.get_current_stream().synchronize()

    return run


def _measure_size(
    comm: collsvc.Communicator, config: dict[str, Any], nbytes: int, xp: Any, dtype: Any
) -> dict[str, Any]:
    """One size through the shared protocol; the row is the same on every rank.

    Raises:
        ResultCheckError: ``check`` is on and a result is wrong.
    """
    n, op = comm.size, config["op"]
    shape = protocol.layout(op, nbytes, n, dtype.itemsize)
    buffers: list[BufferSet] = [
        (xp.ones(shape.in_count, dtype=dtype), xp.ones(shape.out_count, dtype=dtype) if shape.out_count else None)
        for _ in range(protocol.rotation_count(shape.set_bytes(dtype.itemsize)))
    ]
    run = _collective(comm, op)
    if config["device"] == "cuda":
        run = _synchronized(run, xp)

    def gather(values: list[float]) -> list[list[float]]:
        every: list[list[float]] = comm.all_gather(np.asarray(values, dtype=np.float64)).reshape(n, -1).tolist()
        return every

    result = protocol.measure(
        run, buffers, barrier=comm.barrier, gather=gather, warmup=config["warmup"], iterations=config["iters"]
    )
    if config["check"]:
        _check(comm, op, shape, xp, dtype)
    row = protocol.result_row(op, n, shape, config["dtype"], dtype.itemsize, len(buffers), result)
    row["backend"] = comm.backend
    return row


def main() -> int:
    # Reads the environment itself: COLLSVC_BENCH and COLLSVC_BACKEND are what `collsvc bench` wrote for it.
    config = json.loads(os.environ["COLLSVC_BENCH"])
    try:
        comm = collsvc.init(backend=os.environ.get("COLLSVC_BACKEND", "auto"))
    except collsvc.CollsvcError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    dtype = numpy_dtype(config["dtype"])
    xp: Any = np
    if config["device"] == "cuda":
        import cupy

        cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()  # the GPU reported at join
        xp = cupy
    rows = []
    try:
        for index, nbytes in enumerate(config["sizes"]):
            rows.append(_measure_size(comm, config, nbytes, xp, dtype))
            if comm.rank == 0 and config["progress"]:
                progress = f"\r[{index + 1}/{len(config['sizes'])}] {rows[-1]['bytes']} bytes"
                print(progress, end="", file=sys.stderr, flush=True)
    except ResultCheckError as exc:
        print(f"collsvc bench: wrong result: {exc}", file=sys.stderr)
        return 3
    finally:
        # A clean departure: ranks still waiting in a call this rank never finished fail at once.
        collsvc.destroy()
    if comm.rank == 0:
        if config["progress"]:
            print(file=sys.stderr)
        print(json.dumps(rows), flush=True)  # the last line of rank 0's stdout: what collsvc.bench.harness reads
    return 0


if __name__ == "__main__":
    sys.exit(main())
