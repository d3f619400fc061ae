"""collsvc vs torch.distributed gloo, side by side in one invocation.

Usage:
    python benchmarks/compare_gloo.py [--ranks 2 4] [--ops all_reduce ...] [--sizes 4K,1M,16M,64M]
        [--repeats 3] [--write docs/performance.md] [--plot docs/busbw.png]

For every (ranks, op) it alternates the two libraries ``--repeats`` times (collsvc, gloo, collsvc,
gloo, ...) so machine noise hits both alike, takes each size's median time, and prints a table with
both bus bandwidths and their ratio. With ``--write`` the table replaces the block between the
``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers of that file (NAME from ``--block``,
default ``compare_gloo``).
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collsvc.bench import bus_factor, parse_size, plot, run_bench  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_gloo(n: int, op: str, sizes: list[int], iters: int, warmup: int) -> list[dict[str, Any]]:
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    config = {"op": op, "sizes": sizes, "iters": iters, "warmup": warmup, "port": free_port(), "result": result}
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks/gloo_worker.py")],
            env=dict(os.environ, GLOO_BENCH=json.dumps(config), RANK=str(r), WORLD_SIZE=str(n), OMP_NUM_THREADS="1"),
        )
        for r in range(n)
    ]
    try:
        for proc in procs:
            if proc.wait(timeout=600):
                raise RuntimeError(f"gloo rank exited {proc.returncode}")
        with open(result, encoding="utf-8") as handle:
            rows: list[dict[str, Any]] = json.load(handle)
        return rows
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        os.unlink(result)


def median_rows(runs: list[list[dict[str, Any]]], op: str, n: int) -> list[dict[str, Any]]:
    rows = []
    for i, first in enumerate(runs[0]):
        seconds = statistics.median(run[i]["seconds"] for run in runs)
        algbw = first["bytes"] / seconds / 1e9
        rows.append({"bytes": first["bytes"], "seconds": seconds, "algbw": algbw, "busbw": algbw * bus_factor(op, n)})
    return rows


def human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ops", nargs="+", default=["all_reduce"])
    parser.add_argument("--sizes", default="4K,1M,16M,64M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--write", help="markdown file whose compare_gloo block gets the table")
    parser.add_argument("--block", default="compare_gloo", help="name of the marker pair --write replaces")
    parser.add_argument("--plot", help="PNG of bus bandwidth vs size (needs matplotlib)")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    lines = [
        "| op | ranks | size | collsvc time | gloo time | collsvc busbw GB/s | gloo busbw GB/s | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    curves: dict[str, list[dict[str, Any]]] = {}
    for op in args.ops:
        for n in args.ranks:
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(run_bench(n, op, sizes, iters=args.iters, warmup=args.warmup))
                theirs.append(run_gloo(n, op, sizes, args.iters, args.warmup))
            mine, gloo = median_rows(ours, op, n), median_rows(theirs, op, n)
            curves[f"collsvc {op} n={n}"], curves[f"gloo {op} n={n}"] = mine, gloo
            for a, b in zip(mine, gloo, strict=True):
                # Ratio of speeds (gloo time / collsvc time): > 1 means collsvc is faster.
                ratio = b["seconds"] / a["seconds"]
                lines.append(
                    f"| {op} | {n} | {human(a['bytes'])} | {a['seconds'] * 1e3:.3f} ms | {b['seconds'] * 1e3:.3f} ms "
                    f"| {a['busbw']:.3f} | {b['busbw']:.3f} | {ratio:.2f}x |"
                )
            print("\n".join(lines), flush=True)
    table = "\n".join(lines)
    command = "python benchmarks/compare_gloo.py " + " ".join(sys.argv[1:])
    if args.write:
        BEGIN, END = f"<!-- {args.block}:begin -->", f"<!-- {args.block}:end -->"
        path = Path(args.write)
        text = path.read_text() if path.exists() else f"{BEGIN}\n{END}\n"
        if BEGIN not in text:
            text += f"\n{BEGIN}\n{END}\n"
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        block = f"{BEGIN}\nCommand: `{command}` (medians of {args.repeats} alternating runs)\n\n{table}\n{END}"
        path.write_text(head + block + tail)
    if args.plot:
        plot(curves, args.plot, "all_reduce bus bandwidth, collsvc vs gloo")
    return 0


if __name__ == "__main__":
    sys.exit(main())
