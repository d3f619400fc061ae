"""The Bagua face at 2-4 real ranks: every function of seed 002 (its doc examples among them) and
``with_bagua`` with both algorithms against single-process full-batch training."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.harness import coordinator, run_ranks  # noqa: E402

# ByteGrad's 8-bit codes (between hosts; these ranks share one) perturb each step's gradient by up to
# ~1/255 of a chunk's range: over STEPS steps the loss stays within this fraction of exact training's.
BYTEGRAD_RTOL = 0.05
ALLREDUCE_RTOL = 1e-5
STEPS = 15


def every_function(_comm: Any) -> dict[str, Any]:
    import collsvc.compat.bagua as bagua
    from collsvc.compat.bagua import communication

    assert bagua.allreduce is communication.allreduce
    assert [int(o) for o in bagua.ReduceOp] == [0, 1, 2, 3, 7, 8, 9, 10]
    bagua.init_process_group()
    assert bagua.is_initialized()
    rank, n = bagua.get_rank(), bagua.get_world_size()
    out: dict[str, Any] = {"ids": (rank, n, bagua.get_local_rank(), bagua.get_local_size())}

    # the seed's own examples: int64 and cfloat vectors
    send = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    recv = torch.zeros(2, dtype=torch.int64)
    bagua.allreduce(send, recv)
    out["doc_int64"] = recv.tolist()
    send = torch.tensor([1 + 1j, 2 + 2j], dtype=torch.cfloat) + 2 * rank * (1 + 1j)
    recv = torch.zeros(2, dtype=torch.cfloat)
    bagua.allreduce(send, recv)
    out["doc_cfloat"] = recv.tolist()

    t = torch.full((3,), float(rank + 1))
    bagua.allreduce_inplace(t, op=bagua.ReduceOp.MAX)
    out["allreduce_inplace_max"] = t.tolist()
    t = torch.full((3,), float(rank + 1))
    bagua.allreduce_inplace(t, bagua.ReduceOp.AVG)
    out["allreduce_avg"] = t.tolist()

    g = torch.zeros(n * 2)
    bagua.allgather(torch.tensor([rank, rank * 10.0]), g)
    out["allgather"] = g.tolist()
    g = torch.zeros(n * 2)
    g[rank * 2 : rank * 2 + 2] = torch.tensor([rank, rank * 10.0])
    bagua.allgather_inplace(g)
    out["allgather_inplace"] = g.tolist()

    a = torch.arange(n * 2, dtype=torch.float32) + 100 * rank
    r = torch.zeros(n * 2)
    bagua.alltoall(a, r)
    out["alltoall"] = r.tolist()
    bagua.alltoall_inplace(a)
    out["alltoall_inplace"] = a.tolist()

    # alltoall_v: rank i sends j+1 copies of 100*i+j to rank j
    counts = [j + 1 for j in range(n)]
    displs = [sum(counts[:j]) for j in range(n)]
    sv = torch.cat([torch.full((j + 1,), 100 * rank + j, dtype=torch.int32) for j in range(n)])
    rcounts = [rank + 1] * n
    rdispls = [i * (rank + 1) for i in range(n)]
    rv = torch.zeros(n * (rank + 1), dtype=torch.int32)
    bagua.alltoall_v(sv, counts, displs, rv, rcounts, rdispls)
    out["alltoall_v"] = rv.tolist()

    rs = torch.zeros(2)
    bagua.reduce_scatter(torch.arange(n * 2, dtype=torch.float32) * (rank + 1), rs)
    out["reduce_scatter"] = rs.tolist()
    rsi = torch.arange(n * 2, dtype=torch.float32) * (rank + 1)
    bagua.reduce_scatter_inplace(rsi)
    out["reduce_scatter_inplace"] = rsi[rank * 2 : rank * 2 + 2].tolist()

    b = torch.full((2, 2), float(rank))
    bagua.broadcast(b, src=n - 1)
    out["broadcast"] = b.tolist()
    out["broadcast_object"] = bagua.broadcast_object({"from": rank}, 1)

    gr = torch.zeros(n * 2)
    bagua.gather(torch.tensor([rank, -rank], dtype=torch.float32), gr, dst=0)
    out["gather"] = gr.tolist()
    gi = torch.zeros(n * 3 if rank == 1 else 3)
    (gi[3:6] if rank == 1 else gi)[:] = rank
    bagua.gather_inplace(gi, 3, dst=1)
    out["gather_inplace"] = gi.tolist()

    sc = torch.zeros(2)
    bagua.scatter(torch.arange(n * 2, dtype=torch.float32) + 0.5 if rank == 0 else torch.zeros(n * 2), sc, src=0)
    out["scatter"] = sc.tolist()
    si = torch.arange(n * 2, dtype=torch.float32) if rank == 0 else torch.zeros(2)
    bagua.scatter_inplace(si, 2, src=0)
    out["scatter_inplace"] = (si[:2] if rank == 0 else si).tolist()

    red = torch.zeros(2)
    bagua.reduce(torch.full((2,), float(rank + 1)), red, dst=0, op=bagua.ReduceOp.PRODUCT)
    out["reduce"] = red.tolist()
    ri = torch.full((2,), rank + 1, dtype=torch.int64)
    bagua.reduce_inplace(ri, dst=n - 1, op=bagua.ReduceOp.BOR)
    out["reduce_inplace"] = ri.tolist()

    if rank == 0:
        bagua.send(torch.tensor([7.0, 8.0]), dst=n - 1)
    if rank == n - 1:
        p = torch.zeros(2)
        bagua.recv(p, src=0)
        out["recv"] = p.tolist()
    bagua.barrier()

    # groups: global, intra-node and inter-node communicators as comm= handles
    group = bagua.new_group([0, 1])
    gc = group.get_global_communicator()
    x = torch.ones(1)
    if gc is not None:
        out["group_comm"] = (gc.rank(), gc.nranks())
        bagua.allreduce_inplace(x, comm=gc)
    out["group_sum"] = x.tolist()
    world = bagua.new_group()
    intra = world.get_intra_node_communicator()
    inter = world.get_inter_node_communicator()
    y = torch.ones(1)
    bagua.allreduce_inplace(y, comm=intra)
    out["intra"] = (intra.nranks(), y.tolist(), inter.nranks() if inter is not None else None)

    with pytest.raises(ValueError):
        bagua.allreduce_inplace(torch.ones(1), op=42)
    return out


def check_every_function(n: int, outs: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(outs):
        assert out["ids"] == (rank, n, rank, n)
        if n == 2:
            assert out["doc_int64"] == [4, 6]
            assert out["doc_cfloat"] == [4 + 4j, 6 + 6j]
        assert out["allreduce_inplace_max"] == [float(n)] * 3
        assert out["allreduce_avg"] == [(n + 1) / 2] * 3
        expect_gather = [v for i in range(n) for v in (i, i * 10.0)]
        assert out["allgather"] == out["allgather_inplace"] == expect_gather
        expect_a2a = [100 * i + 2 * rank + k for i in range(n) for k in range(2)]
        assert out["alltoall"] == out["alltoall_inplace"] == expect_a2a
        assert out["alltoall_v"] == [100 * i + rank for i in range(n) for _ in range(rank + 1)]
        total = n * (n + 1) / 2
        assert out["reduce_scatter"] == out["reduce_scatter_inplace"] == [total * (2 * rank + k) for k in range(2)]
        assert out["broadcast"] == [[float(n - 1)] * 2] * 2
        assert out["broadcast_object"] == {"from": 1}
        if rank == 0:
            assert out["gather"] == [v for i in range(n) for v in (i, -i)]
            assert out["reduce"] == [float(torch.prod(torch.arange(1, n + 1)))] * 2
        if rank == 1:
            assert out["gather_inplace"] == [float(i) for i in range(n) for _ in range(3)]
        assert out["scatter"] == [2 * rank + 0.5, 2 * rank + 1.5]
        assert out["scatter_inplace"] == [2.0 * rank, 2.0 * rank + 1]
        if rank == n - 1:
            bor = 0
            for i in range(1, n + 1):
                bor |= i
            assert out["reduce_inplace"] == [bor] * 2
            assert out["recv"] == [7.0, 8.0]
        if rank < 2:
            assert out["group_comm"] == (rank, 2) and out["group_sum"] == [2.0]
        assert out["intra"] == (n, [float(n)], 1 if rank == 0 else None)


def _data() -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(48, 8, generator=gen)
    y = (x @ torch.randn(8, 1, generator=gen)).tanh() + 0.1 * torch.randn(48, 1, generator=gen)
    return x, y


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def full_batch_losses() -> list[float]:
    x, y = _data()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def train_with_bagua(_comm: Any, algorithm_name: str, kwargs: dict[str, Any]) -> list[float]:
    import collsvc.compat.bagua as bagua
    from collsvc.compat.bagua.algorithms import bytegrad, gradient_allreduce

    bagua.init_process_group()
    rank, n = bagua.get_rank(), bagua.get_world_size()
    x, y = _data()
    shard = slice(rank * len(x) // n, (rank + 1) * len(x) // n)
    if rank:
        torch.manual_seed(1234)  # a different start: with_bagua must broadcast rank 0's parameters
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    else:
        model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    algorithm = {
        "allreduce": gradient_allreduce.GradientAllReduceAlgorithm,
        "bytegrad": bytegrad.ByteGradAlgorithm,
    }[algorithm_name](**kwargs)
    model = model.with_bagua([opt], algorithm)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with torch.no_grad():
            losses.append(float(torch.nn.functional.mse_loss(model(x), y)))  # the full batch's loss
        torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
        opt.step()
    return losses


def bagua_job(comm: Any, trainings: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Every function, then ``with_bagua`` with each algorithm: one job, to start torch once per rank."""
    out = every_function(comm)
    out["curves"] = [train_with_bagua(comm, name, kwargs) for name, kwargs in trainings]
    import collsvc
    import collsvc.compat.bagua as bagua

    # last: a mismatch breaks the job, and the error is collsvc's on every rank
    with pytest.raises(collsvc.CollectiveMismatchError):
        bagua.allreduce_inplace(torch.ones(bagua.get_rank() + 1))
    return out


@pytest.mark.parametrize(
    ("world", "trainings"),
    [
        (2, [("allreduce", {}), ("bytegrad", {})]),
        (4, [("allreduce", {"hierarchical": True}), ("bytegrad", {"hierarchical": False})]),
    ],
)
def test_every_function_and_with_bagua(world: int, trainings: list[tuple[str, dict[str, Any]]]) -> None:
    """Seed 002's functions at ``world`` ranks; with_bagua with both algorithms follows single-process
    full-batch training (GradientAllReduce within 1e-5, ByteGrad within 5% of the loss at every step)."""
    with coordinator() as (_, address):
        result = run_ranks(bagua_job, world, address=address, args=(trainings,), timeout=120)
    check_every_function(world, result.values)
    reference = full_batch_losses()
    for index, (algorithm, _kwargs) in enumerate(trainings):
        rtol = ALLREDUCE_RTOL if algorithm == "allreduce" else BYTEGRAD_RTOL
        check_curves([out["curves"][index] for out in result.values], reference, rtol)


def check_curves(curves: list[list[float]], reference: list[float], rtol: float) -> None:
    assert all(curve == curves[0] for curve in curves), "every rank holds the same model"
    assert curves[0][-1] < 0.5 * curves[0][0], "it trains"
    for step, (got, want) in enumerate(zip(curves[0], reference, strict=True)):
        assert abs(got - want) <= rtol * want, f"step {step}: loss {got} vs full-batch {want} (rtol {rtol})"


def bytegrad_across_hosts(comm: Any) -> list[Any]:
    from collsvc.compat.bagua.algorithms.bytegrad import ByteGradAlgorithm

    grads = [torch.linspace(-1, 1, 5000) * (comm.rank + 1), torch.arange(6, dtype=torch.int64)]
    ByteGradAlgorithm(average=False).reduce(grads, comm)
    return [g.numpy() for g in grads]


def test_bytegrad_compresses_between_hosts_with_bagua_minmax_uint8() -> None:
    """Two fake hosts: the float gradients cross as 8-bit codes (within two half code steps of the exact
    sum, not equal to it, the same on both ranks); integer ones stay exact."""
    with coordinator() as (_, address):
        result = run_ranks(
            bytegrad_across_hosts, 2, address=address, rank_env=lambda r: {"COLLSVC_HOST": f"host{r}"}, timeout=120
        )
    exact = torch.linspace(-1, 1, 5000).numpy() * 3
    floats = [value[0] for value in result.values]
    assert floats[0].tobytes() == floats[1].tobytes()
    assert not (floats[0] == exact).all()
    assert abs(floats[0] - exact).max() <= (2 + 4 + 6) / 510 + 1e-6  # (max - min) / 510: each rank, the sum
    assert all((value[1] == torch.arange(6).numpy() * 2).all() for value in result.values)
