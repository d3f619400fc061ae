"""torch.distributed on collsvc vs collsvc's own API vs gloo, in the same run on the same ranks.

Usage:
    python benchmarks/torch_backend.py [--ranks 2 4] [--sizes 4K,64K,1M,16M,64M] [--repeats 3] [--ddp-steps 8]

Each rank joins one torch job (``init_process_group("collsvc")`` through ``env://``, so rank 0 starts
the embedded coordinator) and also makes a gloo group of the same ranks. For every size it alternates
``dist.all_reduce`` on collsvc, ``comm.all_reduce`` on the same Communicator in place (of the
tensor's numpy view, collsvc's API at its best, which the overhead column compares against; and of
the tensor itself, as a torch user writes it), and ``dist.all_reduce`` on gloo, ``--repeats`` times
(each repeat starting with the next one), and reports
each one's median time per call (a sample is up to 2,000 back-to-back collsvc calls, 256 MiB in all,
and up to 200 gloo calls); the overhead and speed-up columns are medians of the ratios within each
repeat. Then a DDP training step of a ~10.5M-parameter MLP is timed on both backends. Every process
runs with ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``.

It also times ``dist.all_reduce`` of a 4 KiB tensor on a Python process group that does nothing (its
``allreduce`` returns a finished Work): torch's own cost of dispatching a collective to a backend
written in Python, the floor under any such backend's overhead over its own API; and the same on
torch's own process group in C++ that does nothing (the "fake" backend of torch's test suite): the
floor for a backend written in C++.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def human(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


def _timed(fn: Any, iters: int, barrier: Any) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _register_noop_backend() -> None:
    """A backend whose collectives do nothing: what torch.distributed costs around a Python backend."""
    import torch.distributed as dist

    class Done(dist.Work):  # type: ignore[misc]
        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    class NoopGroup(dist.ProcessGroup):  # type: ignore[misc]
        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            return Done()

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return "noop_floor"

    if "NOOP_FLOOR" not in dist.Backend._plugins:
        dist.Backend.register_backend(
            "noop_floor", lambda store, rank, size, timeout: NoopGroup(rank, size), devices=["cpu"]
        )


def rank_main(config: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import collsvc.torch  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    dist.init_process_group("collsvc")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    _register_noop_backend()
    noop = dist.new_group(backend="noop_floor")
    comm = dist.distributed_c10d._get_default_group().communicator
    barrier = comm.barrier
    rows = []
    for size in config["sizes"]:
        t = torch.ones(size // 4, dtype=torch.float32)
        a = t.numpy()
        # collsvc's calls are ~100x gloo's at small sizes: as many of them make a sample long enough
        # (~50 ms and up) that one descheduled rank on these 2 cores does not decide it.
        ours = max(4, min(2000, (256 << 20) // size))
        theirs = max(3, min(200, (32 << 20) // size))
        iters = {"dist_collsvc": ours, "comm": ours, "comm_tensor": ours, "dist_gloo": theirs}
        ways = {
            "dist_collsvc": lambda t=t: dist.all_reduce(t),
            # collsvc's own API at its best on the same memory: the tensor's numpy view, in place.
            "comm": lambda a=a: comm.all_reduce(a, out=a),
            # the same API as a torch user writes it: the tensor itself, in place
            "comm_tensor": lambda t=t: comm.all_reduce(t, out=t),
            "dist_gloo": lambda t=t: dist.all_reduce(t, group=gloo),
        }
        for fn in ways.values():  # warm up: buffers, shared memory, gloo's pairs
            fn()
        times: dict[str, list[float]] = {name: [] for name in ways}
        order = list(ways)
        for repeat in range(config["repeats"]):
            # Each repeat starts with the next way, so that none always runs right after gloo's (whose
            # buffers then fill the caches) or always first.
            shift = repeat % len(order)
            for name in order[shift:] + order[:shift]:
                times[name].append(_timed(ways[name], iters[name], barrier))
        # The ratios are taken within each repeat, between samples next to each other in time, then
        # their median: a machine whose copy speed shifts between repeats moves both sides of a ratio.
        ours, own, theirs = times["dist_collsvc"], times["comm"], times["dist_gloo"]
        rows.append(
            {
                "size": size,
                **{name: statistics.median(v) for name, v in times.items()},
                "overhead": statistics.median(d / c - 1 for d, c in zip(ours, own, strict=True)),
                "speedup": statistics.median(g / d for d, g in zip(ours, theirs, strict=True)),
            }
        )
    steps: dict[str, Any] = {}
    for name, group in (("collsvc", None), ("gloo", gloo)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1280, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1280))
        wrapped = DistributedDataParallel(model, process_group=group)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
        x, y = torch.randn(32, 1280), torch.randn(32, 1280)

        def step(wrapped: Any = wrapped, optimizer: Any = optimizer, x: Any = x, y: Any = y) -> None:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()

        step()
        step()
        steps[name] = step
    ddp: dict[str, float] = {"params": float(sum(p.numel() for p in model.parameters()))}
    step_times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(config["repeats"]):  # alternating, as for the all_reduce sizes
        for name, step in steps.items():
            step_times[name].append(_timed(step, config["ddp_steps"], barrier))
    ddp.update({name: statistics.median(v) for name, v in step_times.items()})
    small = torch.ones(1024, dtype=torch.float32)
    floor = statistics.median(
        _timed(lambda: dist.all_reduce(small, group=noop), 2000, barrier) for _ in range(config["repeats"])
    )
    # torch's own backend written in C++ that does nothing (its test suite's "fake" process group):
    # the same floor for a backend in C++.
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend

    fake = dist.new_group(backend="fake")
    cpp_floor = statistics.median(
        _timed(lambda: dist.all_reduce(small, group=fake), 2000, barrier) for _ in range(config["repeats"])
    )
    if rank == 0:
        with open(config["result"], "w", encoding="utf-8") as handle:
            json.dump({"rows": rows, "ddp": ddp, "dispatch_floor": floor, "cpp_floor": cpp_floor}, handle)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(n: int, config: dict[str, Any]) -> dict[str, Any]:
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    config = {**config, "result": result}
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLSVC_COORDINATOR")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-config", json.dumps(config)],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
        )
        for r in range(n)
    ]
    try:
        for proc in procs:
            if proc.wait(timeout=1200):
                raise RuntimeError(f"a rank exited {proc.returncode}")
        with open(result, encoding="utf-8") as handle:
            data: dict[str, Any] = json.load(handle)
        return data
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        os.unlink(result)


def table(n: int, data: dict[str, Any]) -> str:
    lines = [
        f"**{n} ranks**",
        "",
        "| size | dist.all_reduce on collsvc | comm.all_reduce (numpy view) | comm.all_reduce (the tensor) "
        "| dist.all_reduce on gloo | overhead vs comm | speed-up vs gloo |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in data["rows"]:
        ours, own, tensor, gloo = row["dist_collsvc"], row["comm"], row["comm_tensor"], row["dist_gloo"]
        lines.append(
            f"| {human(row['size'])} | {ours * 1e3:.3f} ms | {own * 1e3:.3f} ms | {tensor * 1e3:.3f} ms "
            f"| {gloo * 1e3:.3f} ms | {100 * row['overhead']:+.0f} % | {row['speedup']:.1f}x |"
        )
    ddp = data["ddp"]
    lines += [
        "",
        f"DDP step, {ddp['params'] / 1e6:.1f}M-parameter MLP: collsvc {ddp['collsvc'] * 1e3:.0f} ms, "
        f"gloo {ddp['gloo'] * 1e3:.0f} ms ({ddp['gloo'] / ddp['collsvc']:.2f}x).",
    ]
    first = data["rows"][0]
    lines += [
        "",
        f"torch's dispatch to a Python backend that does nothing: {data['dispatch_floor'] * 1e6:.1f} us per "
        f"dist.all_reduce; to torch's own C++ backend that does nothing: {data['cpp_floor'] * 1e6:.1f} us; "
        f"10 % of comm.all_reduce at {human(first['size'])}: {first['comm'] * 1e5:.1f} us.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ddp-steps", type=int, default=8)
    parser.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        return
    config = {
        "sizes": [parse_size(s) for s in args.sizes.split(",")],
        "repeats": args.repeats,
        "ddp_steps": args.ddp_steps,
    }
    for n in args.ranks:
        print(table(n, run_job(n, config)), flush=True)
        print()


if __name__ == "__main__":
    main()
