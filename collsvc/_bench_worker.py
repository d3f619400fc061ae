"""One rank of ``collsvc bench`` (configured through the COLLSVC_BENCH environment variable)."""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from typing import Any

import numpy as np

import collsvc
from collsvc.bench import bus_factor
from collsvc.types import numpy_dtype

# Each size gets at most this many seconds of timed iterations (large sizes on 2 cores are slow).
SECONDS_PER_SIZE = 3.0


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _operation(comm: collsvc.Communicator, op: str, x: Any, out: Any) -> Any:
    if op == "all_reduce":
        return comm.all_reduce(x, out=out)
    if op == "all_gather":
        return comm.all_gather(x, out=out)
    if op == "reduce_scatter":
        return comm.reduce_scatter(x, out=out)
    if op == "broadcast":
        return comm.broadcast(x, 0, out=out)
    if op == "reduce":
        return comm.reduce(x, 0, out=out if comm.rank == 0 else None)
    return comm.all_to_all(x, out=out)


def main() -> int:
    config = json.loads(os.environ["COLLSVC_BENCH"])
    try:
        comm = collsvc.init(backend=os.environ.get("COLLSVC_BACKEND", "auto"))
    except collsvc.CollsvcError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    n, op = comm.size, config["op"]
    dtype = numpy_dtype(config["dtype"])
    xp: Any = np
    if config["device"] == "cuda":
        import cupy

        cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()  # the GPU reported at join
        xp = cupy
    rows = []
    for index, nbytes in enumerate(config["sizes"]):
        # nccl-tests convention: the size is the larger buffer (output of all_gather, input of reduce_scatter).
        count = max(nbytes // dtype.itemsize, 1)
        count -= count % n if op in ("reduce_scatter", "all_to_all", "all_gather") and count >= n else 0
        in_count = count // n if op == "all_gather" else count
        out_count = count // n if op == "reduce_scatter" else count
        x = xp.ones(max(in_count, 1), dtype=dtype)
        out = xp.empty(max(out_count, 1), dtype=dtype)
        warm_start = time.perf_counter()
        for _ in range(config["warmup"]):
            _operation(comm, op, x, out)
        per_call = (time.perf_counter() - warm_start) / max(config["warmup"], 1)
        # Every rank must run the same number of iterations (a rank that stopped on its own clock would
        # call the next collective while the others still run this one: a mismatch). The slowest
        # rank's warm-up sets how many fit the time budget.
        per_call = float(comm.all_reduce(np.array([per_call]), collsvc.MAX)[0])
        iterations = max(min(config["iters"], int(SECONDS_PER_SIZE / max(per_call, 1e-9))), 3)
        comm.barrier()
        times: list[float] = []
        cpu_start = _cpu_seconds()
        for _ in range(iterations):
            start = time.perf_counter()
            _operation(comm, op, x, out)
            if config["device"] == "cuda":
                xp.cuda.get_current_stream().synchronize()
            times.append(time.perf_counter() - start)
        cpu = _cpu_seconds() - cpu_start
        # The slowest rank defines each iteration's time.
        count_times = len(times)
        slowest = comm.all_reduce(np.array(times), collsvc.MAX)
        seconds = float(statistics.median(slowest.tolist()))
        if config["check"] and op == "all_reduce":
            assert float(out.reshape(-1)[0]) == float(n), "all_reduce result is wrong"
        size_bytes = count * dtype.itemsize
        algbw = size_bytes / seconds / 1e9
        gb_moved = size_bytes * max(count_times, 1) / 1e9
        rows.append(
            {
                "op": op,
                "ranks": n,
                "bytes": size_bytes,
                "count": count,
                "dtype": config["dtype"],
                "seconds": seconds,
                "algbw": algbw,
                "busbw": algbw * bus_factor(op, n),
                "cpu_s_per_gb": cpu / gb_moved if gb_moved else 0.0,
                "iters": count_times,
                "backend": comm.backend,
            }
        )
        if comm.rank == 0 and config["progress"]:
            print(
                f"\r[{index + 1}/{len(config['sizes'])}] {size_bytes} bytes",
                end="",
                file=sys.stderr,
                flush=True,
            )
    if comm.rank == 0:
        if config["progress"]:
            print(file=sys.stderr)
        with open(config["result"], "w", encoding="utf-8") as handle:
            json.dump(rows, handle)
    collsvc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
