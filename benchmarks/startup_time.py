"""Seconds from starting `collsvc run -n N` to the first barrier done on every rank, phase by phase.

Usage: python benchmarks/startup_time.py [-n 4] [--repeats 5] [--start-methods fork-server spawn]

Each rank takes wall-clock stamps: when its script starts (the interpreter is up), after
``import collsvc`` and loading ``collsvc.init`` (the API module), when ``init()`` returned, and after
the first barrier; and its CPU seconds by then. A run's start-up time is the latest barrier stamp
minus the moment ``collsvc run`` was started. The phases are measured between milestones that the
slowest rank sets, each the latest stamp over the ranks:

    launch   until every rank's script runs (launcher start and imports, starting the interpreters)
    imports  until every rank has imported collsvc (numpy, gRPC, protobuf and collsvc itself)
    init     until every rank returned from init (Join, members, heartbeat stream, backend)
    barrier  until every rank passed the first barrier (shared-memory group set-up on one host)

``--start-methods`` takes ``collsvc run --start-method`` values (default: ``fork-server``, the
default of ``collsvc run``); with several, the runs alternate between them and each gets its summary.
Under the fork server a rank's CPU seconds count from its fork only (the server's imports are not in
them). It prints each run, the median and the median of each phase over the runs, and one
machine-readable last line, for the first start method (the others' medians appended)::

    startup n=4 median_s=0.712 runs=5
    startup n=4 median_s=0.412 runs=5 spawn_median_s=0.781
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Nothing but `time` before the first stamp; `collsvc.init` loads the lazy API (collsvc._api).
RANK_SCRIPT = """\
import time
started = time.time()
import collsvc
collsvc.init
imported = time.time()
comm = collsvc.init()
joined = time.time()
comm.barrier()
passed = time.time()
print("STARTUP", comm.rank, started, imported, joined, passed, time.process_time(), flush=True)
collsvc.destroy()
"""
PHASES = ("launch", "imports", "init", "barrier")


@dataclasses.dataclass(frozen=True)
class RankStamps:
    """One rank's wall-clock stamps (seconds since the epoch) and its CPU seconds at the barrier."""

    rank: int
    started: float
    imported: float
    joined: float
    passed: float
    cpu: float

    @classmethod
    def parse(cls, line: str) -> RankStamps:
        """From the rank's ``STARTUP rank started imported joined passed cpu`` line (any prefix)."""
        fields = line.split("STARTUP", 1)[1].split()
        return cls(int(fields[0]), *(float(field) for field in fields[1:6]))


@dataclasses.dataclass(frozen=True)
class Run:
    """One ``collsvc run``: its start-up seconds, the phases between milestones, the ranks' mean CPU."""

    seconds: float
    phases: dict[str, float]
    rank_cpu: float


def one_run(script: Path, nproc: int, start_method: str = "fork-server") -> Run:
    """Runs ``collsvc run -n nproc --start-method start_method script`` once.

    Raises:
        RuntimeError: the run failed or not every rank reported.
        subprocess.TimeoutExpired: it took longer than 120 s.
    """
    launched = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "collsvc", "run", "-n", str(nproc), "--start-method", start_method, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    ranks = [RankStamps.parse(line) for line in done.stdout.splitlines() if "STARTUP" in line]
    if done.returncode or len(ranks) != nproc:
        raise RuntimeError(f"collsvc run failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    milestones = [launched] + [max(getattr(r, name) for r in ranks) for name in ("started", "imported", "joined")]
    milestones.append(max(r.passed for r in ranks))
    phases = {name: milestones[i + 1] - milestones[i] for i, name in enumerate(PHASES)}
    return Run(milestones[-1] - launched, phases, statistics.mean(r.cpu for r in ranks))


def summary(nproc: int, runs: list[Run], start_method: str) -> float:
    """Prints the median run and phases of ``runs``; returns the median seconds."""
    median = statistics.median(r.seconds for r in runs)
    what = f"collsvc run -n {nproc} --start-method {start_method}"
    print(f"{what} to first barrier: median {median:.3f} s of {len(runs)} runs; phases:")
    for name in PHASES:
        print(f"  {name:8s} {statistics.median(r.phases[name] for r in runs):.3f} s")
    print(f"  rank CPU {statistics.median(r.rank_cpu for r in runs):.3f} s (mean over the ranks, at the barrier)")
    return median


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=4, help="ranks (default: 4)")
    parser.add_argument("--repeats", type=int, default=5, help="runs; the median is reported (default: 5)")
    parser.add_argument(
        "--start-methods",
        nargs="+",
        choices=("fork-server", "spawn"),
        default=["fork-server"],
        help="collsvc run --start-method values, alternated (default: fork-server)",
    )
    args = parser.parse_args()
    runs: dict[str, list[Run]] = {method: [] for method in args.start_methods}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "first_barrier.py"
        script.write_text(RANK_SCRIPT)
        for number in range(1, args.repeats + 1):
            for method in runs:
                try:
                    run = one_run(script, args.n, method)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(exc, file=sys.stderr)
                    return 1
                runs[method].append(run)
                phases = ", ".join(f"{name} {run.phases[name]:.3f}" for name in PHASES)
                print(
                    f"{method} run {number}: {run.seconds:.3f} s ({phases}; rank CPU {run.rank_cpu:.3f} s)", flush=True
                )
    medians = {method: summary(args.n, method_runs, method) for method, method_runs in runs.items()}
    first, *others = medians
    extra = "".join(f" {method.replace('-', '_')}_median_s={medians[method]:.3f}" for method in others)
    print(f"startup n={args.n} median_s={medians[first]:.3f} runs={args.repeats}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
