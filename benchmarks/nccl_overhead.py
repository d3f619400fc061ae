"""collsvc's NCCL all_reduce at world size 1 vs calling CuPy's NcclCommunicator.allReduce directly,
side by side in one run (needs a CUDA GPU, CuPy and NCCL; without them it says so and exits 0).

Usage: python benchmarks/nccl_overhead.py [--sizes 1M,16M,256M] [--iters 50]
       python benchmarks/nccl_overhead.py --stand-in [--iters 2000]
Prints one row per size: direct time, collsvc time, overhead %. Goal: within 5 % at >= 1 MiB.

With ``--stand-in`` it runs on CPU through the in-process NCCL stand-in (``tests/gpu/fake_cupy.py``, put
in place as ``cupy``), whose calls return at once like an enqueue: what it measures is the host cost
per call, in Python: the median of ``comm.all_reduce(x, out=x)`` of a 4 KiB float32 array minus the
median of a bare ``allReduce`` of the stand-in with the same arguments. It ends with the line
``host cost per call: comm.all_reduce X us, dist.all_reduce Y us`` (Y: not measured here, see docs/gpu.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collsvc.bench.harness import parse_size  # noqa: E402


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


def per_call(fn: Any, iters: int, batch: int = 50) -> float:
    """Median seconds per call of ``fn`` over batches of ``batch`` calls (host time only)."""
    samples = []
    for _ in range(max(1, iters // batch)):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - start) / batch)
    return statistics.median(samples)


def stand_in(iters: int, rounds: int) -> int:
    from tests.gpu import fake_cupy

    cupy = fake_cupy.install()
    nccl = cupy.cuda.nccl
    import collsvc
    from collsvc.options import CoordinatorOptions
    from collsvc.server.app import CoordinatorThread

    with CoordinatorThread(CoordinatorOptions(host="127.0.0.1", port=0, token="bench")) as thread:
        comm = collsvc.init(coordinator=thread.address, world_size=1, rank=0, backend="nccl", token="bench")
        direct = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        x = cupy.ones(1024, dtype="float32")  # 4 KiB
        stream = cupy.cuda.get_current_stream()
        p = x.data.ptr
        rounds = max(1, rounds)

        def bare() -> None:
            direct.allReduce(p, p, 1024, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)

        def ours() -> None:
            comm.all_reduce(x, out=x)

        for fn in (bare, ours):
            per_call(fn, 200)  # warm up; the first collsvc call creates the communicator
        bares, costs, speeds = [], [], []
        for _ in range(rounds):  # alternate, so both see the same machine
            bares.append(per_call(bare, iters))
            costs.append(per_call(ours, iters) - bares[-1])
            speeds.append(machine_speed())
        t_bare, cost = statistics.median(bares), statistics.median(costs)
        print("stand-in (CPU): 4 KiB float32 all_reduce at world size 1, host time per call (medians)")
        print(f"{'bare stand-in allReduce':>34} {t_bare * 1e6:8.2f} us")
        print(f"{'comm.all_reduce(x, out=x) - bare':>34} {cost * 1e6:8.2f} us (best round {min(costs) * 1e6:.2f} us)")
        print(f"machine speed: sum(range(10)) takes {min(speeds) * 1e9:.0f} ns here at best (quiet: {QUIET_NS} ns)")
        collsvc.destroy()
    print(f"host cost per call: comm.all_reduce {cost * 1e6:.1f} us, dist.all_reduce n/a us")
    return 0


# ``python -m timeit "sum(range(10))"`` on the machine docs/performance.md measured on, when quiet.
QUIET_NS = 285


def machine_speed() -> float:
    """Seconds of one ``sum(range(10))`` here now (best of 5), to read host costs on a loaded machine."""
    import timeit

    return min(timeit.repeat("sum(range(10))", number=20000, repeat=5)) / 20000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1M,16M,256M")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--stand-in", action="store_true", help="measure the host cost on CPU (no GPU needed)")
    parser.add_argument("--rounds", type=int, default=7, help="--stand-in: alternating rounds (medians)")
    args = parser.parse_args()
    if args.stand_in:
        return stand_in(args.iters, args.rounds)
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
            # Host cost: calls that return once enqueued, in place (the fast path), timed without syncing.
            ours = per_call(lambda x=x: comm.all_reduce(x, out=x), 20 * args.iters)
            stream.synchronize()
            print(f"{'':>12} host time per comm.all_reduce(x, out=x), not waiting: {ours * 1e6:.1f} us")
            backend: Any = comm._job.nccl  # the same calls as with COLLSVC_NCCL_BLOCKING_WAIT=1
            backend._blocking = True
            blocking = timed(lambda x=x, out=out: comm.all_reduce(x, out=out), args.iters)
            backend._blocking = False
            print(f"{'':>12} comm.all_reduce(x, out=out) with COLLSVC_NCCL_BLOCKING_WAIT=1: {blocking * 1e6:.1f} us")
        collsvc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
