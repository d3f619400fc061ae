"""all_reduce on one host: collsvc's shared-memory LocalGroup against torch.distributed's gloo.

Spawns N rank processes per backend; every iteration starts after a barrier and rank 0 times it.
Prints the median time and the bus bandwidth, 2 (n - 1) / n * bytes / time, per size.

    python benchmarks/shm_vs_gloo.py --ranks 2 4 --sizes 4K 1M 16M 64M
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import uuid
from typing import Any

import numpy as np

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _parse_size(text: str) -> int:
    unit = _UNITS.get(text[-1].upper())
    return int(text[:-1]) * unit if unit else int(text)


def _iterations(nbytes: int) -> int:
    return max(5, min(200, (256 << 20) // max(nbytes, 1) // 4))


def _collsvc_rank(rank: int, size: int, namespace: str, sizes: list[int], slot: int, queue: Any) -> None:
    from collsvc.client.backends.shm import LocalGroup
    from collsvc.types import ReduceOp

    group = LocalGroup(namespace, rank, size, slot_bytes=slot, timeout=60)
    results = {}
    for nbytes in sizes:
        buf = np.ones(nbytes // 4, np.float32)
        times = []
        for it in range(_iterations(nbytes) + 2):
            group.barrier(time.monotonic() + 60)
            start = time.perf_counter()
            group.all_reduce(buf, ReduceOp.SUM, time.monotonic() + 60)
            if it >= 2:  # warm-up
                times.append(time.perf_counter() - start)
        results[nbytes] = statistics.median(times)
    group.close()
    if rank == 0:
        queue.put(results)


def _gloo_rank(rank: int, size: int, store_path: str, sizes: list[int], queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
    results = {}
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        times = []
        for it in range(_iterations(nbytes) + 2):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            if it >= 2:
                times.append(time.perf_counter() - start)
        results[nbytes] = statistics.median(times)
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def _run(target: Any, size: int, extra: tuple[Any, ...]) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, size, *extra, queue)) for r in range(size)]
    for proc in procs:
        proc.start()
    results: dict[int, float] = queue.get(timeout=600)
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
    print(f"{'ranks':>5} {'bytes':>10} {'collsvc ms':>11} {'busbw GB/s':>11} {'gloo ms':>9} {'busbw GB/s':>11}")
    for size in args.ranks:
        ours = _run(_collsvc_rank, size, (uuid.uuid4().hex, sizes, _parse_size(args.slot)))
        theirs: dict[int, float] = {}
        if not args.no_gloo:
            with tempfile.TemporaryDirectory() as tmp:
                theirs = _run(_gloo_rank, size, (os.path.join(tmp, "store"), sizes))
        for nbytes in sizes:
            factor = 2 * (size - 1) / size * nbytes / 1e9
            gloo = theirs.get(nbytes)
            gloo_text = f"{gloo * 1e3:9.3f} {factor / gloo:11.2f}" if gloo else f"{'-':>9} {'-':>11}"
            print(f"{size:5d} {nbytes:10d} {ours[nbytes] * 1e3:11.3f} {factor / ours[nbytes]:11.2f} {gloo_text}")


if __name__ == "__main__":
    main()
