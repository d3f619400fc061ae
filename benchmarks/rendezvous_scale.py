"""How long N ranks take to join one job and pass one world barrier on a real coordinator.

The coordinator runs in its own process; N simulated ranks are grpc.aio clients spread over P
processes, each process sharing a few channels among its clients (as many ranks per host would each
have their own channel, this is the coordinator-side cost that matters). Timing starts when every
process has its channels connected and ends when the last rank passed the barrier.

Besides the wall time, the coordinator process is measured from /proc: its CPU time (user + system,
all threads) during the timed part, which is what the coordinator itself costs per rank whatever the
clients cost, and its peak resident memory (VmHWM) against its resident memory before the first run.
After each timed run every rank leaves (untimed), so the coordinator drops the job: the next run
must fit in the memory the last one freed.

Usage:
    python benchmarks/rendezvous_scale.py --ranks 1024 [--procs 2] [--channels 4] [--repeat 3]
        [--ranks-per-host 8] [--heartbeat-seconds 5] [--profile coordinator.prof] [--bare-grpc]

``--ranks-per-host K`` makes each simulated host of K ranks join in one JoinBatch and pass the barrier
in one call for all of them, as ``collsvc run``'s join relay and host barrier do.
``--heartbeat-seconds S`` keeps a Watch stream per rank after the rendezvous (heartbeats at a rank's
pace), measures the coordinator for S seconds, asks it whether it declared anyone failed, and times
every rank leaving.

``--bare-grpc`` puts a grpc.aio server that does nothing but answer in the coordinator's place: the
per-rank cost of gRPC itself, which no coordinator change can go below.

The last line printed is ``ranks=N ranks_per_host=K join+barrier seconds=S coordinator_cpu_s=C
peak_rss_mib=M rss_bytes_per_rank=B`` (medians over repeats; the peak is over the whole invocation),
with ``--heartbeat-seconds`` also ``heartbeats=H heartbeat_cpu_s=C failed=F leave_seconds=L``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKEN = "bench-token"
HEARTBEAT_INTERVAL = 1.0  # a rank's default (COLLSVC_HEARTBEAT_INTERVAL)
JOIN_TIMEOUT_S = 120.0
RESULT_TIMEOUT_S = 600.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime (fields 14 and 15)


def memory_bytes(pid: int, name: str) -> int:
    """A memory line of /proc/PID/status (``VmRSS``, ``VmHWM``: the peak of VmRSS) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"{name} missing from /proc/{pid}/status")


def _coordinator(port_queue: Any, stop_event: Any, profile: str | None, heartbeat_timeout: float = 3600.0) -> None:
    from collsvc.options import CoordinatorOptions
    from collsvc.server.app import serve

    logging.basicConfig(level=os.environ.get("COLLSVC_BENCH_LOG", "WARNING"))
    # Without --heartbeat-seconds nobody sends heartbeats: then the monitor must not fail the ranks.
    options = CoordinatorOptions(host="127.0.0.1", port=0, token=TOKEN, heartbeat_timeout=heartbeat_timeout)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, lambda: (stop_event.wait(), loop.call_soon_threadsafe(stop.set)))
        await serve(options, ready=port_queue.put, stop=stop)

    if profile is None:
        asyncio.run(main())
        return
    import cProfile

    profiler = cProfile.Profile()
    profiler.runcall(asyncio.run, main())
    profiler.dump_stats(profile)


def _bare_server(port_queue: Any, stop_event: Any, profile: str | None, heartbeat_timeout: float = 0.0) -> None:
    """The floor to compare with: a grpc.aio server whose Join only waits until its job is full and
    whose Barrier and Leave answer at once (no token, no limits, no state), under the coordinator
    daemon's gRPC and collector settings: what gRPC itself costs per rank on this machine."""
    import gc

    import grpc

    from collsvc.proto.v1 import coordinator_pb2 as pb
    from collsvc.server.app import SERVING_GC_THRESHOLD

    async def main() -> None:
        joined: dict[str, int] = {}
        full: dict[str, asyncio.Event] = {}

        async def join(request: Any, context: Any) -> Any:
            rank = joined.get(request.job_id, 0)
            joined[request.job_id] = rank + 1
            event = full.setdefault(request.job_id, asyncio.Event())
            if rank + 1 == request.world_size:
                event.set()
            await event.wait()
            return pb.JoinResponse(rank=rank, world_size=request.world_size)

        async def join_batch(request: Any, context: Any) -> Any:
            return pb.JoinBatchResponse(members=await asyncio.gather(*(join(m, context) for m in request.members)))

        async def barrier(request: Any, context: Any) -> Any:
            return pb.BarrierResponse(complete=True)

        async def leave(request: Any, context: Any) -> Any:
            return pb.LeaveResponse()

        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                method,
                request_deserializer=getattr(pb, f"{name}Request").FromString,
                response_serializer=getattr(pb, f"{name}Response").SerializeToString,
            )
            for name, method in (("Join", join), ("JoinBatch", join_batch), ("Barrier", barrier), ("Leave", leave))
        }
        server = grpc.aio.server(
            options=[
                ("grpc.max_concurrent_streams", 1 << 20),
                ("grpc.server.max_pending_requests", 1 << 17),
                ("grpc.server.max_pending_requests_hard_limit", 1 << 18),
                ("grpc.server_max_unrequested_time_in_server", 300),
            ]
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("collsvc.proto.v1.Coordinator", handlers),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await asyncio.get_running_loop().run_in_executor(None, stop_event.wait)
        await server.stop(0)

    gc.collect()
    gc.freeze()
    gc.set_threshold(SERVING_GC_THRESHOLD, 20, 20)
    asyncio.run(main())


def _worker(
    address: str,
    job_id: str,
    ranks: int,
    world_size: int,
    channels: int,
    per_host: int,
    heartbeat_seconds: float,
    go: Any,
    leave: Any,
    results: Any,
) -> None:
    import gc

    import grpc

    from collsvc.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

    # One process stands in for thousands of ranks, each with a call waiting: the same collector
    # tuning as the coordinator daemon's (collsvc.server.app.SERVING_GC_THRESHOLD), so that the
    # simulated clients do not spend their CPU rescanning them. A real rank has a call or two.
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    metadata = (("authorization", f"Bearer {TOKEN}"),)

    def join_request(index: int, host: str, local: int) -> Any:
        return coordinator_pb2.JoinRequest(
            job_id=job_id,
            world_size=world_size,
            host=host,
            pid=(os.getpid() % 10000) * 100000 + index,
            local_rank_hint=local,
            timeout_s=JOIN_TIMEOUT_S,
        )

    async def one_host(stub: Any, first: int, count: int) -> list[Any]:
        """Ranks ``first`` .. ``first + count - 1`` on one simulated host: one Join and one Barrier per
        rank (``count`` 1), or one JoinBatch and one Barrier on behalf of the host (as a launcher does)."""
        host = f"host{os.getpid()}-{first}" if per_host > 1 else f"host{first % 64}"
        if count == 1 and per_host == 1:
            replies = [await stub.Join(join_request(first, host, 0), metadata=metadata, timeout=JOIN_TIMEOUT_S + 5)]
        else:
            batch = coordinator_pb2.JoinBatchRequest(members=[join_request(first + i, host, i) for i in range(count)])
            replies = list((await stub.JoinBatch(batch, metadata=metadata, timeout=JOIN_TIMEOUT_S + 5)).members)
        barrier = await stub.Barrier(
            coordinator_pb2.BarrierRequest(
                job_id=job_id,
                group="world",
                rank=replies[0].rank,
                member_secret=replies[0].member_secret,
                generation=1,
                timeout_s=JOIN_TIMEOUT_S,
                on_behalf_of=[reply.rank for reply in replies[1:]],
            ),
            metadata=metadata,
            timeout=JOIN_TIMEOUT_S + 5,
        )
        if not barrier.complete:
            raise RuntimeError(f"barrier incomplete: {barrier}")
        if heartbeat_seconds > 0:  # as a rank's heartbeats start right after its join
            streams.extend(asyncio.ensure_future(heartbeats(stub, reply)) for reply in replies)
        return replies

    stop = asyncio.Event()  # set once every rank left: the heartbeat streams then end
    beats = [0]

    async def heartbeats(stub: Any, reply: Any) -> None:
        """A Watch stream like a rank's: the first request names the member, then a heartbeat every
        HEARTBEAT_INTERVAL, or the longer interval the coordinator asked of a large job (the first at a
        random offset), until ``stop``."""

        interval = max(HEARTBEAT_INTERVAL, reply.heartbeat_interval_s)  # a large job's pace, as a rank keeps it

        async def requests() -> Any:
            yield coordinator_pb2.WatchRequest(job_id=job_id, rank=reply.rank, member_secret=reply.member_secret)
            pace = random.uniform(0, interval)  # as a rank's heartbeat thread paces itself
            while not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), pace)
                    return
                beats[0] += 1
                yield coordinator_pb2.WatchRequest()
                pace = interval

        async for _ in stub.Watch(requests(), metadata=metadata):  # the coordinator's events
            pass

    async def depart(stub: Any, reply: Any) -> None:
        request = coordinator_pb2.LeaveRequest(job_id=job_id, rank=reply.rank, member_secret=reply.member_secret)
        await stub.Leave(request, metadata=metadata, timeout=JOIN_TIMEOUT_S)

    streams: list[asyncio.Future[None]] = []

    async def main() -> None:
        opened = [grpc.aio.insecure_channel(address) for _ in range(channels)]
        for channel in opened:
            await channel.channel_ready()
        stubs = [coordinator_pb2_grpc.CoordinatorStub(c) for c in opened]
        results.put(("ready", 0.0))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, go.wait)
        cpu_at_go = time.process_time()
        hosts = [(first, min(per_host, ranks - first)) for first in range(0, ranks, per_host)]
        by_host = await asyncio.gather(*(one_host(stubs[i % channels], *host) for i, host in enumerate(hosts)))
        replies = [reply for host in by_host for reply in host]
        results.put(("done", (time.monotonic(), time.process_time() - cpu_at_go)))
        # Untimed: every rank leaves, so the coordinator drops the job before the next run.
        await loop.run_in_executor(None, leave.wait)
        sent_in_window = beats[0]
        await asyncio.gather(*(depart(stubs[i % channels], r) for i, r in enumerate(replies)))
        stop.set()
        await asyncio.gather(*streams)
        results.put(("left", sent_in_window))
        for channel in opened:
            await channel.close(None)

    try:
        asyncio.run(main())
    except BaseException as exc:  # reported to the parent, which fails the run
        results.put(("error", repr(exc)))


@dataclass(frozen=True)
class Run:
    """One timed rendezvous: wall seconds, and the CPU seconds of the coordinator and of all the
    client processes meanwhile; with heartbeats, how many were sent and the coordinator's CPU then."""

    seconds: float
    coordinator_cpu_s: float
    clients_cpu_s: float
    heartbeats: int = 0
    heartbeat_cpu_s: float = 0.0
    failed_members: int = 0
    leave_s: float = 0.0  # every rank leaving (untimed part), and the coordinator's CPU meanwhile
    leave_cpu_s: float = 0.0


def _collect(results: Any, count: int, expected: str, timeout: float) -> list[Any]:
    values = []
    for _ in range(count):
        kind, value = results.get(timeout=timeout)
        if kind != expected:
            raise RuntimeError(f"worker failed: {value}")
        values.append(value)
    return values


def run_once(
    address: str,
    job_id: str,
    world_size: int,
    procs: int,
    channels: int,
    per_host: int,
    coordinator_pid: int,
    heartbeat_seconds: float = 0.0,
) -> Run:
    ctx = mp.get_context("spawn")
    go, leave, results = ctx.Event(), ctx.Event(), ctx.Queue()
    shares = [world_size // procs + (1 if i < world_size % procs else 0) for i in range(procs)]
    workers = [
        ctx.Process(
            target=_worker,
            args=(address, job_id, n, world_size, channels, per_host, heartbeat_seconds, go, leave, results),
            daemon=True,
        )
        for n in shares
        if n
    ]
    for w in workers:
        w.start()
    try:
        _collect(results, len(workers), "ready", 120.0)
        cpu_before = cpu_seconds(coordinator_pid)
        start = time.monotonic()
        go.set()
        done = _collect(results, len(workers), "done", RESULT_TIMEOUT_S)
        cpu = cpu_seconds(coordinator_pid) - cpu_before
        end = max([start, *(finished for finished, _ in done)])
        heartbeat_cpu, failed = 0.0, 0
        if heartbeat_seconds > 0:
            # Every rank now heartbeats; measure the coordinator over a fixed window, then ask it
            # whether it declared anyone failed meanwhile.
            cpu_before_watch = cpu_seconds(coordinator_pid)
            time.sleep(heartbeat_seconds)
            heartbeat_cpu = cpu_seconds(coordinator_pid) - cpu_before_watch
            failed = _failed_members(address, job_id)
        left_from, cpu_before_leave = time.monotonic(), cpu_seconds(coordinator_pid)
        leave.set()
        beats = sum(_collect(results, len(workers), "left", RESULT_TIMEOUT_S))
        leave_s, leave_cpu = time.monotonic() - left_from, cpu_seconds(coordinator_pid) - cpu_before_leave
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.terminate()
    return Run(
        end - start, cpu, sum(client_cpu for _, client_cpu in done), beats, heartbeat_cpu, failed, leave_s, leave_cpu
    )


def _failed_members(address: str, job_id: str) -> int:
    """How many members of ``job_id`` the coordinator declared failed (a missed heartbeat, say)."""
    import grpc

    from collsvc.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        reply = stub.GetStatus(
            coordinator_pb2.GetStatusRequest(job_id=job_id),
            metadata=(("authorization", f"Bearer {TOKEN}"),),
            timeout=60,
        )
    failed = common_pb2.MEMBER_STATE_FAILED
    return sum(1 for job in reply.jobs for member in job.members if member.state == failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, required=True, help="simulated ranks in the job")
    parser.add_argument("--procs", type=int, default=2, help="client processes (default 2)")
    parser.add_argument("--channels", type=int, default=4, help="channels per client process (default 4)")
    parser.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        help="ranks per simulated host: above 1, each host joins in one JoinBatch and passes the barrier in "
        "one call for all its ranks, as collsvc run's launcher and host barrier do (default 1: a call each)",
    )
    parser.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=0.0,
        help="after the rendezvous, every rank heartbeats on a Watch stream (every 1 s) for this long, and the "
        "coordinator (heartbeat timeout 5 s, the default) is measured meanwhile (default 0: no heartbeats)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs (a new job id each); prints the median")
    parser.add_argument("--profile", metavar="FILE", help="write a cProfile of the coordinator's event loop here")
    parser.add_argument(
        "--bare-grpc",
        action="store_true",
        help="measure a bare grpc.aio server that only answers (the floor) instead of the coordinator "
        "(--profile does not apply to it)",
    )
    args = parser.parse_args(argv)

    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    serve = _bare_server if args.bare_grpc else _coordinator
    heartbeat_timeout = 5.0 if args.heartbeat_seconds > 0 else 3600.0
    coordinator = ctx.Process(target=serve, args=(port_queue, stop_event, args.profile, heartbeat_timeout), daemon=True)
    coordinator.start()
    assert coordinator.pid is not None
    runs: list[Run] = []
    try:
        address = f"127.0.0.1:{port_queue.get(timeout=60)}"
        rss_before = memory_bytes(coordinator.pid, "VmRSS")
        for i in range(args.repeat):
            run = run_once(
                address,
                f"bench-{i}",
                args.ranks,
                max(args.procs, 1),
                max(args.channels, 1),
                max(args.ranks_per_host, 1),
                coordinator.pid,
                args.heartbeat_seconds,
            )
            print(
                f"run {i + 1}: {run.seconds:.3f} s, coordinator CPU {run.coordinator_cpu_s:.3f} s "
                f"({1e6 * run.coordinator_cpu_s / args.ranks:.0f} us per rank), clients' CPU "
                f"{run.clients_cpu_s:.3f} s, "
                f"coordinator RSS now {memory_bytes(coordinator.pid, 'VmRSS') / 2**20:.1f} MiB",
                flush=True,
            )
            if args.heartbeat_seconds > 0:
                print(
                    f"  heartbeats: {run.heartbeats} in all; coordinator CPU {run.heartbeat_cpu_s:.3f} s in "
                    f"{args.heartbeat_seconds:g} s ({1e6 * run.heartbeat_cpu_s / max(run.heartbeats, 1):.0f} us per "
                    f"heartbeat); members declared failed: {run.failed_members}; then every rank left in "
                    f"{run.leave_s:.2f} s (coordinator CPU {run.leave_cpu_s:.2f} s)",
                    flush=True,
                )
            runs.append(run)
        peak = memory_bytes(coordinator.pid, "VmHWM")
    finally:
        stop_event.set()
        coordinator.join(timeout=30)
        if coordinator.is_alive():
            coordinator.terminate()
    per_rank = (peak - rss_before) / args.ranks
    print(
        f"coordinator peak RSS {peak / 2**20:.1f} MiB (before the first run {rss_before / 2**20:.1f} MiB): "
        f"{per_rank:.0f} bytes per rank at the peak"
    )
    seconds = statistics.median(r.seconds for r in runs)
    cpu = statistics.median(r.coordinator_cpu_s for r in runs)
    print(
        f"ranks={args.ranks} ranks_per_host={args.ranks_per_host} join+barrier seconds={seconds:.3f} "
        f"coordinator_cpu_s={cpu:.3f} "
        f"peak_rss_mib={peak / 2**20:.1f} rss_bytes_per_rank={per_rank:.0f}"
        + (
            f" heartbeats={statistics.median(r.heartbeats for r in runs):.0f} "
            f"heartbeat_cpu_s={statistics.median(r.heartbeat_cpu_s for r in runs):.3f} "
            f"failed={max(r.failed_members for r in runs)} "
            f"leave_seconds={statistics.median(r.leave_s for r in runs):.3f}"
            if args.heartbeat_seconds > 0
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
