"""One rank of torch.distributed's gloo backend, timed the same way as collsvc's bench worker.

Configured through GLOO_BENCH (JSON); rank 0 writes the rows to the file it names.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from collsvc.bench import bus_factor  # noqa: E402

SECONDS_PER_SIZE = 3.0


def run_op(op: str, x: torch.Tensor, out: torch.Tensor, n: int) -> None:
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, x)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, x)
    elif op == "broadcast":
        dist.broadcast(x, 0)
    elif op == "reduce":
        dist.reduce(x, 0)
    else:
        dist.all_to_all_single(out, x)


def main() -> int:
    # One intra-op thread, like collsvc's ranks: on a shared machine extra threads only steal cores.
    torch.set_num_threads(1)
    config = json.loads(os.environ["GLOO_BENCH"])
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{config['port']}", rank=rank, world_size=n)
    op = config["op"]
    rows = []
    for nbytes in config["sizes"]:
        count = max(nbytes // 4, 1)
        count -= count % n if op in ("reduce_scatter", "all_to_all", "all_gather") and count >= n else 0
        in_count = count // n if op == "all_gather" else count
        out_count = count // n if op == "reduce_scatter" else count
        x = torch.ones(max(in_count, 1), dtype=torch.float32)
        out = torch.empty(max(out_count, 1), dtype=torch.float32)
        for _ in range(config["warmup"]):
            run_op(op, x, out, n)
        dist.barrier()
        times = []
        end = time.perf_counter() + SECONDS_PER_SIZE
        for i in range(config["iters"]):
            start = time.perf_counter()
            run_op(op, x, out, n)
            times.append(time.perf_counter() - start)
            if i >= 2 and time.perf_counter() > end:
                break
        counts = torch.tensor([len(times)])
        dist.all_reduce(counts, op=dist.ReduceOp.MIN)
        slowest = torch.tensor(times[: int(counts[0])], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = float(statistics.median(slowest.tolist()))
        size_bytes = count * 4
        algbw = size_bytes / seconds / 1e9
        rows.append(
            {
                "op": op,
                "ranks": n,
                "bytes": size_bytes,
                "seconds": seconds,
                "algbw": algbw,
                "busbw": algbw * bus_factor(op, n),
            }
        )
    if rank == 0:
        with open(config["result"], "w", encoding="utf-8") as handle:
            json.dump(rows, handle)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
