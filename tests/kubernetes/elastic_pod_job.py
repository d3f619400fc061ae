"""An elastic training script for the worker pods, run as ``python -m collsvc.elastic.rejoin -c <this file>``.

Full-batch gradient descent on a linear least-squares problem whose batch for each step is fixed, the
rows split over the ranks and the gradients summed with all_reduce: the weights depend only on the
steps taken, not on the membership, so ``reference(step)`` says what every rank must end with.

The members train for ``ELASTIC_SECONDS`` seconds (the clock of the first rank 0, carried in the
state), and then on until the membership is as large as at the start again: a pod killed mid-run must
be restarted and admitted before the job can end. Each process prints ``training`` lines when a
membership starts and one ``finished: {json}`` line at the end.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

import collsvc

DIM = 6
BATCH = 24
LEARNING_RATE = 0.02
COMMIT_EVERY = 10
MAX_STEPS = 100_000  # a job whose killed member never comes back ends here, and the test says so


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, DIM))
    return x, x @ np.arange(1.0, DIM + 1.0)


def reference(steps: int) -> np.ndarray:
    """The weights after ``steps`` steps without any failure, computed in one process."""
    w = np.zeros(DIM)
    for step in range(steps):
        x, y = batch(step)
        w = w - LEARNING_RATE * (x.T @ (x @ w - y)) / BATCH
    return w


def main() -> None:
    seconds = float(os.environ.get("ELASTIC_SECONDS", "10"))
    comm = collsvc.init()
    # Rank 0's values win: the state is broadcast from it when the first membership starts.
    state = collsvc.elastic.State(step=0, w=np.zeros(DIM), until=time.time() + seconds, world=comm.size)
    longest = 0.0

    @collsvc.elastic.run
    def train(comm: collsvc.Communicator, state: collsvc.elastic.State) -> collsvc.Communicator:
        nonlocal longest
        print(f"rank {comm.rank} of {comm.size} training from step {state.step}", flush=True)
        go = True
        while go and state.step < MAX_STEPS:
            began = time.monotonic()
            x, y = batch(state.step)
            rows = slice(comm.rank, None, comm.size)
            wants_more = float(time.time() < state.until or comm.size < state.world)
            gradient, more = comm.all_reduce([x[rows].T @ (x[rows] @ state.w - y[rows]), np.array([wants_more])])
            state.w -= LEARNING_RATE * gradient / BATCH
            state.step += 1
            go = bool(more[0] > 0)  # the same sum on every rank: all stop at the same step
            if state.step % COMMIT_EVERY == 0:
                state.commit()
            longest = max(longest, time.monotonic() - began)
        return comm

    final = train(state)
    result: dict[str, object] = {"admitted": final is not None, "longest_step_s": round(longest, 3)}
    if final is not None:
        result.update(rank=final.rank, size=final.size, step=state.step, w=state.w.tolist())
    print(f"finished: {json.dumps(result)}", flush=True)
    collsvc.destroy()


if __name__ == "__main__":
    main()
