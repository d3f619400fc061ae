"""A training loop for the worker pods, run as ``python -c <this file>``: an all_reduce every step, a
coordinator barrier every 20 steps, for ``TRAIN_SECONDS`` seconds (rank 0's clock decides, so every rank
stops at the same step). Each rank prints ``rank R training`` once joined; rank 0 prints the number of
steps and the longest one at the end."""

import os
import time

import numpy as np

import collsvc

comm = collsvc.init()
print(f"rank {comm.rank} training", flush=True)
start, longest, step = time.monotonic(), 0.0, 0
go = np.ones(1, np.int64)
while go[0]:
    began = time.monotonic()
    total = comm.all_reduce(np.ones(1024, np.float32))
    assert float(total[0]) == comm.size, total[0]
    if step % 20 == 0:
        comm.barrier()
    go[0] = int(time.monotonic() - start < float(os.environ["TRAIN_SECONDS"]))
    go = comm.all_reduce(go, op=collsvc.MIN)
    longest = max(longest, time.monotonic() - began)
    step += 1
if comm.rank == 0:
    print(f"trained: {step} steps, all sums correct, longest step {longest:.2f}s", flush=True)
collsvc.destroy()
