"""What COLLSVC_TIMELINE (and the always-on per-call statistics) cost, as a share of step time.

Usage: python benchmarks/timeline_overhead.py [-n 2] [--steps 300] [--repeats 3] [--size 4096] [--calls N]

Two measurements:

1. The recorder's own cost per call (``CallRecorder.start`` + ``finish``, timeit over ``--calls`` calls), with
   the timeline off (statistics only) and on. This is the exact cost added to every collective.
2. End to end: ``collsvc run -n N`` of a loop of "steps" (one all_reduce of ``--size`` bytes each, the
   worst case: the cheapest call there is), timeline off and on, alternated, ``--repeats`` runs each.
   Each rank prints its median step time; the slowest rank counts. On a shared 2-core machine run to
   run noise is a few percent, so (1) divided by the step time is the figure to trust.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = """
import statistics, sys, time
import numpy as np
import collsvc

steps, size = int(sys.argv[1]), int(sys.argv[2])
comm = collsvc.init()
x = np.ones(size // 4, dtype=np.float32)
for _ in range(20):
    comm.all_reduce(x)
times = []
for _ in range(steps):
    start = time.perf_counter()
    comm.all_reduce(x)
    times.append(time.perf_counter() - start)
print("STEP", statistics.median(times), flush=True)
collsvc.destroy()
"""


def recorder_cost(timeline: str | None, number: int = 200_000) -> float:
    """Seconds per call of ``start`` + ``finish`` (best of 3)."""
    sys.path.insert(0, str(ROOT))
    from collsvc.client.backends.base import Call, GroupSpec, Signature
    from collsvc.observability.recorder import CallRecorder

    recorder = CallRecorder("bench", 0, "host", timeline)
    group = GroupSpec("world", (0, 1), 0)

    def one() -> None:
        # A fresh Signature per call, as the communicator makes one.
        call = Call(group, "world", 1, Signature("all_reduce", "float32", (1024,), "SUM"), 0.0)
        recorder.finish(recorder.start(call))

    def bare() -> None:
        Call(group, "world", 1, Signature("all_reduce", "float32", (1024,), "SUM"), 0.0)

    baseline = min(timeit.repeat(bare, number=number, repeat=3)) / number

    best = min(timeit.repeat(one, number=number, repeat=3)) / number
    recorder.timeline = None  # nothing to write
    return best - baseline


def step_time(n: int, steps: int, size: int, script: Path, timeline: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "COLLSVC_TIMELINE"}
    if timeline:
        env["COLLSVC_TIMELINE"] = timeline
    done = subprocess.run(
        [sys.executable, "-m", "collsvc", "run", "-n", str(n), str(script), str(steps), str(size)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}):\n{done.stderr}")
    return max(float(line.split()[-1]) for line in done.stdout.splitlines() if "STEP" in line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", type=int, default=4096, help="bytes per all_reduce (default: 4096)")
    parser.add_argument("--calls", type=int, default=200_000, help="timeit calls for (1) (default: 200000)")
    args = parser.parse_args()
    stats_only, with_timeline = recorder_cost(None, args.calls), recorder_cost("unused.json", args.calls)
    print(f"recorder per call: statistics only {stats_only * 1e6:.2f} us, with timeline {with_timeline * 1e6:.2f} us")
    off: list[float] = []
    on: list[float] = []
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "steps.py"
        script.write_text(RANK_SCRIPT)
        for repeat in range(args.repeats):
            off.append(step_time(args.n, args.steps, args.size, script, None))
            on.append(step_time(args.n, args.steps, args.size, script, str(Path(folder) / f"trace{repeat}.json")))
            print(f"run {repeat + 1}: step {off[-1] * 1e6:.0f} us without timeline, {on[-1] * 1e6:.0f} us with")
    step_off, step_on = statistics.median(off), statistics.median(on)
    print(
        f"median step ({args.n} ranks, {args.size} B all_reduce): {step_off * 1e6:.0f} us without, "
        f"{step_on * 1e6:.0f} us with timeline ({(step_on / step_off - 1) * 100:+.1f} % end to end)"
    )
    print(
        f"timeline cost per step: {(with_timeline - stats_only) * 1e6:.2f} us = "
        f"{(with_timeline - stats_only) / step_off * 100:.2f} % of the step; statistics + timeline: "
        f"{with_timeline / step_off * 100:.2f} %"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
