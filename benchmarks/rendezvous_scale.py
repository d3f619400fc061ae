"""How long N ranks take to join one job and pass one world barrier on a real coordinator.

The coordinator runs in its own process; N simulated ranks are grpc.aio clients spread over P
processes, each process sharing a few channels among its clients (as many ranks per host would each
have their own channel, this is the coordinator-side cost that matters). Timing starts when every
process has its channels connected and ends when the last rank passed the barrier.

Usage:
    python benchmarks/rendezvous_scale.py --ranks 1024 [--procs 2] [--channels 4] [--repeat 3]

The last line printed is exactly ``ranks=N join+barrier seconds=S`` (the median over repeats).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

TOKEN = "bench-token"
JOIN_TIMEOUT_S = 120.0


def _coordinator(port_queue: Any, stop_event: Any) -> None:
    from collsvc.server.app import serve
    from collsvc.types import CoordinatorOptions

    logging.basicConfig(level=os.environ.get("COLLSVC_BENCH_LOG", "WARNING"))
    # Nobody sends heartbeats here; do not let the monitor fail the simulated ranks.
    options = CoordinatorOptions(host="127.0.0.1", port=0, token=TOKEN, heartbeat_timeout=3600.0)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, lambda: (stop_event.wait(), loop.call_soon_threadsafe(stop.set)))
        await serve(options, ready=port_queue.put, stop=stop)

    asyncio.run(main())


def _worker(address: str, job_id: str, ranks: int, world_size: int, channels: int, go: Any, results: Any) -> None:
    import grpc

    from collsvc.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

    metadata = (("authorization", f"Bearer {TOKEN}"),)

    async def one(stub: Any, index: int) -> None:
        reply = await stub.Join(
            coordinator_pb2.JoinRequest(
                job_id=job_id,
                world_size=world_size,
                host=f"host{index % 64}",
                pid=(os.getpid() % 10000) * 100000 + index,
                timeout_s=JOIN_TIMEOUT_S,
            ),
            metadata=metadata,
            timeout=JOIN_TIMEOUT_S + 5,
        )
        barrier = await stub.Barrier(
            coordinator_pb2.BarrierRequest(
                job_id=job_id,
                group="world",
                rank=reply.rank,
                member_secret=reply.member_secret,
                generation=1,
                timeout_s=JOIN_TIMEOUT_S,
            ),
            metadata=metadata,
            timeout=JOIN_TIMEOUT_S + 5,
        )
        if not barrier.complete:
            raise RuntimeError(f"barrier incomplete: {barrier}")

    async def main() -> None:
        opened = [grpc.aio.insecure_channel(address) for _ in range(channels)]
        for channel in opened:
            await channel.channel_ready()
        stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in opened]
        results.put(("ready", 0.0))
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        await asyncio.gather(*(one(stubs[i % channels], i) for i in range(ranks)))
        results.put(("done", time.monotonic()))
        for channel in opened:
            await channel.close()

    try:
        asyncio.run(main())
    except BaseException as exc:  # reported to the parent, which fails the run
        results.put(("error", repr(exc)))


def run_once(address: str, job_id: str, world_size: int, procs: int, channels: int) -> float:
    ctx = mp.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    shares = [world_size // procs + (1 if i < world_size % procs else 0) for i in range(procs)]
    workers = [
        ctx.Process(target=_worker, args=(address, job_id, n, world_size, channels, go, results), daemon=True)
        for n in shares
        if n
    ]
    for w in workers:
        w.start()
    for _ in workers:
        kind, value = results.get(timeout=120)
        if kind != "ready":
            raise RuntimeError(f"worker failed: {value}")
    start = time.monotonic()
    go.set()
    end = start
    for _ in workers:
        kind, value = results.get(timeout=JOIN_TIMEOUT_S + 30)
        if kind != "done":
            raise RuntimeError(f"worker failed: {value}")
        end = max(end, value)
    for w in workers:
        w.join(timeout=10)
    return end - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, required=True, help="simulated ranks in the job")
    parser.add_argument("--procs", type=int, default=2, help="client processes (default 2)")
    parser.add_argument("--channels", type=int, default=4, help="channels per client process (default 4)")
    parser.add_argument("--repeat", type=int, default=1, help="runs (a new job id each); prints the median")
    args = parser.parse_args(argv)

    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    coordinator = ctx.Process(target=_coordinator, args=(port_queue, stop_event), daemon=True)
    coordinator.start()
    try:
        address = f"127.0.0.1:{port_queue.get(timeout=60)}"
        times = []
        for i in range(args.repeat):
            seconds = run_once(address, f"bench-{i}", args.ranks, max(args.procs, 1), max(args.channels, 1))
            print(f"run {i + 1}: {seconds:.3f} s", flush=True)
            times.append(seconds)
    finally:
        stop_event.set()
        coordinator.join(timeout=10)
        if coordinator.is_alive():
            coordinator.terminate()
    print(f"ranks={args.ranks} join+barrier seconds={statistics.median(times):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
