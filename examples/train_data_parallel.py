"""Data-parallel training of a small numpy MLP with collsvc.

Run:  collsvc run -n 4 examples/train_data_parallel.py [--epochs 30]

Every rank trains on its shard of one synthetic regression data set. Gradients are averaged with
``all_reduce_callback`` (bucketed AVG all_reduce, launched as each layer's gradient is ready, last
layer first, as in backpropagation). Rank 0 prints the loss, which falls. At the end:

- every rank's weights are identical (checked with all_gather of a SHA-256 digest), and
- they match single-process full-batch training on the whole data set within float tolerance
  (rank 0 trains the reference itself and compares).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

import collsvc

SAMPLES = 960  # divisible by 1..6 ranks: equal shards make the averaged gradient the full-batch one
FEATURES, HIDDEN, OUTPUTS = 16, 32, 1


def make_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(SAMPLES, FEATURES))
    true_w = rng.normal(size=(FEATURES, OUTPUTS))
    y = np.tanh(x @ true_w) + 0.05 * rng.normal(size=(SAMPLES, OUTPUTS))
    return x, y


def init_params() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [
        rng.normal(scale=0.3, size=(FEATURES, HIDDEN)),
        np.zeros(HIDDEN),
        rng.normal(scale=0.3, size=(HIDDEN, OUTPUTS)),
        np.zeros(OUTPUTS),
    ]


def loss_and_grads(
    params: list[np.ndarray], x: np.ndarray, y: np.ndarray, grads: list[np.ndarray], ready=None
) -> float:
    """Mean squared error; writes its gradients into ``grads`` and calls ``ready(g)`` as each one is
    computed (output layer first, as backpropagation produces them)."""
    w1, b1, w2, b2 = params
    hidden = np.tanh(x @ w1 + b1)
    pred = hidden @ w2 + b2
    diff = pred - y
    loss = float(np.mean(diff**2))
    d_pred = 2.0 * diff / diff.size
    grads[3][...] = d_pred.sum(axis=0)
    grads[2][...] = hidden.T @ d_pred
    if ready:
        ready(grads[3])
        ready(grads[2])
    d_hidden = (d_pred @ w2.T) * (1.0 - hidden**2)
    grads[1][...] = d_hidden.sum(axis=0)
    grads[0][...] = x.T @ d_hidden
    if ready:
        ready(grads[1])
        ready(grads[0])
    return loss


def train_single_process(epochs: int, lr: float) -> list[np.ndarray]:
    x, y = make_data()
    params = init_params()
    grads = [np.empty_like(p) for p in params]
    for _ in range(epochs):
        loss_and_grads(params, x, y, grads)
        for p, g in zip(params, grads, strict=False):
            p -= lr * g
    return params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.2)
    args = parser.parse_args()

    comm = collsvc.init()
    rank, size = comm.rank, comm.size
    if SAMPLES % size:
        raise SystemExit(f"world size {size} must divide {SAMPLES}")
    x, y = make_data()
    shard = slice(rank * SAMPLES // size, (rank + 1) * SAMPLES // size)
    x_local, y_local = x[shard], y[shard]
    params = init_params()
    grads = [np.empty_like(p) for p in params]
    # Buckets follow backpropagation order (output layer first); each bucket's AVG all_reduce starts
    # as soon as its gradients are ready, while backprop computes the next ones. wait() resets the
    # bucketer for the next step.
    bucketer = comm.all_reduce_callback([grads[i] for i in (3, 2, 1, 0)], pack_size=4096, op=collsvc.AVG)
    first_loss = last_loss = 0.0
    for epoch in range(args.epochs):
        loss = loss_and_grads(params, x_local, y_local, grads, ready=bucketer)
        bucketer.wait()
        mean_loss = float(comm.all_reduce(np.array([loss]), collsvc.AVG)[0])
        for p, g in zip(params, grads, strict=False):
            p -= args.lr * g
        first_loss = mean_loss if epoch == 0 else first_loss
        last_loss = mean_loss
        if rank == 0 and (epoch % 10 == 0 or epoch == args.epochs - 1):
            print(f"epoch {epoch:3d}  loss {mean_loss:.5f}", flush=True)

    digest = hashlib.sha256(b"".join(p.tobytes() for p in params)).digest()
    digests = comm.all_gather(np.frombuffer(digest, dtype=np.uint8).copy()).reshape(size, -1)
    identical = all(np.array_equal(digests[0], d) for d in digests)
    ok = identical and last_loss < first_loss
    if rank == 0:
        reference = train_single_process(args.epochs, args.lr)
        max_diff = max(float(np.max(np.abs(p - r))) for p, r in zip(params, reference, strict=False))
        matches = max_diff < 1e-9
        ok = ok and matches
        print(f"loss fell from {first_loss:.5f} to {last_loss:.5f}", flush=True)
        print(f"weights identical on all {size} ranks: {identical}", flush=True)
        print(f"max |data-parallel - single-process| = {max_diff:.2e} (matches: {matches})", flush=True)
    ok = bool(comm.all_reduce(np.array([ok]), collsvc.BAND)[0])
    collsvc.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
