"""torch.distributed on collsvc with CUDA tensors, on one real GPU.

- World size 1: NCCL through CuPy (every collective of torch's API, training with DDP and FSDP2).
- World size 2, both ranks on the one GPU: NCCL refuses two ranks on one GPU, so the job runs on the
  ring and CUDA tensors are staged through the host; the same collectives and trainings.
- Ordering on the caller's stream: a collective issued on a side stream runs after the work queued on
  that stream before it (a slow kernel is queued first), synchronously and with ``async_op=True``.

The collective checks are the CPU suite's (``tests/torch/test_collectives.py``) with torch's default
device set to the GPU, so every tensor they make is a CUDA tensor. Skipped without torch with CUDA,
CuPy and NCCL (run: ``pytest -m gpu tests/gpu``).
"""

from __future__ import annotations

from typing import Any

import pytest

from collsvc.client.devices import cupy_available
from tests.torch._util import run_torch

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (cupy_available() and torch.cuda.is_available()), reason="needs torch with CUDA, CuPy with NCCL and a GPU"
    ),
]

ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}


def _on_the_gpu() -> Any:
    import torch

    torch.cuda.set_device(0)
    torch.set_default_device("cuda:0")
    return torch.device("cuda", 0)


def every_collective_on_cuda(rank: int, n: int) -> dict[str, Any]:
    import torch.distributed as dist

    from tests.torch import test_collectives as checks

    _on_the_gpu()
    comm = dist.distributed_c10d._get_default_group().communicator
    if n == 1:  # no peers: what needs another rank (broadcast from rank 1, point to point) is left out
        for check in (checks._reductions, checks._all_to_all, checks._objects_groups_and_work):
            check(rank, n)
    else:
        checks.every_collective(rank, n)
    return {"data_plane": comm.backend}


def _slow_then_fill(x: Any, value: float) -> None:
    import torch

    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the fill on the same stream
    x.fill_(value)


def side_stream_ordering(rank: int, n: int) -> list[str]:
    """Each rank fills its input on a side stream behind a slow kernel, then gathers: a collective not
    ordered on that stream would read the zeros from before the fill."""
    import torch
    import torch.distributed as dist

    device = _on_the_gpu()
    side = torch.cuda.Stream()
    seen = []
    for async_op in (False, True):
        with torch.cuda.stream(side):
            x = torch.zeros(1 << 20, device=device)
            out = torch.zeros(n << 20, device=device)
            _slow_then_fill(x, float(rank + 1))
            work = dist.all_gather_into_tensor(out, x, async_op=async_op)
            if work is not None:
                work.wait()
            gathered = out.view(n, -1)[:, 0].tolist()
            seen.append(f"async={async_op} {gathered}")
            assert gathered == [float(r + 1) for r in range(n)], seen
            # The reduction lands in place before the stream's next kernel reads it.
            y = torch.zeros(1 << 20, device=device)
            _slow_then_fill(y, float(rank + 1))
            work = dist.all_reduce(y, async_op=async_op)
            if work is not None:
                work.wait()
            assert float(y.sum()) == float(sum(range(1, n + 1))) * (1 << 20), y[:4]
        # collsvc's own API with torch tensors: DLPack orders CuPy's stream after torch's side stream.
        comm = dist.distributed_c10d._get_default_group().communicator
        w = torch.zeros(1 << 20, device=device)
        _slow_then_fill(w, float(rank + 1))
        rows = comm.all_gather(w).view(n, -1)[:, 0].tolist()
        assert rows == [float(r + 1) for r in range(n)], rows
        # A future read on torch's completion thread sees the result in place.
        z = torch.zeros(4096, device=device)
        _slow_then_fill(z, 1.0)
        total = dist.all_reduce(z, async_op=True).get_future().then(lambda f: float(f.value()[0].sum())).wait()
        assert total == 4096.0 * n, total
    side.synchronize()
    return seen


def trainings_on_cuda(rank: int, n: int) -> dict[str, Any]:
    """DDP (default, comm hook, bucket view) and FSDP2 on CUDA against one process on the whole batch."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.torch import test_training as training

    torch.cuda.set_device(0)
    batches = [(x.cuda(), y.cuda()) for x, y in training._batches(rank)]
    world = torch.distributed.distributed_c10d._get_default_group()
    out = {}
    for name in ("default", "comm_hook", "bucket_view"):
        options, hook = training.DDP_CONFIGS[name]
        model = torch.nn.parallel.DistributedDataParallel(training._model().cuda(), process_group=world, **options)
        if hook:
            model.register_comm_hook(world, training._allreduce_hook)
        out[f"ddp-{name}"] = training._train(model, batches)
    sharded = fully_shard(training._model().cuda(), mesh=init_device_mesh("cuda", (n,)))
    out["fsdp2"] = training._train(sharded, batches)
    reference = training._reference(rank, n)
    for name, losses in out.items():
        assert losses == pytest.approx(reference, rel=1e-3, abs=1e-5), name
        assert sum(losses[-10:]) < 0.5 * sum(losses[:10]), name
    return {name: (losses[0], losses[-1]) for name, losses in out.items()}


@pytest.mark.parametrize(("world_size", "data_plane"), [(1, "nccl"), (2, "ring")])
def test_every_collective_with_cuda_tensors(world_size: int, data_plane: str) -> None:
    result = run_torch(every_collective_on_cuda, world_size, env=ONE_GPU, timeout=240)
    assert {v["data_plane"] for v in result.values} == {data_plane}, result.values


@pytest.mark.parametrize("world_size", [1, 2])
def test_collectives_keep_the_order_of_the_callers_stream(world_size: int) -> None:
    result = run_torch(side_stream_ordering, world_size, env=ONE_GPU, timeout=240)
    assert all(len(seen) == 2 for seen in result.values), result.values


@pytest.mark.parametrize("world_size", [1, 2])
def test_ddp_and_fsdp2_train_on_cuda(world_size: int) -> None:
    result = run_torch(trainings_on_cuda, world_size, env=ONE_GPU, timeout=300)
    assert set(result.values[0]) == {"ddp-default", "ddp-comm_hook", "ddp-bucket_view", "fsdp2"}


def compiled_ddp_on_cuda(rank: int, n: int) -> list[tuple[float, float]]:
    """``torch.compile(DDP(model))`` with the default compiler (inductor) on CUDA, against the same DDP
    uncompiled; the model has BatchNorm, so DDP broadcasts buffers outside the compiled graph."""
    import torch

    torch.cuda.set_device(0)

    def train(compiled: bool) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        ).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        step = torch.compile(ddp) if compiled else ddp
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        generator = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(30):
            x = torch.randn(8, 16, generator=generator).cuda()
            loss = torch.nn.functional.mse_loss(step(x), x[:, :4])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    return list(zip(train(True), train(False), strict=True))


@pytest.mark.parametrize("world_size", [1, 2])
def test_compiled_ddp_trains_on_cuda(world_size: int) -> None:
    result = run_torch(compiled_ddp_on_cuda, world_size, env=ONE_GPU, timeout=300)
    for pairs in result.values:
        compiled, eager = zip(*pairs, strict=True)
        assert compiled == pytest.approx(eager, rel=1e-3, abs=1e-5)
        assert sum(compiled[-3:]) < sum(compiled[:3])  # it trains


def dead_rank_with_cuda_tensors(rank: int, n: int) -> dict[str, Any]:
    from tests.torch import test_errors

    _on_the_gpu()
    return test_errors.dies_after_first_step(rank, n)


def mismatch_with_cuda_tensors(rank: int, n: int) -> dict[str, Any]:
    from tests.torch import test_errors

    _on_the_gpu()
    return test_errors.mismatched_calls(rank, n)


def test_dead_rank_and_mismatch_name_the_rank_with_cuda_tensors() -> None:
    dead = run_torch(dead_rank_with_cuda_tensors, 3, env=ONE_GPU, allow_failures=True, timeout=180)
    assert dead.outcomes[2].exitcode == 3
    for outcome in dead.outcomes[:2]:
        assert outcome.error is None, outcome.error
        assert outcome.value["ranks"] == [2] and outcome.value["future"] == "RankFailedError", outcome.value
        assert outcome.value["seconds"] < 30.0, outcome.value
    mismatch = run_torch(mismatch_with_cuda_tensors, 2, env=ONE_GPU, timeout=180)
    for value in mismatch.values:
        assert value["type"] == "CollectiveMismatchError" and "SUM" in value["message"], value
