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


def repeated_tensor_calls(comm: collsvc.Communicator) -> dict[str, Any]:
    import torch

    n, me = comm.size, comm.rank
    general_calls = []
    issue = comm._issue

    def counted_issue(*args: Any, **kwargs: Any) -> Any:
        general_calls.append(args[0].signature.op)
        return issue(*args, **kwargs)

    comm._issue = counted_issue  # type: ignore[method-assign]
    t = torch.full((5, 3), float(me + 1))
    total = float(sum(range(1, n + 1)))
    for step in range(4):  # the first call of each kind learns (general path), the others take the fast path
        fresh = comm.all_reduce(t, collsvc.MAX)
        assert type(fresh) is torch.Tensor and fresh.dtype == torch.float32, type(fresh)
        assert torch.equal(fresh, torch.full((5, 3), float(n))) and float(t[0, 0]) == me + 1
        t.fill_(me + 1)
        assert comm.all_reduce(t, out=t) is t and torch.equal(t, torch.full((5, 3), total))
        t.fill_(me + 1)
        root = comm.broadcast(torch.arange(6, dtype=torch.int64) * (me + 1), src=n - 1)
        assert type(root) is torch.Tensor and root.tolist() == [i * n for i in range(6)]
        gathered = torch.empty(n * 2, dtype=torch.int32)
        mine = torch.tensor([me, step], dtype=torch.int32)
        assert comm.all_gather(mine, out=gathered) is gathered
        assert gathered.tolist() == [v for r in range(n) for v in (r, step)]
        block = comm.reduce_scatter(torch.ones(n * 4, dtype=torch.float64) * (me + 1))
        assert type(block) is torch.Tensor and block.tolist() == [total] * 4
        if step == 0:
            learned = len(general_calls)
    assert len(general_calls) == learned == 5, general_calls  # later steps never took the general path
    # A tensor whose storage moved (resize_ to more elements) is viewed again, not through the old view.
    t.resize_(64)
    t.fill_(1.0)
    assert comm.all_reduce(t, out=t) is t and torch.equal(t, torch.full((64,), float(n)))
    # What numpy cannot view still takes the general path: a tensor that requires grad, bfloat16.
    with pytest.raises(Exception, match="grad"):
        comm.all_reduce(torch.ones(3, requires_grad=True))
    assert comm.all_reduce(torch.ones(4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    return {"general_calls": len(general_calls)}


def test_repeated_tensor_calls_take_the_fast_path() -> None:
    with coordinator() as (_, address):
        result = run_ranks(repeated_tensor_calls, 2, address=address, env={"COLLSVC_HOST": "one-host"}, timeout=120)
    assert [v["general_calls"] for v in result.values] == [7, 7]
