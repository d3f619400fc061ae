"""A rank that forks children, then runs collectives and a barrier with the others.

Run by tests/multiproc/test_forked_children.py and scripts/stress_fork_children.sh, two ranks::

    collsvc run -n 2 tests/multiproc/fork_children.py SCENARIO [--torch]

With ``--torch`` (or under torchrun's variables) the ranks join through
``torch.distributed.init_process_group("collsvc")``; otherwise through ``collsvc.init()``. Rank 1 forks
(both ranks in ``ddp``) after a first barrier; every rank prints ``OK <rank>`` at the end. A scenario
that finds the child misbehaving exits 3 with the reason.

Scenarios: ``dataloader`` (torch's DataLoader, 2 fork workers), ``ddp`` (DDP training with that
loader), ``executor`` (ProcessPoolExecutor in fork mode), ``fork-exit`` (``os.fork()``, the child ends
with ``sys.exit(0)``), ``pool`` (``with Pool(2) as p: p.map(...)``: leaving the block terminates the
workers with SIGTERM), ``child-calls`` (a forked child calls a collective, a coordinator call,
``init`` and ``destroy`` on what it inherited, and reports an uncaught error), ``child-sigterm`` (a
forked child that waits is stopped with SIGTERM).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import collsvc
import collsvc.torch  # noqa: F401 - registers the "collsvc" backend

ITEMS = 64


def fail(why: str) -> None:
    print(f"FAILED: {why}", file=sys.stderr, flush=True)
    sys.exit(3)


def square(x: int) -> int:
    return x * x


def load_all() -> float:
    loader = DataLoader(TensorDataset(torch.arange(float(ITEMS))), batch_size=8, num_workers=2)
    return sum(float(batch[0].sum()) for batch in loader)


def dataloader(rank: int) -> None:
    if rank == 1 and load_all() != sum(range(ITEMS)):
        fail("the DataLoader lost items")


def ddp(rank: int) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    loader = DataLoader(TensorDataset(torch.arange(float(ITEMS)).unsqueeze(1)), batch_size=8, num_workers=2)
    for (batch,) in loader:
        optimizer.zero_grad()
        model(batch).sum().backward()
        optimizer.step()


def executor(rank: int) -> None:
    if rank == 1:
        with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
            if list(pool.map(square, range(16))) != [x * x for x in range(16)]:
                fail("the executor returned wrong results")


def fork_exit(rank: int) -> None:
    if rank != 1:
        return
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # atexit handlers and interpreter shutdown run in the child
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        fail(f"the child ended with {os.waitstatus_to_exitcode(status)}")


def pool(rank: int) -> None:
    if rank == 1:
        with multiprocessing.get_context("fork").Pool(2) as workers:
            if workers.map(square, range(16)) != [x * x for x in range(16)]:
                fail("the pool returned wrong results")


def child_calls(rank: int) -> None:
    if rank != 1:
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, _child_findings().encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        findings = pipe.read()
    os.waitpid(pid, 0)
    if findings != "ok":
        fail(f"forked child: {findings}")
    report = os.path.join(os.environ.get("COLLSVC_REPORT_DIR", "/nonexistent"), f"rank-{rank}.json")
    if os.path.exists(report):
        fail(f"the child wrote the rank's failure report {report}")


def _child_findings() -> str:
    """What the child saw of the inherited communicator: "ok" or what was wrong."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return f"SIGTERM handler {signal.getsignal(signal.SIGTERM)!r} in the child"
    comm = collsvc.default_communicator()
    attempts = {
        "all_reduce": lambda: comm.all_reduce(torch.ones(2)),
        "barrier": lambda: comm.barrier(timeout=5),
        "store": lambda: comm.job.store.set("from-child", b"x"),
        "init": lambda: collsvc.init(),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except collsvc.ForkedChildError as exc:
            if "forked" not in str(exc):
                return f"{name}: unclear message {exc}"
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            return f"{name} raised {type(exc).__name__}: {exc}"
        else:
            return f"{name} did not raise"
    try:
        comm.all_reduce(torch.ones(2))
    except collsvc.ForkedChildError as exc:  # as if uncaught: Python's report, not the rank's
        sys.excepthook(type(exc), exc, exc.__traceback__)
    collsvc.destroy()  # forgets the inherited communicator, leaves nothing
    return "ok"


def child_sigterm(rank: int) -> None:
    if rank != 1:
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.close(write)  # tells the parent the child runs
        while True:
            signal.pause()
    os.close(write)
    os.read(read, 1)
    os.close(read)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != -signal.SIGTERM:
        fail(f"the child ended with {os.waitstatus_to_exitcode(status)}, not killed by SIGTERM")


SCENARIOS = {
    "dataloader": dataloader,
    "ddp": ddp,
    "executor": executor,
    "fork-exit": fork_exit,
    "pool": pool,
    "child-calls": child_calls,
    "child-sigterm": child_sigterm,
}


def main() -> None:
    scenario = SCENARIOS[sys.argv[1]]
    via_torch = "--torch" in sys.argv or scenario is ddp or "TORCHELASTIC_RUN_ID" in os.environ
    if via_torch:
        dist.init_process_group("collsvc")
        rank, barrier = dist.get_rank(), dist.barrier
    else:
        comm = collsvc.init()
        rank, barrier = comm.rank, comm.barrier
    barrier()
    scenario(rank)
    total = torch.ones(4)
    if via_torch:
        dist.all_reduce(total)
        size = dist.get_world_size()
    else:
        total = comm.all_reduce(total)
        size = comm.size
    if float(total[0]) != size:
        fail(f"all_reduce gave {total}")
    barrier()
    print(f"OK {rank}", flush=True)
    if via_torch:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
