"""Elastic recovery: SIGKILL of one of 4 ranks to the survivors' next all_reduce, and replacement admission.

Usage: python benchmarks/elastic_recovery.py [-n 4] [--repeats 5] [--start-method fork-server|spawn]

Each run is ``collsvc run -n N --min-ranks 2 --max-restarts 1`` of this file as the rank script. The ranks
all_reduce a small array in a loop under ``collsvc.elastic.run``, committing every 10 steps. At step 200
rank N-1 prints the time and SIGKILLs itself. Measured per run (wall clock, one host):

- recovery: from the kill to the latest survivor's first completed all_reduce on the new membership
  (failure detection, restore, re-form, state broadcast, the all_reduce itself);
- admission: from the replacement process's first line of Python to its first completed all_reduce
  as a member (interpreter start and imports, joining the lobby, waiting for the next commit, re-form,
  state broadcast);
- replacement start: from the kill to the replacement's first line (the launcher noticing the exit);
- replaced: from the kill to the replacement's first completed all_reduce as a member (the sum of the
  two above: under the fork server a replacement runs its first line with numpy and gRPC loaded).

Prints each run and the medians.
"""

from __future__ import annotations

import time

STARTED = time.time()  # the first line a replacement runs: the start of its admission time

import argparse  # noqa: E402 - after the start stamp, on purpose
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KILL_STEP = 200


def rank_main() -> None:
    import numpy as np

    import collsvc

    collsvc.init()
    newcomer = bool(os.environ.get("COLLSVC_ELASTIC_JOIN"))
    if newcomer:
        print(f"STARTED {STARTED:.6f}", flush=True)
    state = collsvc.elastic.State(step=0, x=np.zeros(1024, dtype=np.float32))
    memberships = 0

    @collsvc.elastic.run
    def train(comm: collsvc.Communicator, state: collsvc.elastic.State) -> None:
        nonlocal memberships
        memberships += 1
        steps_here = 0
        wanted = int(os.environ["COLLSVC_WORLD_SIZE_AT_START"])
        while state.step < 2 * KILL_STEP or comm.size < wanted or steps_here < 20:
            if state.step == KILL_STEP and comm.rank == comm.size - 1 and memberships == 1 and not newcomer:
                print(f"KILL {time.time():.6f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_reduce(state.x, out=state.x)
            if steps_here == 0 and (memberships == 2 or newcomer):
                print(f"{'ADMITTED' if newcomer else 'RECOVERED'} {time.time():.6f}", flush=True)
            steps_here += 1
            state.step += 1
            if state.step % 10 == 0:
                state.commit()

    train(state)


def one_run(n: int, start_method: str = "fork-server") -> dict[str, float]:
    env = dict(os.environ, COLLSVC_WORLD_SIZE_AT_START=str(n))
    elastic = ["--min-ranks", "2", "--max-restarts", "1", "--start-method", start_method]
    done = subprocess.run(
        [sys.executable, "-m", "collsvc", "run", "-n", str(n), *elastic, __file__],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    stamps: dict[str, list[float]] = {}
    for line in done.stdout.splitlines():
        words = line.split()
        if len(words) >= 2 and words[-2] in ("KILL", "RECOVERED", "STARTED", "ADMITTED"):
            stamps.setdefault(words[-2], []).append(float(words[-1]))
    if done.returncode or any(name not in stamps for name in ("KILL", "RECOVERED", "STARTED", "ADMITTED")):
        raise RuntimeError(f"run failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    killed = stamps["KILL"][0]
    return {
        "recovery": max(stamps["RECOVERED"]) - killed,
        "admission": stamps["ADMITTED"][0] - stamps["STARTED"][0],
        "replacement start": stamps["STARTED"][0] - killed,
        "replaced": stamps["ADMITTED"][0] - killed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--start-method", choices=("fork-server", "spawn"), default="fork-server")
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        runs.append(one_run(args.n, args.start_method))
        print("run: " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in runs[-1].items()), flush=True)
    for name in runs[0]:
        values = [run[name] for run in runs]
        print(f"{name}: median {statistics.median(values):.3f} s, max {max(values):.3f} s ({args.n} ranks)")
    return 0


if __name__ == "__main__":
    if os.environ.get("COLLSVC_COORDINATOR"):
        rank_main()
    else:
        sys.exit(main())
