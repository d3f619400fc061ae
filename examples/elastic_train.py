"""Elastic data-parallel training: one rank dies halfway and the job carries on.

Run:  collsvc run -n 4 --min-ranks 2 --max-restarts 1 examples/elastic_train.py [--steps 400]

A small numpy MLP is trained by full-batch gradient descent: each rank takes the rows ``rank::size``
of the data set and the gradients are summed with all_reduce, so the result does not depend on how many
ranks there are. Halfway, rank 3 SIGKILLs itself. The survivors go back to their last
``state.commit()`` (every 10 steps), re-form as ranks 0..2 and carry on; ``collsvc run`` starts one
replacement (``--max-restarts 1``), which is admitted at a later commit and receives the state. At the
end rank 0 prints the loss, whether every rank holds identical weights, and whether they match
training in one process without any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal

import numpy as np

import collsvc

SAMPLES = 960
FEATURES, HIDDEN = 16, 32
LEARNING_RATE = 0.1
COMMIT_EVERY = 10


def make_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(SAMPLES, FEATURES))
    y = np.tanh(x @ rng.normal(size=(FEATURES, 1))) + 0.05 * rng.normal(size=(SAMPLES, 1))
    return x, y


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "w1": rng.normal(scale=0.3, size=(FEATURES, HIDDEN)),
        "b1": np.zeros(HIDDEN),
        "w2": rng.normal(scale=0.3, size=(HIDDEN, 1)),
        "b2": np.zeros(1),
    }


def gradients(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Sum of squared errors over the rows given, and its gradients (sums, not means: they add up)."""
    hidden = np.tanh(x @ params["w1"] + params["b1"])
    diff = hidden @ params["w2"] + params["b2"] - y
    d_pred = 2.0 * diff
    d_hidden = (d_pred @ params["w2"].T) * (1.0 - hidden**2)
    grads = {"w2": hidden.T @ d_pred, "b2": d_pred.sum(axis=0), "w1": x.T @ d_hidden, "b1": d_hidden.sum(axis=0)}
    return float(np.sum(diff**2)), grads


def train_single_process(steps: int) -> dict[str, np.ndarray]:
    x, y = make_data()
    params = init_params()
    for _ in range(steps):
        _, grads = gradients(params, x, y)
        for name, grad in grads.items():
            params[name] -= LEARNING_RATE * grad / SAMPLES
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    steps = parser.parse_args().steps
    x, y = make_data()

    collsvc.init()
    state = collsvc.elastic.State(step=0, params=init_params(), losses=[], sizes=[])
    replacement = bool(os.environ.get("COLLSVC_ELASTIC_JOIN"))  # set by collsvc run on a replacement

    @collsvc.elastic.run
    def train(comm: collsvc.Communicator, state: collsvc.elastic.State) -> collsvc.Communicator:
        names = sorted(state.params)
        while state.step < steps:
            if state.step == steps // 2 and comm.rank == 3 and not replacement:
                os.kill(os.getpid(), signal.SIGKILL)  # a rank dies halfway (not its replacement)
            rows = slice(comm.rank, None, comm.size)
            loss, grads = gradients(state.params, x[rows], y[rows])
            summed = comm.all_reduce([np.array([loss])] + [grads[name] for name in names])
            for name, grad in zip(names, summed[1:], strict=True):
                state.params[name] -= LEARNING_RATE * grad / SAMPLES
            state.step += 1
            if state.step % COMMIT_EVERY == 0:
                state.losses.append(float(summed[0][0]) / SAMPLES)
                state.sizes.append(comm.size)
                state.commit()
        return comm

    comm = train(state)  # a replacement that arrives after the job finished exits 0 in there
    digest = hashlib.sha256(b"".join(state.params[name].tobytes() for name in sorted(state.params))).digest()
    digests = comm.all_gather_object(digest)
    if comm.rank == 0:
        reference = train_single_process(steps)
        matches = all(np.allclose(state.params[name], reference[name], rtol=1e-9) for name in reference)
        print(f"loss fell from {state.losses[0]:.4f} to {state.losses[-1]:.4f} in {state.step} steps")
        print(
            f"ranks per commit: {state.sizes[0]} at first, {min(state.sizes)} after the failure, {comm.size} at the end"
        )
        print(f"weights identical on all {comm.size} ranks: {len(set(digests)) == 1}")
        print(f"weights match training in one process without failures: {matches}")


if __name__ == "__main__":
    main()
