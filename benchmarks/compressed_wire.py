"""all_reduce with and without ``compression=`` between two hosts joined by a shaped link.

Two network namespaces on a bridge (tests/netns/topology.py; needs root), each host's egress capped
with ``tc tbf`` (default 1gbit), 1 and 2 ranks per host, float32. Each job runs every compression at
every size in turn (the order rotates per iteration), with a barrier before each call; a call's time
is the slowest rank's. The job is repeated ``--repeats`` times; the table shows the median over the
repeats of each job's median, and the speed-up over the exact wire.

    sudo PYTHONPATH=$PWD python benchmarks/compressed_wire.py --rate 1gbit --sizes 16M,64M --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.netns import topology  # noqa: E402

WIRES = ["exact", "bf16", "fp16", "minmax_uint8"]


def rank_main(sizes: list[int], iters: int) -> None:
    """One rank: every wire at every size; rank 0 prints ``RESULT <json>`` (medians in seconds)."""
    import numpy as np

    import collsvc

    comm = collsvc.init()
    times: dict[str, list[float]] = {}
    rng = np.random.default_rng(comm.rank)
    for size in sizes:
        x = rng.standard_normal(size // 4).astype(np.float32)
        out = np.empty_like(x)
        for it in range(iters + 1):  # the first round warms up
            for k in range(len(WIRES)):
                wire = WIRES[(k + it) % len(WIRES)]
                comm.barrier()
                start = time.perf_counter()
                comm.all_reduce(x, out=out, compression=None if wire == "exact" else wire)
                took = comm.all_reduce(np.array(time.perf_counter() - start), collsvc.MAX)
                if it:
                    times.setdefault(f"{wire}/{size}", []).append(float(took))
    if comm.rank == 0:
        print("RESULT " + json.dumps({key: statistics.median(value) for key, value in times.items()}), flush=True)
    collsvc.destroy()


def job(hosts: dict[str, topology.Host], per_host: int, sizes: list[int], iters: int) -> dict[str, float]:
    token = secrets.token_urlsafe(16)
    a = hosts["a"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLLSVC_TOKEN=token, OMP_NUM_THREADS="1")
    port = 29400 + secrets.randbelow(1000)
    coordinator = subprocess.Popen(
        a.command([sys.executable, "-m", "collsvc", "coordinator", "--host", a.address, "--port", str(port)]),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ranks = []
        for rank in range(2 * per_host):
            host = hosts["a" if rank < per_host else "b"]
            rank_env = dict(
                env,
                COLLSVC_COORDINATOR=f"{a.address}:{port}",
                COLLSVC_WORLD_SIZE=str(2 * per_host),
                COLLSVC_RANK=str(rank),
                COLLSVC_LOCAL_RANK=str(rank % per_host),
                COLLSVC_HOST=host.name,
                COLLSVC_JOB_ID=f"compressed-{per_host}",
            )
            argv = [sys.executable, __file__, "--rank", "--sizes", ",".join(map(str, sizes)), "--iters", str(iters)]
            ranks.append(subprocess.Popen(host.command(argv), env=rank_env, stdout=subprocess.PIPE, text=True))
        outputs = [proc.communicate(timeout=900)[0] for proc in ranks]
        if any(proc.returncode for proc in ranks):
            raise RuntimeError(f"a rank failed: {[proc.returncode for proc in ranks]}")
    finally:
        coordinator.terminate()
        coordinator.wait(10)
    line = next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))
    result: dict[str, float] = json.loads(line.removeprefix("RESULT "))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of each host's egress ('' for none)")
    parser.add_argument("--sizes", default="16M,64M", help="bytes per rank, K/M suffixes")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per wire and size in one job")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per layout; the table shows their median")
    parser.add_argument("--per-host", default="1,2")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    units = {"K": 1 << 10, "M": 1 << 20}
    sizes = [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s) for s in args.sizes.split(",")]
    if args.rank:
        rank_main(sizes, args.iters)
        return 0
    why = topology.available()
    if why:
        print(f"compressed_wire: skipped ({why})")
        return 0
    with topology.hosts(["a", "b"]) as hosts:
        if args.rate:
            for host in hosts.values():
                host.limit(args.rate)
        link = f"tbf {args.rate}" if args.rate else "bare"
        print(f"link: {link}; float32 all_reduce; median of {args.repeats} jobs x {args.iters} calls")
        print("| ranks per host | size | " + " | ".join(WIRES) + " |")
        print("| --- | --- |" + " --- |" * len(WIRES))
        for per_host in (int(p) for p in args.per_host.split(",")):
            runs = [job(hosts, per_host, sizes, args.iters) for _ in range(args.repeats)]
            for size in sizes:
                medians = {w: statistics.median(run[f"{w}/{size}"] for run in runs) for w in WIRES}
                cells = [f"{medians['exact'] * 1e3:.0f} ms"] + [
                    f"{medians[w] * 1e3:.0f} ms ({medians['exact'] / medians[w]:.2f}x)" for w in WIRES[1:]
                ]
                shown = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
                print(f"| {per_host} | {shown} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
