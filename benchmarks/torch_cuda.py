"""torch.distributed on collsvc with CUDA tensors vs collsvc's own API vs torch's NCCL backend, one GPU.

Usage: python benchmarks/torch_cuda.py [--sizes 4K,1M,16M,256M] [--iters 50] [--repeats 3]

World size 1 (NCCL refuses two ranks on one GPU, so this is the one NCCL job a single GPU can run):
one process joins ``init_process_group("collsvc")`` (NCCL through CuPy) and makes a group of torch's
own ``"nccl"`` backend. For each size it alternates ``dist.all_reduce`` on collsvc, ``comm.all_reduce``
on the same Communicator (in place), and ``dist.all_reduce`` on torch's NCCL, ``--repeats`` times, each
call followed by ``torch.cuda.synchronize()``, and prints the median time per call: at world size 1 this
is the per-call cost of each layer (NCCL's own copy is the floor). Without a GPU, CuPy or NCCL it says
so and exits 0. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from collsvc.bench.harness import parse_size  # noqa: E402


def _per_call(fn: Callable[[], object], iters: int) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _unavailable() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    from collsvc.client.backends.nccl.probe import unavailable_reason

    return unavailable_reason()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4K,1M,16M,256M")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    reason = _unavailable()
    if reason is not None:
        print(f"torch_cuda.py needs a GPU, skipped: {reason}", file=sys.stderr)
        return 0

    import torch
    import torch.distributed as dist

    import collsvc.torch  # noqa: F401 - registers the backend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name in [k for k in os.environ if k.startswith("COLLSVC_COORDINATOR")]:
        del os.environ[name]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("collsvc")
    comm = dist.distributed_c10d._get_default_group().communicator
    nccl = dist.new_group(backend="nccl")
    print(f"collsvc data plane: {comm.backend}; GPU: {torch.cuda.get_device_name(0)}")
    print(f"{'size':>10} {'dist collsvc(us)':>17} {'comm(us)':>9} {'dist nccl(us)':>14} {'collsvc/comm':>13}")
    rows = []
    for text in args.sizes.split(","):
        size = parse_size(text)
        t = torch.ones(size // 4, dtype=torch.float32, device="cuda")
        ways: dict[str, Callable[[], object]] = {
            "dist_collsvc": lambda t=t: dist.all_reduce(t),
            "comm": lambda t=t: comm.all_reduce(t, out=t),
            "dist_nccl": lambda t=t: dist.all_reduce(t, group=nccl),
        }
        for fn in ways.values():
            _per_call(fn, 3)  # warm up: communicators, buffers
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.repeats):  # alternate so clocks and caches treat each alike
            for name, fn in ways.items():
                times[name].append(_per_call(fn, args.iters))
        row = {"size": size, **{name: statistics.median(v) for name, v in times.items()}}
        rows.append(row)
        print(
            f"{size:>10} {row['dist_collsvc'] * 1e6:>17.1f} {row['comm'] * 1e6:>9.1f} "
            f"{row['dist_nccl'] * 1e6:>14.1f} {row['dist_collsvc'] / row['comm']:>12.2f}x"
        )
    dist.destroy_process_group()
    print(json.dumps({"benchmark": "torch_cuda", "world_size": 1, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
