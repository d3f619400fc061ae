"""``collsvc bench``: an nccl-tests style table for one collective over a range of sizes.

The parent starts an embedded coordinator and N rank processes (``python -m collsvc.bench.worker``,
through collsvc/launch/rank_processes.py, as benchmarks/compare_gloo.py starts gloo's ranks); rank 0 writes
the measurements as one JSON line on its stdout, which the parent turns into the table. Every size follows the
protocol of collsvc/bench/protocol.py, the one the gloo comparison (benchmarks/compare_gloo.py) uses
for both libraries: a barrier before each call, an iteration's time is the slowest rank's, p50 and p99
over ``--iters`` iterations, 2 to 8 distinct buffer sets in rotation (all_reduce, broadcast and reduce
in place). algbw = bytes / p50; busbw = algbw x the nccl-tests factor (all_reduce 2(n-1)/n;
all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce 1).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from typing import Any

from collsvc.bench.protocol import COLLECTIVES
from collsvc.launch.rank_processes import run_ranks

OPS = COLLECTIVES
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096. Raises ValueError for anything else."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in _UNITS else ""
    number = text[:-1] if unit else text
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 4K, 16M)") from None
    if value < 1:
        raise ValueError(f"size must be positive: {text!r}")
    return value


def size_range(spec: str, factor: int = 4) -> list[int]:
    """``"4K:64M"`` -> 4K, 16K, ... 64M (times ``factor``); a single size stands alone."""
    low, _, high = spec.partition(":")
    start, stop = parse_size(low), parse_size(high or low)
    if stop < start or factor < 2:
        raise ValueError(f"bad size range {spec!r} (factor {factor})")
    sizes = []
    size = start
    while size <= stop:
        sizes.append(size)
        size *= factor
    return sizes


def run_bench(
    n: int,
    op: str,
    sizes: list[int],
    *,
    dtype: str = "float32",
    iters: int = 20,
    warmup: int = 3,
    device: str = "cpu",
    backend: str = "auto",
    check: bool = False,
    progress: bool = False,
    timeout: float = 600.0,
) -> list[dict[str, Any]]:
    """Runs the benchmark on ``n`` local ranks and returns one row per size.

    Raises:
        RuntimeError: a rank failed (its stderr's tail is in the message).
        TimeoutError: the ranks ran longer than ``timeout`` seconds in all.
    """
    from collsvc.options import CoordinatorOptions
    from collsvc.server.app import CoordinatorThread

    token = secrets.token_urlsafe(24)
    coordinator = CoordinatorThread(CoordinatorOptions(host="127.0.0.1", port=0, token=token))
    port = coordinator.start()
    config = {
        "op": op,
        "sizes": sizes,
        "dtype": dtype,
        "iters": iters,
        "warmup": warmup,
        "device": device,
        "check": check,
        "progress": progress,
    }
    job_env = dict(  # reads the environment itself: the ranks' starts as a copy of this process's
        os.environ,
        COLLSVC_COORDINATOR=f"127.0.0.1:{port}",
        COLLSVC_WORLD_SIZE=str(n),
        COLLSVC_TOKEN=token,
        COLLSVC_BENCH=json.dumps(config),
        COLLSVC_BACKEND=backend,
    )
    envs = [dict(job_env, COLLSVC_RANK=str(rank), COLLSVC_LOCAL_RANK=str(rank)) for rank in range(n)]
    try:
        stdout = run_ranks([sys.executable, "-m", "collsvc.bench.worker"], envs, timeout)
    except RuntimeError as exc:
        raise RuntimeError(f"benchmark failed: {exc}") from exc
    finally:
        coordinator.stop()
    lines = stdout.splitlines()
    if not lines:
        raise RuntimeError("benchmark failed: rank 0 exited 0 without writing its rows")
    rows: list[dict[str, Any]] = json.loads(lines[-1])  # rank 0's last line (collsvc/bench/worker.py)
    return rows


def format_table(rows: list[dict[str, Any]], n: int, op: str) -> str:
    """The nccl-tests style table of ``run_bench``'s rows: p50 and p99 time, bandwidths from p50."""
    lines = [
        f"# collsvc bench: {op}, {n} ranks; slowest rank per iteration, after a barrier each",
        f"#{'size':>12} {'count':>12} {'type':>9} {'bufs':>4} {'iters':>5} {'p50(us)':>11} {'p99(us)':>11}"
        f" {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'cpu s/GB':>9}",
    ]
    for r in rows:
        lines.append(
            f" {r['bytes']:>12} {r['count']:>12} {r['dtype']:>9} {r['buffers']:>4} {r['iters']:>5}"
            f" {r['p50'] * 1e6:>11.1f} {r['p99'] * 1e6:>11.1f} {r['algbw']:>12.3f} {r['busbw']:>12.3f}"
            f" {r['cpu_s_per_gb']:>9.2f}"
        )
    return "\n".join(lines)


def plot(rows_by_label: dict[str, list[dict[str, Any]]], path: str, title: str) -> None:
    """Bus bandwidth vs size, one line per label (needs matplotlib: pip install 'collsvc[plot]').

    Raises:
        RuntimeError: matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'collsvc[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in rows_by_label.items():
        ax.plot([r["bytes"] for r in rows], [r["busbw"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cuda_unavailable() -> str | None:
    """Why this machine cannot run ``--device cuda`` (no CuPy, or no GPU CuPy can use); None when it can."""
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # ImportError, or CUDA's own error without a driver or device
        return f"CuPy cannot use a GPU here ({type(exc).__name__}: {exc})"
    return None if count > 0 else "CuPy sees no CUDA GPU"


def main(args: argparse.Namespace) -> int:
    """Entry point of ``collsvc bench`` (arguments parsed by collsvc.cli.main)."""
    if args.op not in OPS:
        print(f"collsvc bench: --op must be one of {', '.join(OPS)}", file=sys.stderr)
        return 2
    reason = cuda_unavailable() if args.device == "cuda" else None
    if reason is not None:
        print(
            f"collsvc bench: --device cuda needs CuPy and a CUDA GPU: {reason}; install CuPy with "
            "pip install 'collsvc[cuda12]' (or '[cuda13]')",
            file=sys.stderr,
        )
        return 2
    try:
        sizes = size_range(args.sizes, getattr(args, "factor", 4) or 4)
    except ValueError as exc:
        print(f"collsvc bench: {exc}", file=sys.stderr)
        return 2
    progress = sys.stderr.isatty() and not args.json
    try:
        rows = run_bench(
            args.n,
            args.op,
            sizes,
            dtype=args.dtype,
            iters=args.iters,
            warmup=args.warmup,
            device=args.device,
            backend=args.backend,
            check=args.check,
            progress=progress,
        )
    except (RuntimeError, TimeoutError) as exc:
        print(f"collsvc bench: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_table(rows, args.n, args.op))
    if args.plot:
        try:
            plot({f"collsvc {args.op} n={args.n}": rows}, args.plot, f"{args.op}, {args.n} ranks")
        except RuntimeError as exc:
            print(f"collsvc bench: {exc}", file=sys.stderr)
            return 1
    return 0
