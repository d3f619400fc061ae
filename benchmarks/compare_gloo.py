"""collsvc vs torch.distributed gloo, side by side in one invocation, measured the same way.

Usage:
    python benchmarks/compare_gloo.py [--ranks 2 4] [--ops all_reduce all_gather reduce_scatter broadcast]
        [--sizes 4K,1M,16M,64M] [--repeats 3] [--iters 50] [--warmup 3]
        [--write docs/performance.md] [--block compare_gloo] [--plot docs/busbw.png]

Both libraries run the protocol of collsvc/bench/protocol.py, one copy of the code for both sides
(collsvc's ranks: collsvc/bench/worker.py; gloo's: benchmarks/gloo_worker.py):
- each rank cycles through 2 to 8 distinct buffer sets per size (enough for 32 MiB in all where 8
  suffice; at most 4x the message from 16 MiB on); all_reduce, broadcast and reduce run in place on
  both sides, as torch's only can;
- before every call the library's own barrier; an iteration's time is the slowest rank's;
- p50 and p99 over ``--iters`` iterations, then the median of each over ``--repeats`` runs that
  alternate the libraries (collsvc, gloo, gloo, collsvc, ...) so machine noise hits both alike.
gloo gets its best settings on a shared machine: torch.set_num_threads(1) and OMP_NUM_THREADS=1.

Prints a header, a markdown table (p50 and p99 of both, bus bandwidth at p50, and gloo p50 / collsvc
p50: > 1 means collsvc is faster) and, as its last line, one JSON object with every row. With
``--write`` the header and table replace the block between the ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` markers of that file (NAME from ``--block``, default ``compare_gloo``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collsvc.bench.harness import plot, run_bench, size_range  # noqa: E402
from collsvc.bench.protocol import CACHE_BYTES, COLLECTIVES, MAX_BUFFERS, MIN_BUFFERS, median_of_repeats  # noqa: E402
from collsvc.launch import rank_processes  # noqa: E402

DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
# Seconds one run (every size of one op at one world size) may take, per library.
RUN_TIMEOUT = 600.0


def run_gloo(n: int, op: str, sizes: list[int], iters: int, warmup: int) -> list[dict[str, Any]]:
    """One run of benchmarks/gloo_worker.py on ``n`` local ranks; one row per size.

    Raises:
        RuntimeError / TimeoutError: see :func:`collsvc.launch.rank_processes.run_ranks`.
    """
    with tempfile.TemporaryDirectory(prefix="compare-gloo-") as folder:
        result = os.path.join(folder, "rows.json")
        config = {
            "op": op,
            "sizes": sizes,
            "iters": iters,
            "warmup": warmup,
            "store": os.path.join(folder, "store"),
            "result": result,
            "timeout": RUN_TIMEOUT,
        }
        env = dict(os.environ, GLOO_BENCH=json.dumps(config), WORLD_SIZE=str(n), OMP_NUM_THREADS="1")
        argv = [sys.executable, str(ROOT / "benchmarks/gloo_worker.py")]
        ranks = [dict(env, RANK=str(rank)) for rank in range(n)]
        rank_processes.run_ranks(argv, ranks, RUN_TIMEOUT, label="gloo rank")
        with open(result, encoding="utf-8") as handle:  # rank 0 writes it (benchmarks/gloo_worker.py)
            rows: list[dict[str, Any]] = json.load(handle)
        return rows


def parse_sizes(text: str) -> list[int]:
    """``"4K,1M"`` or ranges ``"4K:64M"`` (x4 steps), comma-separated.

    Raises:
        ValueError: a size or range that does not parse.
    """
    return [size for part in text.split(",") for size in size_range(part)]


def human(nbytes: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def header(args: argparse.Namespace) -> list[str]:
    """What the table measured and how, as markdown list items."""
    runs = f"{args.repeats} run{'s' if args.repeats != 1 else ''}"
    return [
        f"- Machine: {os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()},"
        f" torch {metadata.version('torch')}.",
        "- Protocol (collsvc/bench/protocol.py, the same code on both sides): each library's own barrier"
        " before every call; an iteration's time is the slowest rank's; p50 and p99 over"
        f" {args.iters} iterations after {args.warmup} warm-up calls, then the median of each over"
        f" {runs} alternating the libraries.",
        f"- Buffers: each rank cycles through {MIN_BUFFERS} to {MAX_BUFFERS} distinct buffer sets per size"
        f" (column bufs; {CACHE_BYTES >> 20} MiB in all where {MAX_BUFFERS} suffice); float32; all_reduce,"
        " broadcast and reduce run in place on both sides (torch's only run in place).",
        "- gloo: torch.set_num_threads(1) and OMP_NUM_THREADS=1 in every rank (its best settings here).",
        "- Ratio: gloo p50 / collsvc p50 (> 1: collsvc is faster). busbw from p50, nccl-tests factors."
        " The JSON line also has spread_p50 (how far apart the ranks left the barrier) and CPU s/GB.",
    ]


def compare_rows(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per size with both libraries' numbers and the ratio of their p50s."""
    keys = ("p50", "p99", "busbw", "spread_p50", "cpu_s_per_gb", "buffers", "iters")
    rows = []
    for mine, gloo in zip(ours, theirs, strict=True):
        rows.append(
            {
                "op": mine["op"],
                "ranks": mine["ranks"],
                "bytes": mine["bytes"],
                "repeats": mine["repeats"],
                "collsvc": {key: mine[key] for key in keys},
                "gloo": {key: gloo[key] for key in keys},
                "ratio_p50": gloo["p50"] / mine["p50"],
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| op | ranks | size | bufs | collsvc p50 | collsvc p99 | gloo p50 | gloo p99 "
        "| collsvc busbw GB/s | gloo busbw GB/s | gloo/collsvc p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        a, b = row["collsvc"], row["gloo"]
        lines.append(
            f"| {row['op']} | {row['ranks']} | {human(row['bytes'])} | {a['buffers']} "
            f"| {a['p50'] * 1e3:.3f} ms | {a['p99'] * 1e3:.3f} ms | {b['p50'] * 1e3:.3f} ms | {b['p99'] * 1e3:.3f} ms "
            f"| {a['busbw']:.3f} | {b['busbw']:.3f} | {row['ratio_p50']:.2f}x |"
        )
    return lines


def write_block(path: Path, name: str, body: str) -> None:
    """Replaces the text between ``<!-- name:begin -->`` and ``<!-- name:end -->`` (appended if absent)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = path.read_text(encoding="utf-8") if path.exists() else f"{begin}\n{end}\n"
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{body}\n{end}{tail}", encoding="utf-8")


def measure_pair(args: argparse.Namespace, op: str, n: int, sizes: list[int]) -> list[dict[str, Any]]:
    """Alternating runs of both libraries for one (op, ranks); the compared rows."""
    runs: dict[str, list[list[dict[str, Any]]]] = {"collsvc": [], "gloo": []}
    for repeat in range(args.repeats):
        # collsvc first in even repeats, gloo first in odd ones: neither always runs second.
        order = ("collsvc", "gloo") if repeat % 2 == 0 else ("gloo", "collsvc")
        for side in order:
            started = time.monotonic()
            if side == "collsvc":
                rows = run_bench(n, op, sizes, iters=args.iters, warmup=args.warmup, timeout=RUN_TIMEOUT)
            else:
                rows = run_gloo(n, op, sizes, args.iters, args.warmup)
            runs[side].append(rows)
            took = time.monotonic() - started
            print(f"{op} ranks={n} repeat {repeat + 1}/{args.repeats}: {side} {took:.1f} s", file=sys.stderr)
    return compare_rows(median_of_repeats(runs["collsvc"]), median_of_repeats(runs["gloo"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ops", nargs="+", default=list(DEFAULT_OPS), choices=COLLECTIVES)
    parser.add_argument("--sizes", default="4K,1M,16M,64M", help="comma-separated sizes or LOW:HIGH ranges")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per library")
    parser.add_argument("--iters", type=int, default=50, help="timed iterations per size and run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per size and run")
    parser.add_argument("--write", help="markdown file whose marker block gets the header and table")
    parser.add_argument("--block", default="compare_gloo", help="name of the marker pair --write replaces")
    parser.add_argument("--plot", help="PNG of bus bandwidth vs size (needs matplotlib)")
    args = parser.parse_args()
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.repeats < 1 or args.iters < 1 or args.warmup < 0 or min(args.ranks) < 1:
        parser.error("--repeats, --iters and --ranks must be >= 1, --warmup >= 0")

    rows: list[dict[str, Any]] = []
    for op in args.ops:
        for n in args.ranks:
            rows += measure_pair(args, op, n, sizes)
    command = "python benchmarks/compare_gloo.py " + " ".join(sys.argv[1:])
    text = "\n".join([f"Command: `{command}`", "", *header(args), "", *table(rows)])
    print(text)
    if args.write:
        write_block(Path(args.write), args.block, text)
    if args.plot:
        curves = {
            f"{side} {op} n={n}": [
                {"bytes": r["bytes"], "busbw": r[side]["busbw"]} for r in rows if (r["op"], r["ranks"]) == (op, n)
            ]
            for op in args.ops
            for n in args.ranks
            for side in ("collsvc", "gloo")
        }
        plot(curves, args.plot, "bus bandwidth at p50, collsvc vs gloo")
    # The last line: every row, for scripts.
    print(json.dumps({"command": command, "iters": args.iters, "repeats": args.repeats, "rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
