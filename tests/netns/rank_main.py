"""A rank started inside a host namespace with the same environment compose and Kubernetes use
(coordinator address, world size, token, no rank). Prints one line: RESULT <json>.

Modes (argv[1]):
  check  topology, intra/inter-node communicators, all_reduce and all_gather across hosts
  time   median time of all_reduce at argv[2] bytes (COLLSVC_HIERARCHICAL picks the algorithm)
  hold   host "b" ranks park forever after a barrier (the test kills them); others then all_reduce
  train  argv[2] ("all_reduce", "barrier", or "send_recv": rank 0 sends, rank 1 receives) of argv[3]
         bytes in a loop; prints TRAINING after a few steps, and when a call raises, a RESULT with the
         error and the monotonic time it was raised (the test cuts a link meanwhile)
  link   the same as train, but a rank that raised then leaves the job as a script that ends with the
         error does (the test cuts the path between two ranks that both still reach the coordinator)
  steady all_reduce of argv[2] bytes in a loop until the file argv[3] exists on rank 0 (every step
         all-reduces that flag first, so the ranks stop at the same step); prints TRAINING after a few
         steps and STEP <n> <monotonic time> after each, then a RESULT with the steps and any error
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import statistics
import sys
import threading
import time

import numpy as np

import collsvc


def main() -> int:
    mode = sys.argv[1]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the tests ask for stacks before a kill
    comm = collsvc.init(timeout=60)
    result: dict[str, object] = {
        "rank": comm.rank,
        "host": os.environ["COLLSVC_HOST"],
        "local_rank": comm.local_rank,
        "local_size": comm.local_size,
        "node_rank": comm.node_rank,
        "num_nodes": comm.num_nodes,
    }
    if mode == "check":
        total = comm.all_reduce(np.full(1000, comm.rank + 1, np.float64))
        result["all_reduce_ok"] = bool(np.all(total == sum(range(1, comm.size + 1))))
        gathered = comm.all_gather(np.array([comm.rank], np.int64))
        result["all_gather"] = gathered.tolist()
        intra, inter = comm.intra_node, comm.inter_node
        result["intra"] = [intra.size, intra.rank, list(intra.global_ranks)]
        result["inter"] = [inter.size, inter.rank, list(inter.global_ranks)]
        result["intra_sum"] = int(intra.all_reduce(np.array([comm.rank]))[0])
        result["inter_sum"] = int(inter.all_reduce(np.array([comm.rank]))[0])
    elif mode == "time":
        nbytes = int(sys.argv[2])
        x = np.ones(nbytes // 4, np.float32)
        comm.all_reduce(x)
        comm.barrier()
        times = []
        for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 5):
            start = time.perf_counter()
            comm.all_reduce(x, out=x)
            times.append(time.perf_counter() - start)
        result["seconds"] = statistics.median(times)
    elif mode == "hold":
        comm.barrier()
        if os.environ["COLLSVC_HOST"] == "host-b":
            print("HOLDING", flush=True)
            threading.Event().wait()  # parked until the test kills this process
        start = time.monotonic()
        try:
            comm.all_reduce(np.ones(10))
            result["error"] = None
        except collsvc.CollsvcError as exc:
            result["error"] = type(exc).__name__
            result["ranks"] = getattr(exc, "ranks", [])
            result["hosts"] = getattr(exc, "hosts", [])
            result["message"] = str(exc)
        result["seconds"] = time.monotonic() - start
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    elif mode == "train":
        train(comm, sys.argv[2], int(sys.argv[3]), result)
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # a partitioned job cannot leave cleanly; the test only needs the error
    elif mode == "steady":
        steady(comm, int(sys.argv[2]), sys.argv[3], result)
    elif mode == "link":
        train(comm, sys.argv[2], int(sys.argv[3]), result)
        print("RESULT " + json.dumps(result), flush=True)
        collsvc.destroy()  # leaves, naming what failed its call: the other rank hears it
        return 0
    print("RESULT " + json.dumps(result), flush=True)
    collsvc.destroy()
    return 0


def train(comm: collsvc.Communicator, op: str, nbytes: int, result: dict[str, object]) -> None:
    """Steps until a collective raises; records the error and when it was raised (CLOCK_MONOTONIC is
    shared by every namespace, so the test compares it with the moment it cut the link)."""
    x = np.ones(max(nbytes // 8, 1), np.float64)
    steps = 0
    while True:
        try:
            if op == "all_reduce":
                comm.all_reduce(x, out=x)
                x.fill(1.0)
            elif op == "barrier":
                comm.barrier()
            elif comm.rank == 0:
                comm.send(x, 1)
            else:
                comm.recv(0, out=x)
        except collsvc.CollsvcError as exc:
            result["raised_at"] = time.monotonic()
            result["error"] = type(exc).__name__
            result["ranks"] = getattr(exc, "ranks", [])
            result["hosts"] = getattr(exc, "hosts", [])
            result["message"] = str(exc)
            result["steps"] = steps
            return
        steps += 1
        if steps == 20:
            print("TRAINING", flush=True)


def steady(comm: collsvc.Communicator, nbytes: int, stop_file: str, result: dict[str, object]) -> None:
    x = np.ones(max(nbytes // 8, 1), np.float64)
    steps = 0
    result["error"] = None
    try:
        while not comm.all_reduce(np.array([comm.rank == 0 and os.path.exists(stop_file)]))[0]:
            comm.all_reduce(x, out=x)
            ok = bool(np.all(x == comm.size))
            x.fill(1.0)
            if not ok:
                result["error"] = "wrong sum"
                break
            steps += 1
            print(f"STEP {steps} {time.monotonic()}", flush=True)
            if steps == 5:
                print("TRAINING", flush=True)
    except collsvc.CollsvcError as exc:
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
    result["steps"] = steps


if __name__ == "__main__":
    sys.exit(main())
