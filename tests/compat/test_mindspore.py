"""The MindSpore face: seed 003's four examples (imports changed only) print the seed's results on every
rank under ``mpirun -np 4`` with no coordinator; every primitive at 2-4 real ranks; MindSpore's own
Tensor where MindSpore is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from tests.harness import coordinator, run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MPIRUN = shutil.which("mpirun")

# What seed 003 says each example prints at 4 ranks, per rank, with whitespace and commas removed.
EXPECTED = {
    "allreduce.py": ["[[6.]]"] * 4,
    "allgather.py": ["[[0.][1.][2.][3.]]"] * 4,
    "reducescatter.py": ["[[0.]]", "[[4.]]", "[[8.]]", "[[12.]]"],
    "broadcast.py": ["[[0]]"] * 4,
}


def _values(text: str) -> str:
    """The printed array of an output: whitespace and commas removed; a tuple's Tensor repr unwrapped."""
    found = re.search(r"value=\s*(\[.*\])\)", text, re.S)
    return re.sub(r"[\s,]", "", found.group(1) if found else text)


def _mpirun_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLLSVC_", "MASTER_", "OMPI_", "PMIX_"))}
    env.update(PYTHONPATH=REPO, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    return env


@pytest.mark.skipif(MPIRUN is None, reason="mpirun not found: install Open MPI (apt-get install openmpi-bin)")
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_seed_examples_under_mpirun_without_a_coordinator(script: str, tmp_path: Any) -> None:
    """``mpirun -output-filename log -merge-stderr-to-stdout -np 4 python communication.py``, as the seed
    writes it (plus the flags a root user or a 2-core machine needs)."""
    assert MPIRUN is not None
    done = subprocess.run(
        [
            MPIRUN,
            "--oversubscribe",
            "-output-filename",
            str(tmp_path / "log"),
            "-merge-stderr-to-stdout",
            "-np",
            "4",
            sys.executable,
            os.path.join(REPO, "examples", "compat", script),
        ],
        cwd=tmp_path,
        env=_mpirun_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    logs = {}
    for rank in range(4):
        found = [
            os.path.join(d, f) for d, _, files in os.walk(tmp_path / "log") for f in files if d.endswith(f"rank.{rank}")
        ]
        assert found, f"no log of rank {rank}: {done.stdout}{done.stderr}"
        with open(found[0], encoding="utf-8") as handle:
            logs[rank] = handle.read()
    assert done.returncode == 0, f"{done.stdout}{done.stderr}{logs}"
    assert [_values(logs[r]) for r in range(4)] == EXPECTED[script], logs


def test_ranks_across_hosts_without_a_coordinator_get_a_clear_error() -> None:
    from collsvc.launcher_env import mpirun_local_job

    env = {
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_MCA_ess_base_jobid": "42",
    }
    with pytest.raises(ValueError, match="more than one host.*COLLSVC_COORDINATOR"):
        mpirun_local_job(env)
    assert mpirun_local_job({**env, "COLLSVC_COORDINATOR": "h:1"}) is None
    one_host = {**env, "OMPI_COMM_WORLD_SIZE": "4"}
    key, local_rank, _folder = mpirun_local_job(one_host) or ("", -1, "")
    assert local_rank == 1 and key == (mpirun_local_job(one_host) or ("",))[0]
    assert mpirun_local_job({**one_host, "OMPI_MCA_ess_base_jobid": "43"}) != mpirun_local_job(one_host)


def every_primitive(_comm: Any) -> dict[str, Any]:
    from collsvc.compat.mindspore import Tensor, context, ops
    from collsvc.compat.mindspore.communication import (
        create_group,
        get_group_rank_from_world_rank,
        get_group_size,
        get_local_rank,
        get_rank,
        get_world_rank_from_group_rank,
        init,
    )

    context.set_context(mode=context.PYNATIVE_MODE)
    init("nccl")
    rank, n = get_rank(), get_group_size()
    out: dict[str, Any] = {
        "ids": (rank, n, get_local_rank(), get_group_size("hccl_world_group"), get_rank("mccl_world_group"))
    }
    x = Tensor(np.full((1, 2), rank + 1, dtype=np.float32))
    out["max"] = ops.AllReduce(ops.ReduceOp.MAX)(x).asnumpy().tolist()
    out["prod"] = ops.AllReduce(ops.ReduceOp.PROD)(x).asnumpy().tolist()
    out["min_np"] = ops.AllReduce(ops.ReduceOp.MIN)(np.full(2, rank + 1.0)).tolist()
    a2a = np.arange(2 * n, dtype=np.int32).reshape(2, n) + 100 * rank
    out["alltoall"] = ops.AlltoAll(n, 1, 0)(Tensor(a2a)).asnumpy().tolist()
    right, left = (rank + 1) % n, (rank - 1) % n
    exchange = ops.NeighborExchange([right], [left], [[3]], [[3]], np.float32)
    out["neighbor"] = [t.asnumpy().tolist() for t in exchange((Tensor(np.full(3, rank, dtype=np.float32)),))]
    bcast = ops.Broadcast(1)((Tensor(np.array([rank])), Tensor(np.array([[rank * 2.0]]))))
    out["broadcast"] = [t.asnumpy().tolist() for t in bcast]
    if rank in (0, 1):
        create_group("pair", [0, 1])
        out["pair"] = (
            get_group_size("pair"),
            get_rank("pair"),
            get_world_rank_from_group_rank("pair", 1),
            get_group_rank_from_world_rank(1, "pair"),
            ops.AllReduce(group="pair")(Tensor(np.ones(1))).asnumpy().tolist(),
        )
    with pytest.raises(ValueError, match="no group"):
        ops.AllReduce(group="nothing")(x)
    with pytest.raises(TypeError, match="tuple"):
        ops.Broadcast(0)(x)
    ops.AllReduce()(x)  # every rank stays until the pair is done: a member that left ends the job's groups
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_primitive(world: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(every_primitive, world, address=address, timeout=90)
    n = world
    for rank, out in enumerate(result.values):
        assert out["ids"] == (rank, n, rank, n, rank)
        assert out["max"] == [[float(n)] * 2]
        assert out["prod"] == [[float(np.prod(np.arange(1, n + 1)))] * 2]
        assert out["min_np"] == [1.0, 1.0]
        # a2a = arange(2n).reshape(2, n) + 100 r: column j goes to rank j; received columns stack on dim 0
        assert out["alltoall"] == [
            [100 * i + rank] if k == 0 else [100 * i + n + rank] for i in range(n) for k in (0, 1)
        ]
        assert out["neighbor"] == [[float((rank - 1) % n)] * 3]
        assert out["broadcast"] == [[1], [[2.0]]]
        if rank < 2:
            assert out["pair"] == (2, rank, 1, 1, [2.0])


def test_alltoall_splits_and_concatenates_as_mindspore() -> None:
    """AlltoAll(split_count, split_dim, concat_dim) at 2 ranks: rank r's (2, 2) input [[r, 10r], ...]."""

    with coordinator() as (_, address):
        result = run_ranks(_alltoall_job, 2, address=address, timeout=60)
    # column j of every rank's input goes to rank j; received columns are stacked along dim 0
    assert result.values[0] == [[0], [2], [1], [102]]
    assert result.values[1] == [[1], [3], [11], [1003]]


def _alltoall_job(_comm: Any) -> list[list[int]]:
    from collsvc.compat.mindspore import Tensor, ops
    from collsvc.compat.mindspore.communication import get_rank, init

    init()
    r = get_rank()
    x = Tensor(np.array([[r, 10 * r + 1], [100 * r + 2, 1000 * r + 3]]))
    return ops.AlltoAll(2, 1, 0)(x).asnumpy().tolist()


def mindspore_tensors(_comm: Any) -> list[Any]:
    import mindspore

    from collsvc.compat.mindspore import ops
    from collsvc.compat.mindspore.communication import get_rank, init

    init()
    x = mindspore.Tensor(np.array([[get_rank()]], dtype=np.float32))
    y = ops.AllReduce()(x)
    assert isinstance(y, mindspore.Tensor)
    return y.asnumpy().tolist()


def test_mindspore_own_tensor_in_and_out() -> None:
    pytest.importorskip("mindspore", reason="MindSpore is not installed: its own Tensor path is not exercised")
    with coordinator() as (_, address):
        result = run_ranks(mindspore_tensors, 2, address=address, timeout=90)
    assert result.values == [[[1.0]], [[1.0]]]
