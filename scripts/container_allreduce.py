"""all_reduce timings of one compose job, for docs/performance.md ("Containers on one host").

Mounted into the worker containers by a compose override (the command is in docs/performance.md);
rank 0 prints one JSON line per size: median milliseconds of 10 calls and the bus bandwidth.
"""

from __future__ import annotations

import json
import time

import numpy as np

import collsvc

SIZES = (4 * 1024, 1024 * 1024, 16 * 1024 * 1024)
WARMUP, ITERS = 3, 10


def main() -> None:
    comm = collsvc.init()
    for nbytes in SIZES:
        data = np.ones(nbytes // 4, dtype=np.float32)
        for _ in range(WARMUP):
            comm.all_reduce(data)
        times = []
        for _ in range(ITERS):
            start = time.perf_counter()
            comm.all_reduce(data)
            times.append(time.perf_counter() - start)
        median = sorted(times)[ITERS // 2]
        busbw = 2 * (comm.size - 1) / comm.size * nbytes / median / 1e9
        if comm.rank == 0:
            print(
                json.dumps(
                    {"ranks": comm.size, "bytes": nbytes, "ms": round(median * 1e3, 3), "busbw_GBps": round(busbw, 3)}
                ),
                flush=True,
            )
    collsvc.destroy()


if __name__ == "__main__":
    main()
