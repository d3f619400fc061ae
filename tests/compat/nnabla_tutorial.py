"""Seed 001's data-parallel tutorial with only its import lines changed, and a small numpy model (an
affine layer with softmax cross-entropy, gradients by hand) standing in for nnabla's graph engine.

Run: ``collsvc run -n 2 tests/compat/nnabla_tutorial.py`` (or under ``mpirun -np 2``).
Prints each parameter's gradient before and after ``comm.all_reduce`` and a digest of the reduced ones.
"""

import numpy as np

import collsvc.compat.nnabla as nn
import collsvc.compat.nnabla.communicators as C
from collsvc.compat.nnabla.ext_utils import get_extension_context

extension_module = "cpu"
ctx = get_extension_context(extension_module)
comm = C.MultiProcessCommunicator(ctx)
comm.init()
n_devices = comm.size
mpi_rank = comm.rank
device_id = mpi_rank
ctx = get_extension_context(extension_module, device_id=device_id)

print(f"n_devices={n_devices}")
print(f"mpi_rank={mpi_rank}")

# Data points: each rank its own (the tutorial draws them at random per process)
n_class = 2
b, c, h, w = 4, 1, 8, 8
data_rng = np.random.RandomState(100 + mpi_rank)
x_data = data_rng.rand(b, c, h, w)
y_data = data_rng.choice(n_class, b).reshape((b, 1))
x = nn.Variable(x_data.shape)
y = nn.Variable(y_data.shape)
x.d = x_data
y.d = y_data

# Network: the same initial parameters on every rank (the tutorial's w_init with a fixed seed)
rng = np.random.RandomState(0)
with nn.context_scope(ctx), nn.parameter_scope("affine"):
    W = nn.get_parameter_or_create("W", (c * h * w, n_class), lambda s: rng.uniform(-0.1, 0.1, s))
    bias = nn.get_parameter_or_create("b", (n_class,))


def forward_backward():
    """loss.forward(); loss.backward(): softmax cross-entropy of an affine layer, gradients by hand."""
    flat = x.d.reshape(b, -1)
    logits = flat @ W.d + bias.d
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    labels = y.d.astype(int).ravel()
    loss = -np.log(p[np.arange(b), labels]).mean()
    dlogits = p.copy()
    dlogits[np.arange(b), labels] -= 1
    dlogits /= b
    W.g += flat.T @ dlogits
    bias.g += dlogits.sum(axis=0)
    return loss


def zero_grad():
    for v in nn.get_parameters().values():
        v.grad.zero()


loss = forward_backward()
zero_grad()
forward_backward()
for n, v in nn.get_parameters().items():
    print(n, "local grad abs sum", float(np.abs(v.g).sum()))

comm.all_reduce([x.grad for x in nn.get_parameters().values()], division=True)

for n, v in nn.get_parameters().items():
    print(n, "reduced grad abs sum", float(np.abs(v.g).sum()))
digest = float(sum(np.abs(v.g).sum() for v in nn.get_parameters().values()))
print(f"reduced digest {digest:.6f}")

# solver.update(): plain SGD
for v in nn.get_parameters().values():
    v.d -= 0.1 * v.g
print(f"weights digest {float(np.abs(W.d).sum()):.6f}")
