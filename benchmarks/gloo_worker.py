"""One rank of torch.distributed's gloo backend, measured like collsvc's bench worker.

Started by benchmarks/compare_gloo.py, configured through GLOO_BENCH (JSON); rank 0 writes the rows to
the file it names. The protocol (barrier, rotated buffers, slowest rank, p50/p99) is
collsvc/bench/protocol.py, the same code collsvc's ranks run.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from collsvc.bench import protocol  # noqa: E402

# One buffer set: (input, separate output), the output None where the call works in place.
BufferSet = tuple[torch.Tensor, Any]
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn on each call).
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collective(op: str) -> Callable[[BufferSet], object]:
    """A callable running ``op`` on one buffer set (torch's all_reduce, broadcast, reduce: in place)."""
    if op == "all_reduce":
        return lambda bufs: dist.all_reduce(bufs[0])
    if op == "broadcast":
        return lambda bufs: dist.broadcast(bufs[0], 0)
    if op == "reduce":
        return lambda bufs: dist.reduce(bufs[0], 0)
    if op == "all_gather":
        return lambda bufs: ALL_GATHER(bufs[1], bufs[0])
    if op == "reduce_scatter":
        return lambda bufs: REDUCE_SCATTER(bufs[1], bufs[0])
    if op == "gather":  # onto rank 0, into views of its output tensor
        return lambda bufs: dist.gather(bufs[0], _blocks_on_root(bufs[1]), dst=0)
    if op == "scatter":  # from rank 0, out of views of its input tensor
        return lambda bufs: dist.scatter(bufs[1], _blocks_on_root(bufs[0]), src=0)
    if op == "send_recv":  # even ranks send to the next rank (an odd last rank idles)
        rank, size = dist.get_rank(), dist.get_world_size()
        if rank % 2 == 1:
            return lambda bufs: dist.recv(bufs[0], rank - 1)
        if rank + 1 < size:
            return lambda bufs: dist.send(bufs[0], rank + 1)
        return lambda bufs: None
    return lambda bufs: dist.all_to_all_single(bufs[1], bufs[0])


def _blocks_on_root(whole: torch.Tensor) -> list[torch.Tensor] | None:
    """``whole`` as one view per rank on rank 0 (gather's and scatter's lists), None elsewhere."""
    return list(whole.chunk(dist.get_world_size())) if dist.get_rank() == 0 else None


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's ``values``, in rank order (all ranks pass lists of one length)."""
    mine = torch.tensor(values, dtype=torch.float64)
    every = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64)
    ALL_GATHER(every, mine)
    rows: list[list[float]] = every.view(dist.get_world_size(), -1).tolist()
    return rows


def main() -> int:
    # gloo's best settings on a shared machine: one intra-op thread (and OMP_NUM_THREADS=1, set by
    # compare_gloo.py), as collsvc's ranks use; more threads would only compete for the same cores.
    torch.set_num_threads(1)
    config = json.loads(os.environ["GLOO_BENCH"])
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{config['store']}",
        rank=rank,
        world_size=n,
        timeout=datetime.timedelta(seconds=config["timeout"]),
    )
    op = config["op"]
    itemsize = torch.empty(0, dtype=torch.float32).element_size()
    rows = []
    for nbytes in config["sizes"]:
        shape = protocol.layout(op, nbytes, n, itemsize)
        buffers: list[BufferSet] = [
            (torch.ones(shape.in_count), torch.ones(shape.out_count) if shape.out_count else None)
            for _ in range(protocol.rotation_count(shape.set_bytes(itemsize)))
        ]
        result = protocol.measure(
            collective(op),
            buffers,
            barrier=dist.barrier,
            gather=gather,
            warmup=config["warmup"],
            iterations=config["iters"],
        )
        rows.append(protocol.result_row(op, n, shape, "float32", itemsize, len(buffers), result))
    if rank == 0:
        with open(config["result"], "w", encoding="utf-8") as handle:
            json.dump(rows, handle)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
