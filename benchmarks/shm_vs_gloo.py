"""all_reduce on one host: collsvc's shared-memory LocalGroup against torch.distributed's gloo.

Spawns N rank processes per backend; both follow collsvc/bench/protocol.py (the protocol of
compare_gloo.py): each library's own barrier before every call, rotated buffers, an iteration's time
is the slowest rank's. Prints p50 and p99 over the iterations and the bus bandwidth at p50,
2 (n - 1) / n * bytes / time, per size. gloo runs with torch.set_num_threads(1).

    python benchmarks/shm_vs_gloo.py --ranks 2 4 --sizes 4K 1M 16M 64M
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from collsvc.bench.protocol import Measurement, layout, measure, rotation_count

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _parse_size(text: str) -> int:
    unit = _UNITS.get(text[-1].upper())
    return int(text[:-1]) * unit if unit else int(text)


def _iterations(nbytes: int) -> int:
    return max(5, min(200, (256 << 20) // max(nbytes, 1) // 4))


WARMUP = 2
# Results per size: (p50, p99) seconds.
Results = dict[int, tuple[float, float]]


def _measure_sizes(
    sizes: list[int],
    size: int,
    make_buffer: Callable[[int], Any],
    all_reduce: Callable[[Any], object],
    barrier: Callable[[], object],
    gather: Callable[[list[float]], list[list[float]]],
) -> Results:
    results = {}
    for nbytes in sizes:
        shape = layout("all_reduce", nbytes, size, 4)
        buffers = [make_buffer(shape.count) for _ in range(rotation_count(shape.set_bytes(4)))]
        result: Measurement = measure(
            all_reduce, buffers, barrier=barrier, gather=gather, warmup=WARMUP, iterations=_iterations(nbytes)
        )
        results[nbytes] = (result.p50, result.p99)
    return results


def _collsvc_rank(rank: int, size: int, namespace: str, sizes: list[int], slot: int, queue: Any) -> None:
    from collsvc.client.backends.shm import LocalGroup
    from collsvc.types import ReduceOp

    group = LocalGroup(namespace, rank, size, slot_bytes=slot, timeout=60)

    def deadline() -> float:
        return time.monotonic() + 60

    def gather(values: list[float]) -> list[list[float]]:
        every = np.empty(size * len(values), np.float64)
        group.all_gather(np.asarray(values, np.float64), every, deadline())
        rows: list[list[float]] = every.reshape(size, -1).tolist()
        return rows

    results = _measure_sizes(
        sizes,
        size,
        lambda count: np.ones(count, np.float32),
        lambda buf: group.all_reduce(buf, ReduceOp.SUM, deadline()),
        lambda: group.barrier(deadline()),
        gather,
    )
    group.close()
    if rank == 0:
        queue.put(results)


def _gloo_rank(rank: int, size: int, store_path: str, sizes: list[int], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)

    def gather(values: list[float]) -> list[list[float]]:
        every = torch.empty(size * len(values), dtype=torch.float64)
        # torch 2.13 renamed all_gather_into_tensor (the old name warns on each call).
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(every, torch.tensor(values, dtype=torch.float64))
        rows: list[list[float]] = every.view(size, -1).tolist()
        return rows

    results = _measure_sizes(
        sizes, size, lambda count: torch.ones(count, dtype=torch.float32), dist.all_reduce, dist.barrier, gather
    )
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def _run(target: Any, size: int, extra: tuple[Any, ...]) -> Results:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, size, *extra, queue)) for r in range(size)]
    for proc in procs:
        proc.start()
    results: Results = queue.get(timeout=600)
    for proc in procs:
        proc.join(60)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["4K", "1M", "16M", "64M"])
    parser.add_argument("--slot", default="4M", help="LocalGroup slot_bytes")
    parser.add_argument("--no-gloo", action="store_true", help="skip torch gloo")
    args = parser.parse_args()
    sizes = [_parse_size(s) for s in args.sizes]
    print(
        f"{'ranks':>5} {'bytes':>10} {'collsvc p50 ms':>14} {'p99 ms':>9} {'busbw GB/s':>11}"
        f" {'gloo p50 ms':>11} {'p99 ms':>9} {'busbw GB/s':>11}"
    )
    for size in args.ranks:
        ours = _run(_collsvc_rank, size, (uuid.uuid4().hex, sizes, _parse_size(args.slot)))
        theirs: Results = {}
        if not args.no_gloo:
            with tempfile.TemporaryDirectory() as tmp:
                theirs = _run(_gloo_rank, size, (os.path.join(tmp, "store"), sizes))
        for nbytes in sizes:
            factor = 2 * (size - 1) / size * nbytes / 1e9
            p50, p99 = ours[nbytes]
            gloo = theirs.get(nbytes)
            gloo_text = f"{gloo[0] * 1e3:11.3f} {gloo[1] * 1e3:9.3f} {factor / gloo[0]:11.2f}" if gloo else ""
            print(
                f"{size:5d} {nbytes:10d} {p50 * 1e3:14.3f} {p99 * 1e3:9.3f} {factor / p50:11.2f} {gloo_text}".rstrip()
            )


if __name__ == "__main__":
    main()
