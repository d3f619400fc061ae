"""Seconds from starting `collsvc run -n N` to the first barrier done on every rank.

Usage: python benchmarks/startup_time.py [-n 4] [--repeats 5]
Each rank prints the wall-clock time after its first barrier; the latest one minus the launch time is
the start-up time. Prints each run and the median.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = (
    "import time, collsvc; c = collsvc.init(); c.barrier(); "
    "print('BARRIER', time.time(), flush=True); collsvc.destroy()"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    samples = []
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "first_barrier.py"
        script.write_text(RANK_SCRIPT + "\n")
        for _ in range(args.repeats):
            start = time.time()
            done = subprocess.run(
                [sys.executable, "-m", "collsvc", "run", "-n", str(args.n), str(script)],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=ROOT,
            )
            stamps = [float(line.split()[-1]) for line in done.stdout.splitlines() if "BARRIER" in line]
            if done.returncode or len(stamps) != args.n:
                print(done.stdout, done.stderr, file=sys.stderr)
                return 1
            samples.append(max(stamps) - start)
            print(f"run: {samples[-1]:.3f} s", flush=True)
    print(f"collsvc run -n {args.n} to first barrier: median {statistics.median(samples):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
