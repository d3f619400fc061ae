"""Every torch.distributed collective through torch's own API on the collsvc backend, on real ranks."""

from __future__ import annotations

import functools
import operator
import subprocess
import sys
from typing import Any

import pytest

from tests.torch._util import run_torch

torch = pytest.importorskip("torch")


def _reductions(rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    # Sparse COO (nn.Embedding(sparse=True) gradients): summed as gloo does, in place.
    sparse = torch.sparse_coo_tensor([[rank, 3]], [1.0, float(rank)], (n + 4,))
    dist.all_reduce(sparse)
    want = torch.zeros(n + 4)
    want[:n] += 1.0
    want[3] += float(sum(range(n)))
    assert sparse.is_sparse and torch.equal(sparse.to_dense(), want), sparse
    empty = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64), torch.zeros(0), (5,))
    dist.all_reduce(empty)
    assert empty._nnz() == 0
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    expected = {
        dist.ReduceOp.SUM: ranks.sum(),
        dist.ReduceOp.PRODUCT: ranks.prod(),
        dist.ReduceOp.MIN: ranks.min(),
        dist.ReduceOp.MAX: ranks.max(),
        dist.ReduceOp.AVG: ranks.mean(),
    }
    for op, value in expected.items():
        t = torch.full((5,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(t, op=op)
        assert torch.allclose(t, torch.full((5,), float(value), dtype=torch.float64)), (op, t)
    for op, fold in (
        (dist.ReduceOp.BAND, operator.and_),
        (dist.ReduceOp.BOR, operator.or_),
        (dist.ReduceOp.BXOR, operator.xor),
    ):
        t = torch.tensor([1 << rank, 0b1010 | rank], dtype=torch.int32)
        dist.all_reduce(t, op=op)
        assert t.tolist() == [
            functools.reduce(fold, [1 << r for r in range(n)]),
            functools.reduce(fold, [0b1010 | r for r in range(n)]),
        ], op
    premul = torch.full((3,), float(rank + 1))
    if hasattr(dist.ReduceOp, "factor"):
        dist.all_reduce(premul, op=dist._make_nccl_premul_sum(0.5))
        assert torch.allclose(premul, torch.full((3,), 0.5 * float(ranks.sum())))
    else:  # older torch keeps the factor from Python backends: a clear error, nothing sent
        with pytest.raises(ValueError, match="PREMUL_SUM needs torch's ReduceOp.factor"):
            dist.all_reduce(premul, op=dist._make_nccl_premul_sum(0.5))
    # Coalesced (one fused transfer), and a non-contiguous tensor.
    a, b = torch.ones(3) * rank, torch.ones(2, 2) * rank
    dist.all_reduce_coalesced([a, b])
    assert a.tolist() == [n * (n - 1) / 2] * 3 and b.flatten().tolist() == [n * (n - 1) / 2] * 4
    strided = torch.arange(12.0).reshape(3, 4)[:, ::2]
    dist.all_reduce(strided)
    assert torch.equal(strided, torch.arange(12.0).reshape(3, 4)[:, ::2] * n)
    # Repeated calls (all but the first on the Communicator's fast path, through the tensor's numpy view),
    # and tensors that cannot have a numpy view (bfloat16) or need one detached (requires_grad).
    total = float(n * (n + 1) // 2)
    for _ in range(3):
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            t = torch.full((7,), rank + 1, dtype=dtype)
            dist.all_reduce(t)
            assert t.tolist() == [total] * 7, (dtype, t)
        leaf = torch.full((3,), float(rank + 1), requires_grad=True)
        dist.all_reduce(leaf)
        assert leaf.tolist() == [total] * 3 and leaf.requires_grad
    # reduce: only the root's result is defined.
    t = torch.full((4,), float(rank + 1))
    dist.reduce(t, dst=n - 1, op=dist.ReduceOp.SUM)
    if rank == n - 1:
        assert t.tolist() == [float(ranks.sum())] * 4
    # reduce_scatter, list and tensor forms.
    out = torch.zeros(2)
    dist.reduce_scatter(out, [torch.full((2,), float(rank + j)) for j in range(n)])
    assert out.tolist() == [float(sum(r + rank for r in range(n)))] * 2
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * n) + rank, op=dist.ReduceOp.AVG)
    base = torch.arange(2.0 * n)[2 * rank : 2 * rank + 2]
    assert torch.allclose(out, base + (n - 1) / 2)


def _gathers(rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    x = torch.arange(4) if rank == 1 else torch.zeros(4, dtype=torch.int64)
    dist.broadcast(x, src=1)
    assert x.tolist() == [0, 1, 2, 3]
    for step in range(3):  # repeated (the fast path after the first), from every root, bfloat16 too
        for src in range(n):
            for dtype in (torch.float32, torch.bfloat16):
                y = torch.full((5,), float(rank + step), dtype=dtype)
                dist.broadcast(y, src=src)
                assert y.tolist() == [float(src + step)] * 5, (step, src, dtype, y)
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    assert [o.tolist() for o in outs] == [[float(r)] * 2 for r in range(n)]
    uneven = [torch.zeros(r + 1) for r in range(n)]  # torch allows a different size per rank
    dist.all_gather(uneven, torch.full((rank + 1,), float(rank)))
    assert [o.tolist() for o in uneven] == [[float(r)] * (r + 1) for r in range(n)]
    flat = torch.zeros(n, 3)
    dist.all_gather_into_tensor(flat, torch.full((1, 3), float(rank)))
    assert flat[:, 0].tolist() == [float(r) for r in range(n)]
    gathered = [torch.zeros(2) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gathered, dst=0)
    if rank == 0:
        assert gathered is not None and [g[0].item() for g in gathered] == [float(r) for r in range(n)]
    received = torch.zeros(3)
    pieces = [torch.full((3,), float(10 * j)) for j in range(n)] if rank == n - 1 else None
    dist.scatter(received, pieces, src=n - 1)
    assert received.tolist() == [float(10 * rank)] * 3
    # all_gather_coalesced: per_rank[r][j] receives rank r's j-th tensor.
    per_rank = [[torch.zeros(2), torch.zeros(1, 3)] for _ in range(n)]
    dist.all_gather_coalesced(per_rank, [torch.full((2,), float(rank)), torch.full((1, 3), -float(rank))])
    assert [(p[0][0].item(), p[1][0, 0].item()) for p in per_rank] == [(float(r), -float(r)) for r in range(n)]
    # Coalesced all_gather_into_tensor (FSDP's path) under the coalescing manager.
    with dist._coalescing_manager(async_ops=True) as cm:
        out_a, out_b = torch.zeros(n), torch.zeros(2 * n)
        dist.all_gather_into_tensor(out_a, torch.tensor([float(rank)]))
        dist.all_gather_into_tensor(out_b, torch.tensor([float(rank), -float(rank)]))
    cm.wait()
    assert out_a.tolist() == [float(r) for r in range(n)] and out_b[::2].tolist() == out_a.tolist()


def _all_to_all(rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    send = torch.tensor([100.0 * rank + j for j in range(n)])
    got = torch.zeros(n)
    dist.all_to_all_single(got, send)
    assert got.tolist() == [100.0 * j + rank for j in range(n)]
    # Uneven: rank r sends j+1 rows to rank j, so it receives r+1 rows from each.
    in_splits = [j + 1 for j in range(n)]
    out_splits = [rank + 1] * n
    send = torch.cat([torch.full((j + 1, 2), float(10 * rank + j)) for j in range(n)])
    got = torch.zeros(sum(out_splits), 2)
    dist.all_to_all_single(got, send, out_splits, in_splits)
    want = torch.cat([torch.full((rank + 1, 2), float(10 * j + rank)) for j in range(n)])
    assert torch.equal(got, want)
    outs = [torch.zeros(1) for _ in range(n)]
    dist.all_to_all(outs, [torch.tensor([float(rank * n + j)]) for j in range(n)])
    assert [o.item() for o in outs] == [float(j * n + rank) for j in range(n)]


def _point_to_point(rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    right, left = (rank + 1) % n, (rank - 1) % n
    got = torch.zeros(2)
    # Everyone posts the receive first: only a truly asynchronous irecv lets this finish.
    recv = dist.irecv(got, src=left, tag=3)
    send = dist.isend(torch.full((2,), float(rank)), dst=right, tag=3)
    send.wait()
    recv.wait()
    assert got.tolist() == [float(left)] * 2
    a, b = torch.zeros(1), torch.zeros(1)
    ops = [
        dist.P2POp(dist.irecv, a, left, tag=1),
        dist.P2POp(dist.irecv, b, left, tag=2),
        dist.P2POp(dist.isend, torch.tensor([2.0 * rank]), right, tag=2),
        dist.P2POp(dist.isend, torch.tensor([1.0 * rank]), right, tag=1),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert (a.item(), b.item()) == (1.0 * left, 2.0 * left)
    if rank == 0:
        dist.send(torch.tensor([7, 8]), dst=n - 1)
    elif rank == n - 1:
        y = torch.zeros(2, dtype=torch.int64)
        dist.recv(y, src=0)
        assert y.tolist() == [7, 8]
    # recv without a source: rank 0 takes each other rank's message in arrival order.
    if rank == 0:
        sources = []
        for i in range(n - 1):
            z = torch.zeros(1)
            if i % 2 == 0:
                source = dist.recv(z, tag=9)
            else:
                work = dist.irecv(z, tag=9)
                work.wait()
                source = work._source_rank()
            assert z.item() == 10.0 * source, (source, z)
            sources.append(source)
        assert sorted(sources) == list(range(1, n))
    else:
        dist.send(torch.tensor([10.0 * rank]), dst=0, tag=9)


def _objects_groups_and_work(rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    import collsvc.torch

    objects: list[Any] = [None] * n
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": r} for r in range(n)]
    box = [{"from": rank}]
    dist.broadcast_object_list(box, src=n - 1)
    assert box == [{"from": n - 1}]
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, [f"to {j}" for j in range(n)] if rank == 0 else None, src=0)
    assert mine == [f"to {rank}"]
    dist.barrier()
    collsvc.torch.monitored_barrier(timeout=30.0)
    # new_group / new_subgroups: only members run the group's collectives.
    evens = dist.new_group([r for r in range(n) if r % 2 == 0])
    if rank % 2 == 0:
        t = torch.ones(1)
        dist.all_reduce(t, group=evens)
        assert t.item() == len(range(0, n, 2))
    sub, _ = dist.new_subgroups(group_size=1)
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, group=sub)
    assert t.item() == float(rank)
    # Inside a parent group each rank numbers only its parent's groups: disjoint groups of different
    # parents get the same number, and must still be different groups.
    inner, _ = dist.new_subgroups(group_size=1, group=sub)
    dist.all_reduce(t, group=inner)
    assert t.item() == float(rank)
    # Work objects: async ops overlap, complete, and fulfil their futures with the outputs.
    big = [torch.full((1 << 16,), float(rank)) for _ in range(4)]
    works = [dist.all_reduce(b, async_op=True) for b in big]
    assert isinstance(works[0], dist.Work)
    futures = [w.get_future().then(lambda f: f.value()[0].sum().item()) for w in works]
    for w in works:
        w.wait()
        assert w.is_completed()
    total = float(sum(range(n))) * (1 << 16)
    assert [f.wait() for f in futures] == [total] * 4


def _async_returns_before_the_others_arrive(rank: int, n: int) -> None:
    import torch
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(1024)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)  # the others have not entered it yet
        assert not work.is_completed()
        store.set("rank0-issued", "1")
        work.wait()
    else:
        store.get("rank0-issued")
        dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 1024


def _tensors_stay_resizable(rank: int, n: int) -> None:
    # gloo leaves a tensor's storage resizable after a collective; FSDP frees storage with resize_(0).
    import torch
    import torch.distributed as dist

    reduced = torch.ones(256)
    for _ in range(3):  # the first call learns the fast path, the later ones take it
        dist.all_reduce(reduced)
    sent = torch.full((8,), float(rank))
    dist.broadcast(sent, src=0)
    gathered = torch.empty(4 * n)
    dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank)))
    scattered = torch.empty(4)
    dist.reduce_scatter_tensor(scattered, torch.ones(4 * n))
    assert reduced.tolist() == [float(n**3)] * 256 and sent.tolist() == [0.0] * 8
    assert scattered.tolist() == [float(n)] * 4
    for t in (reduced, sent, gathered, scattered):
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        storage.resize_(0)
        storage.resize_(nbytes)
        t.resize_(t.numel() * 2)


def _repeated_calls_take_the_fast_path(rank: int, n: int) -> None:
    # One CPU tensor goes to the Communicator as its numpy view: repeated calls skip the general layers.
    # CUDA tensors (the GPU suite runs these checks with cuda as the default device) take the general
    # path every call, through NCCL or host staging: only their results are checked.
    import numpy as np
    import torch
    import torch.distributed as dist

    from collsvc.types import ReduceOp

    comm = dist.distributed_c10d._get_default_group().communicator
    for _ in range(3):
        reduced = torch.full((16,), float(rank + 1))
        dist.all_reduce(reduced)
        sent = torch.full((16,), float(rank))
        dist.broadcast(sent, src=n - 1)
        gathered = torch.empty(n, 16)
        dist.all_gather_into_tensor(gathered, torch.full((16,), float(rank)))
        scattered = torch.empty(16)
        dist.reduce_scatter_tensor(scattered, torch.arange(16 * n, dtype=torch.float32) * (rank + 1))
        assert reduced.tolist() == [n * (n + 1) / 2] * 16 and sent.tolist() == [float(n - 1)] * 16
        assert gathered.tolist() == [[float(r)] * 16 for r in range(n)]
        assert scattered.tolist() == [(16 * rank + i) * n * (n + 1) / 2 for i in range(16)]
    if reduced.device.type != "cpu":
        return
    x = np.empty(16, np.float32)
    assert comm._repeated.has_fast_path("all_reduce", x, ReduceOp.SUM)
    assert comm._repeated.has_fast_path("broadcast", x, n - 1)
    assert comm._repeated.has_fast_path("all_gather", x)
    assert comm._repeated.has_fast_path("reduce_scatter", np.empty(16 * n, np.float32), ReduceOp.SUM)


def _a_tensor_that_moves_is_reduced_where_it_is_now(rank: int, n: int) -> None:
    # Repeated calls of one tensor reuse its numpy view until its memory or layout changes.
    import torch
    import torch.distributed as dist

    t = torch.ones(16)
    for _ in range(3):
        t.fill_(rank + 1)
        dist.all_reduce(t)
        assert t.tolist() == [n * (n + 1) / 2] * 16
    t.resize_(1 << 14)  # new memory
    t.fill_(1.0)
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * (1 << 14)
    t.set_(torch.full((16,), float(rank)))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.tolist() == [float(n - 1)] * 16
    for _ in range(3):
        dist.barrier()  # repeated barriers take the Communicator's fast path too
    assert dist.distributed_c10d._get_default_group().communicator._repeated.has_fast_path("barrier")


CHECKS = (
    _async_returns_before_the_others_arrive,
    _reductions,
    _gathers,
    _all_to_all,
    _point_to_point,
    _objects_groups_and_work,
    _tensors_stay_resizable,
    _repeated_calls_take_the_fast_path,
    _a_tensor_that_moves_is_reduced_where_it_is_now,
)


def every_collective(rank: int, n: int) -> int:
    for check in CHECKS:
        check(rank, n)
    return rank


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_file_init(world_size: int) -> None:
    result = run_torch(every_collective, world_size, mode="file")
    assert result.values == list(range(world_size))


def basics(rank: int, n: int) -> str:
    import torch
    import torch.distributed as dist

    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    assert t.tolist() == [float(sum(range(n)))] * 3
    objects: list[Any] = [None] * n
    dist.all_gather_object(objects, rank)
    assert objects == list(range(n))
    # A gloo group beside it rendezvous through the same store (under collsvc run: the coordinator's).
    gloo = dist.new_group(backend="gloo")
    t = torch.ones(2)
    dist.all_reduce(t, group=gloo)
    assert t.tolist() == [float(n)] * 2
    return str(dist.get_backend())


@pytest.mark.parametrize("mode", ["env", "collsvc"])
def test_init_under_torchrun_env_and_collsvc_run(mode: str) -> None:
    result = run_torch(basics, 2, mode=mode)
    assert result.values == ["collsvc", "collsvc"]


def test_import_collsvc_never_imports_torch() -> None:
    code = "import sys, collsvc; collsvc.init; collsvc.Communicator; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
