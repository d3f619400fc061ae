"""The classic collective examples on 4 ranks (run: collsvc run -n 4 examples/collectives_tour.py).

Prints, on rank 0, each result next to what it should be, and exits non-zero if any differs.
"""

from __future__ import annotations

import sys

import numpy as np

import collsvc


def main() -> int:
    comm = collsvc.init()
    r, n = comm.rank, comm.size
    checks: list[tuple[str, object, object]] = []

    got = comm.all_reduce(np.array([[float(r)]]))
    checks.append(("all_reduce of [[rank]]", got.tolist(), [[float(sum(range(n)))]]))

    got = comm.all_gather(np.array([[r]]))
    checks.append(("all_gather of [[rank]]", got.tolist(), [[i] for i in range(n)]))

    got = comm.reduce_scatter(np.arange(n).reshape(n, 1))
    checks.append(("reduce_scatter of [[0],[1],...]", got.tolist(), [[n * r]]))

    got = comm.broadcast(np.array([r, r]), src=0)
    checks.append(("broadcast from rank 0", got.tolist(), [0, 0]))

    got = comm.all_reduce(np.array([2**40 + r], dtype=np.int64))
    checks.append(("int64 all_reduce", got.tolist(), [n * 2**40 + sum(range(n))]))

    got = comm.all_reduce(np.array([1 + 1j * r], dtype=np.complex128))
    checks.append(("complex all_reduce", got.tolist(), [complex(n, sum(range(n)))]))

    failed = [c for c in checks if c[1] != c[2]]
    if r == 0:
        for name, value, expected in checks:
            print(f"{name:34s} -> {value}   (expected {expected})", flush=True)
    collsvc.destroy()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
