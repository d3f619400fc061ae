"""torch CPU tensors (a test-only dependency) through real ranks: results come back as torch tensors,
in place when ``out is x``, bfloat16 included."""

from __future__ import annotations

from typing import Any

import pytest

import collsvc
from tests.harness import coordinator, run_ranks

torch = pytest.importorskip("torch")


def torch_round_trip(comm: collsvc.Communicator) -> dict[str, Any]:
    import torch

    n, me = comm.size, comm.rank
    t = torch.full((3, 2), float(me + 1))
    total = comm.all_reduce(t)
    assert isinstance(total, torch.Tensor) and total.dtype == torch.float32
    assert torch.equal(total, torch.full((3, 2), float(sum(range(1, n + 1)))))
    assert float(t[0, 0]) == me + 1  # the input is untouched without out=
    same = comm.all_reduce(t, out=t)
    assert same is t and float(t[0, 0]) == sum(range(1, n + 1))  # in place, zero-copy
    gathered = comm.all_gather(torch.tensor([me], dtype=torch.int64))
    assert isinstance(gathered, torch.Tensor) and gathered.tolist() == list(range(n))
    bf = comm.all_reduce(torch.ones(8, dtype=torch.bfloat16), collsvc.AVG)
    assert bf.dtype == torch.bfloat16 and float(bf.sum()) == 8.0
    src = comm.broadcast(torch.arange(4, dtype=torch.int32) * (me + 1), src=n - 1)
    assert src.tolist() == [0, n, 2 * n, 3 * n]
    view = torch.arange(12.0).reshape(3, 4)[:, ::2]  # non-contiguous: copied once
    assert torch.equal(comm.all_reduce(view), view * n)
    return {"rank": me}


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_tensors_round_trip(world_size: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(torch_round_trip, world_size, address=address, timeout=120)
    assert [v["rank"] for v in result.values] == list(range(world_size))
