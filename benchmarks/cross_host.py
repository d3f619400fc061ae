"""collsvc, gloo and the link's floor across two hosts, side by side in one run.

Usage (root: it builds two network namespaces joined by veth on a bridge, and removes them after):
    python benchmarks/cross_host.py [--per-host 1 2] [--links bare,10gbit,1gbit] [--sizes 4K,1M,16M,64M]
        [--repeats 3] [--iters 20] [--warmup 3] [--floor-total 256M] [--write docs/performance.md]

For every link (``bare``: the veth as it is; a rate such as ``10gbit``: ``tc tbf`` on both hosts'
outgoing side) it measures, in one process tree, alternating the libraries from repeat to repeat:
- the floor (benchmarks/link_floor.py): one TCP stream from host a to host b, one connection carrying
  as much both ways at once (its rate each way), and raw-bytes gRPC calls;
- all_reduce of float32 with ``--per-host`` ranks on each host: collsvc over its bulk lane (the
  default), collsvc with ``COLLSVC_TCP_LANE=0`` (every frame a gRPC call), and torch's gloo (one
  thread, ``GLOO_SOCKET_IFNAME``), each with the protocol of collsvc/bench/protocol.py (its own barrier
  before every call, the slowest rank's time, p50 over ``--iters`` calls, the median over repeats).
Prints markdown tables and, as the last line, one JSON object with every number. Without root (or
without ``ip``/``tc``) it says why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collsvc.bench.harness import parse_size, size_range  # noqa: E402
from tests.netns import topology  # noqa: E402

RUN_TIMEOUT = 600.0
ROADS = {"collsvc": {"COLLSVC_TCP_LANE": "1"}, "collsvc-grpc": {"COLLSVC_TCP_LANE": "0"}}


def read_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first line of ``proc``'s stdout that starts with ``prefix``.

    Raises:
        RuntimeError: the process ended or ``timeout`` passed first.
    """
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            raise RuntimeError(f"no '{prefix}' line within {timeout:.0f} s")
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the process exited ({proc.wait()}) before a '{prefix}' line")
        if line.startswith(prefix):
            return line


def run_all(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> list[str]:
    """Runs the processes together; returns their stdouts.

    Raises:
        RuntimeError: one exited with an error (its stderr's tail is in the message), or they took
            longer than ``timeout`` in all.
    """
    with tempfile.TemporaryDirectory(prefix="cross-host-") as folder:
        procs = []
        for index, (argv, env) in enumerate(commands):
            err = open(os.path.join(folder, f"{index}.err"), "w+", encoding="utf-8")  # noqa: SIM115
            procs.append(
                (subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True), err)
            )
        deadline = time.monotonic() + timeout
        outputs, failed = [], []
        try:
            for proc, err in procs:
                try:
                    out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    failed.append(f"timed out after {timeout:.0f} s")
                    break
                outputs.append(out)
                if proc.returncode:
                    err.seek(0)
                    failed.append(f"exit {proc.returncode}: {err.read()[-2000:]}")
        finally:
            for proc, err in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                err.close()
        if failed:
            raise RuntimeError("; ".join(failed))
        return outputs


def collsvc_rows(
    hosts: dict[str, topology.Host], per_host: int, road: str, sizes: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One run of collsvc's bench worker, ``per_host`` ranks on each host, coordinator on host a."""
    token = secrets.token_urlsafe(16)
    a = hosts["a"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLLSVC_TOKEN=token, OMP_NUM_THREADS="1")
    coordinator = subprocess.Popen(
        a.command([sys.executable, "-m", "collsvc", "coordinator", "--host", a.address, "--port", "0"]),
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = coordinator_port(coordinator)
        config = {
            "op": "all_reduce",
            "sizes": sizes,
            "dtype": "float32",
            "iters": args.iters,
            "warmup": args.warmup,
            "device": "cpu",
            "check": False,
            "progress": False,
        }
        job = dict(
            env,
            COLLSVC_COORDINATOR=f"{a.address}:{port}",
            COLLSVC_WORLD_SIZE=str(2 * per_host),
            COLLSVC_BENCH=json.dumps(config),
            COLLSVC_JOB_ID=f"bench-{road}",
            **ROADS[road],
        )
        commands = []
        for rank in range(2 * per_host):
            host = hosts["a" if rank < per_host else "b"]
            rank_env = dict(
                job, COLLSVC_RANK=str(rank), COLLSVC_LOCAL_RANK=str(rank % per_host), COLLSVC_HOST=host.name
            )
            commands.append((host.command([sys.executable, "-m", "collsvc.bench.worker"]), rank_env))
        outputs = run_all(commands, RUN_TIMEOUT)
    finally:
        coordinator.terminate()
        coordinator.wait(10)
    rows: list[dict[str, Any]] = json.loads(outputs[0].splitlines()[-1])  # rank 0's rows
    return rows


def coordinator_port(proc: subprocess.Popen[str]) -> int:
    """The port a coordinator started with ``--port 0`` says it listens on.

    Raises:
        RuntimeError: it did not say so within 30 s.
    """
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while True:
        ready, _, _ = select.select([proc.stderr], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            raise RuntimeError("the coordinator did not start within 30 s")
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError(f"the coordinator exited ({proc.wait()})")
        if "listening" in line:
            return int(line.rsplit(":", 1)[1].split()[0])


def gloo_rows(
    hosts: dict[str, topology.Host], per_host: int, sizes: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One run of benchmarks/gloo_worker.py, ``per_host`` ranks on each host."""
    with tempfile.TemporaryDirectory(prefix="cross-host-gloo-") as folder:
        result = os.path.join(folder, "rows.json")
        config = {
            "op": "all_reduce",
            "sizes": sizes,
            "iters": args.iters,
            "warmup": args.warmup,
            "store": os.path.join(folder, "store"),
            "result": result,
            "timeout": RUN_TIMEOUT,
        }
        env = dict(
            os.environ,
            GLOO_BENCH=json.dumps(config),
            WORLD_SIZE=str(2 * per_host),
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="eth0",
        )
        commands = []
        for rank in range(2 * per_host):
            host = hosts["a" if rank < per_host else "b"]
            argv = host.command([sys.executable, str(ROOT / "benchmarks/gloo_worker.py")])
            commands.append((argv, dict(env, RANK=str(rank))))
        run_all(commands, RUN_TIMEOUT)
        with open(result, encoding="utf-8") as handle:
            rows: list[dict[str, Any]] = json.load(handle)
        return rows


def floor(hosts: dict[str, topology.Host], sizes: list[int], total: int) -> dict[str, Any]:
    """benchmarks/link_floor.py: its server on host b, the measurement from host a."""
    b = hosts["b"]
    script = str(ROOT / "benchmarks/link_floor.py")
    server = subprocess.Popen(
        b.command([sys.executable, script, "serve", b.address]), cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        _, tcp_port, grpc_port = read_line(server, "ready", 60).split()
        floor_sizes = ",".join(str(size) for size in sizes if size >= 64 << 10) or "65536"
        argv = [
            sys.executable,
            script,
            "measure",
            b.address,
            tcp_port,
            grpc_port,
            "--sizes",
            floor_sizes,
            "--total",
            str(total),
        ]
        out = subprocess.run(
            hosts["a"].command(argv), cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=True
        )
    finally:
        server.kill()
        server.wait()
    measured: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return measured


def measure_link(hosts: dict[str, topology.Host], link: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every library at every ``--per-host``, over one link setting."""
    for host in hosts.values():
        host.unlimit()
        if link != "bare":
            host.limit(link)
    sizes = [size for part in args.sizes.split(",") for size in size_range(part)]
    floors = [floor(hosts, sizes, parse_size(args.floor_total)) for _ in range(args.repeats)]
    result: dict[str, Any] = {
        "link": link,
        "tcp_stream_gbs": statistics.median(f["tcp_stream_gbs"] for f in floors),
        "tcp_both_ways_gbs": statistics.median(f["tcp_both_ways_gbs"] for f in floors),
        "grpc": floors[len(floors) // 2]["grpc"],
        "per_host": {},
    }
    libraries = [*args.roads, "gloo"]
    for per_host in args.per_host:
        runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in libraries}
        for repeat in range(args.repeats):
            order = libraries if repeat % 2 == 0 else libraries[::-1]
            for name in order:
                if name == "gloo":
                    runs[name].append(gloo_rows(hosts, per_host, sizes, args))
                else:
                    runs[name].append(collsvc_rows(hosts, per_host, name, sizes, args))
        rows = []
        for index, size in enumerate(sizes):
            row: dict[str, Any] = {"bytes": size}
            for name in libraries:
                row[name] = statistics.median(run[index]["p50"] for run in runs[name])
            rows.append(row)
        result["per_host"][per_host] = rows
    return result


def human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def busbw(nbytes: int, ranks: int, seconds: float) -> float:
    """nccl-tests' bus bandwidth of an all_reduce, GB/s."""
    return nbytes * 2 * (ranks - 1) / ranks / seconds / 1e9


def tables(results: list[dict[str, Any]], roads: list[str]) -> list[str]:
    lines = [
        "| link | ranks per host | size | "
        + " | ".join(f"{name} p50" for name in [*roads, "gloo"])
        + " | collsvc busbw GB/s | TCP stream GB/s | TCP both ways GB/s | gloo / collsvc |",
        "|---" * (8 + len(roads)) + "|",
    ]
    for result in results:
        for per_host, rows in result["per_host"].items():
            for row in rows:
                times = " | ".join(f"{row[name] * 1e3:.3f} ms" for name in [*roads, "gloo"])
                ours = row[roads[0]]
                lines.append(
                    f"| {result['link']} | {per_host} | {human(row['bytes'])} | {times} "
                    f"| {busbw(row['bytes'], 2 * int(per_host), ours):.2f} | {result['tcp_stream_gbs']:.2f} "
                    f"| {result['tcp_both_ways_gbs']:.2f} | {row['gloo'] / ours:.2f}x |"
                )
    lines += [
        "",
        "| link | message | gRPC unary GB/s (4 in flight) | gRPC stream GB/s | gRPC round trip | TCP stream GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for result in results:
        for row in result["grpc"]:
            rates = f"{row['grpc_unary_gbs']:.2f} | {row['grpc_stream_gbs']:.2f}"
            lines.append(
                f"| {result['link']} | {human(row['bytes'])} | {rates} "
                f"| {row['grpc_rtt_s'] * 1e6:.0f} us | {result['tcp_stream_gbs']:.2f} |"
            )
    return lines


def write_block(path: str, block: str, lines: list[str]) -> None:
    text = Path(path).read_text(encoding="utf-8")
    begin, end = f"<!-- {block}:begin -->", f"<!-- {block}:end -->"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    Path(path).write_text(head + begin + "\n" + "\n".join(lines) + "\n" + end + tail, encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-host", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--links", default="bare,10gbit,1gbit")
    parser.add_argument("--sizes", default="4K,1M,16M,64M")
    parser.add_argument("--roads", nargs="+", default=list(ROADS), choices=list(ROADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--floor-total", default="256M")
    parser.add_argument("--write", help="replace the cross_host block of this markdown file")
    args = parser.parse_args()
    reason = topology.available()
    if reason:
        print(f"cross_host: skipped: {reason}")
        return 0
    results = []
    with topology.hosts(["a", "b"]) as hosts:
        for link in args.links.split(","):
            results.append(measure_link(hosts, link, args))
    header = [
        f"- Command: `python benchmarks/cross_host.py {' '.join(sys.argv[1:])}`",
        f"- Machine: {os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()}; both hosts"
        " are network namespaces of this machine and share its CPUs.",
        f"- p50 of {args.iters} calls after {args.warmup} warm-up calls, median of {args.repeats} runs"
        " alternating the libraries; floors: the median of as many runs.",
    ]
    lines = [*header, "", *tables(results, args.roads)]
    print("\n".join(lines))
    if args.write:
        write_block(args.write, "cross_host", lines)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
