"""collsvc's NCCL all_reduce at world size 1 vs calling CuPy's NcclCommunicator.allReduce directly,
side by side in one run (needs a CUDA GPU, CuPy and NCCL; without them it says so and exits 0).

Usage: python benchmarks/nccl_overhead.py [--sizes 1M,16M,256M] [--iters 50]
Prints one row per size: direct time, collsvc time, overhead %. Goal: within 5 % at >= 1 MiB.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collsvc.bench import parse_size  # noqa: E402


def timed(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    import cupy

    stream = cupy.cuda.get_current_stream()
    samples = []
    for _ in range(iters):
        stream.synchronize()
        start = time.perf_counter()
        fn()
        stream.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1M,16M,256M")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    from collsvc.client.backends.nccl.probe import load_cupy
    from collsvc.errors import BackendUnavailableError

    try:
        cupy, nccl = load_cupy()
    except BackendUnavailableError as exc:
        # Not a failure of the benchmark: there is nothing to measure on this machine.
        print(f"nccl_overhead.py needs a GPU, skipped: {exc}", file=sys.stderr)
        return 0

    import collsvc
    from collsvc.options import CoordinatorOptions
    from collsvc.server.app import CoordinatorThread

    with CoordinatorThread(CoordinatorOptions(host="127.0.0.1", port=0, token="bench")) as thread:
        comm = collsvc.init(coordinator=thread.address, world_size=1, rank=0, backend="nccl", token="bench")
        direct = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        print(f"{'size':>12} {'direct(us)':>11} {'collsvc(us)':>12} {'overhead':>9}")
        for text in args.sizes.split(","):
            count = parse_size(text) // 4
            x = cupy.ones(count, dtype=cupy.float32)
            out = cupy.empty_like(x)
            stream = cupy.cuda.get_current_stream()

            def run_direct(x: Any = x, out: Any = out, count: int = count, stream: Any = stream) -> None:
                direct.allReduce(x.data.ptr, out.data.ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)

            def run_collsvc(x: Any = x, out: Any = out) -> None:
                comm.all_reduce(x, out=out)

            for fn in (run_direct, run_collsvc):
                timed(fn, 5)  # warm up both
            a, b = [], []
            for _ in range(3):  # alternate so clocks and caches hit both alike
                a.append(timed(run_direct, args.iters))
                b.append(timed(run_collsvc, args.iters))
            t_direct, t_ours = statistics.median(a), statistics.median(b)
            print(
                f"{count * 4:>12} {t_direct * 1e6:>11.1f} {t_ours * 1e6:>12.1f} {100 * (t_ours / t_direct - 1):>8.1f}%"
            )
        collsvc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
