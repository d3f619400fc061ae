"""The nnabla face at 2-4 real ranks: every method and property of seed 000, and seed 001's loop."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from tests.harness import coordinator, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def every_method(_comm: Any) -> dict[str, Any]:
    import collsvc
    import collsvc.compat.nnabla as nn
    import collsvc.compat.nnabla.communicators as C
    from collsvc.compat.nnabla.ext_utils import get_extension_context

    ctx = get_extension_context("cudnn", device_id="0")
    comm = C.MultiProcessDataParallelCommunicator(ctx)
    comm.init()
    assert C.MultiProcessCommunicator is C.MultiProcessDataParalellCommunicator is type(comm)
    size, rank = comm.size, comm.rank
    out: dict[str, Any] = {"size": size, "rank": rank, "local_rank": comm.local_rank, "name": comm.name}

    # all_reduce: a list, with division and without, in the callers' arrays
    x_list = [nn.Variable(3, 2) for _ in range(3)]
    for i, x in enumerate(x_list):
        x.d = rank + i
    data = [x.data for x in x_list]
    comm.all_reduce(data, inplace=True)
    out["all_reduce"] = [x.d.copy() for x in x_list]
    single = nn.NdArray(4)
    single.data = rank + 1
    comm.all_reduce(single, division=True)
    out["all_reduce_div"] = single.data.copy()
    ints = np.full(3, rank * 3, dtype=np.int64)
    comm.all_reduce(ints, division=True)
    out["all_reduce_int_div"] = ints.copy()

    # bcast and reduce
    b_list = [nn.Variable((2,)) for _ in range(2)]
    for x in b_list:
        x.d = rank + 10
    comm.bcast([x.data for x in b_list], src=size - 1, inplace=True)
    out["bcast"] = [x.d.copy() for x in b_list]
    r = nn.Variable((2,))
    r.d = rank + 1
    comm.reduce([r.data], dst=0, division=False)
    out["reduce"] = r.d.copy()

    # all_gather and reduce_scatter
    x = nn.Variable(2, 2)
    x.d = rank
    y_list = [nn.Variable(2, 2) for _ in range(size)]
    comm.all_gather(x.data, [y.data for y in y_list])
    out["all_gather"] = [y.d.copy() for y in y_list]
    xs = [nn.Variable(2) for _ in range(size)]
    for i, v in enumerate(xs):
        v.d = i * 100 + rank
    y = nn.Variable(2)
    comm.reduce_scatter([v.data for v in xs], y.data)
    out["reduce_scatter"] = y.d.copy()

    # groups: both spellings of new_group, list_groups, find_group, a collective on a group
    first = comm.new_group("node0", [0, 1])
    second = comm.new_group(("tail", list(range(1, size))))
    out["groups"] = (first, second, comm.list_groups(), comm.find_group("tail"), comm.find_group("nothing"))
    g = np.array([float(rank)])
    if rank in (0, 1):
        comm.all_reduce(g, group="node0")
    else:
        with pytest.raises(ValueError, match="not a member"):
            comm.all_reduce(g, group="node0")
    out["group_all_reduce"] = g.copy()
    with pytest.raises(ValueError, match="no group named"):
        comm.all_reduce(g, group="missing")

    # all_reduce_callback: gradients handed over one by one while "backward" goes on
    grads = [nn.NdArray(5) for _ in range(4)]
    for i, grad in enumerate(grads):
        grad.data = (rank + 1) * (i + 1)
    callback = comm.all_reduce_callback(grads, 6, division=True)
    for grad in reversed(grads):
        callback(grad)
    callback.wait()
    out["callback"] = [grad.data.copy() for grad in grads]

    # add_context_and_parameters + the deprecated allreduce, then clear
    nn.clear_parameters()
    w = nn.get_parameter_or_create("w", (3,))
    w.g = rank
    comm.add_context_and_parameters((ctx, nn.get_parameters()))
    comm.allreduce(division=False)
    out["allreduce"] = w.g.copy()
    comm.clear_context_parameters()
    comm.allreduce()
    out["allreduce_cleared"] = w.g.copy()

    comm.barrier()
    # abort: every rank's next collective raises collsvc's AbortedError
    if rank == 0:
        comm.abort()
    with pytest.raises(collsvc.AbortedError):
        comm.all_reduce(np.ones(2))
        comm.barrier()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_method_of_the_communicator(world: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(every_method, world, address=address, timeout=90, allow_failures=False)
    n = world
    for rank, out in enumerate(result.values):
        assert (out["size"], out["rank"], out["local_rank"]) == (n, rank, rank)
        assert out["name"] == "MultiProcessDataParallelCommunicator"
        for i, value in enumerate(out["all_reduce"]):
            np.testing.assert_array_equal(value, np.full((3, 2), sum(range(n)) + n * i))
        np.testing.assert_allclose(out["all_reduce_div"], np.full(4, (n + 1) / 2))
        np.testing.assert_array_equal(out["all_reduce_int_div"], np.full(3, 3 * sum(range(n)) // n))
        for value in out["bcast"]:
            np.testing.assert_array_equal(value, np.full(2, n - 1 + 10))
        np.testing.assert_array_equal(out["reduce"], np.full(2, n * (n + 1) // 2 if rank == 0 else rank + 1))
        for i, value in enumerate(out["all_gather"]):
            np.testing.assert_array_equal(value, np.full((2, 2), i))
        np.testing.assert_array_equal(out["reduce_scatter"], np.full(2, n * rank * 100 + sum(range(n))))
        first, second, groups, tail, nothing = out["groups"]
        assert (first, second) == ("node0", "tail")
        assert groups == {"world": list(range(n)), "node0": [0, 1], "tail": list(range(1, n))}
        assert (tail, nothing) == (list(range(1, n)), [])
        np.testing.assert_array_equal(out["group_all_reduce"], [1.0 if rank < 2 else float(rank)])
        for i, value in enumerate(out["callback"]):
            np.testing.assert_allclose(value, np.full(5, (i + 1) * (n + 1) / 2))
        np.testing.assert_array_equal(out["allreduce"], np.full(3, sum(range(n))))
        np.testing.assert_array_equal(out["allreduce_cleared"], np.full(3, sum(range(n))))


def test_tutorial_loop_under_collsvc_run() -> None:
    """Seed 001's loop, imports changed only: every rank ends with the same averaged gradients."""
    env = {**os.environ, "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, "-m", "collsvc", "run", "-n", "3", "tests/compat/nnabla_tutorial.py"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    digests = {line.split("] ", 1)[1] for line in done.stdout.splitlines() if "reduced digest" in line}
    weights = {line.split("] ", 1)[1] for line in done.stdout.splitlines() if "weights digest" in line}
    assert len(digests) == 1 and len(weights) == 1, done.stdout
    local = [line for line in done.stdout.splitlines() if "affine/W local grad" in line]
    assert len({line.split("] ", 1)[1] for line in local}) == 3, "each rank's own gradients differ before all_reduce"
