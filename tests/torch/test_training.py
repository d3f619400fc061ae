"""DDP, FSDP2 and HSDP on a 2-D DeviceMesh train to the same losses on collsvc as on gloo (or as one
process on the whole batch), step by step over 100 steps of a small model."""

from __future__ import annotations

from typing import Any

import pytest

from tests.torch._util import run_torch

torch = pytest.importorskip("torch")

STEPS = 100
BATCH = 8


def _model(*hidden: int) -> Any:
    """16 inputs, 4 outputs, ReLU between the layers of ``hidden`` widths (default one of 32)."""
    import torch

    torch.manual_seed(0)  # the same initial weights on every rank and for every backend
    widths = [16, *(hidden or (32,)), 4]
    layers: list[Any] = []
    for into, out in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(into, out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _batches(rank: int) -> list[tuple[Any, Any]]:
    import torch

    target = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))  # what the model should learn
    gen = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(BATCH, 16, generator=gen) for _ in range(STEPS)]
    return [(x, x @ target) for x in inputs]


def _train(model: Any, batches: list[tuple[Any, Any]]) -> list[float]:
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _reference(rank: int, n: int) -> list[float]:
    """Rank ``rank``'s losses when one process trains on every rank's batch at once (the averaged
    gradient of equal-sized batches is the gradient of the mean loss)."""
    import torch

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    every = [_batches(r) for r in range(n)]
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        per_rank = [torch.nn.functional.mse_loss(model(x), y) for x, y in (every[r][step] for r in range(n))]
        torch.stack(per_rank).mean().backward()
        optimizer.step()
        losses.append(per_rank[rank].item())
    return losses


def _allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
    """A user comm hook: average the bucket through the hook's process group and a chained future."""
    import torch.distributed as dist

    group = state
    tensor = bucket.buffer().div_(group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _ddp(group: Any, options: dict[str, Any], hook: bool) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model(), process_group=group, **options)
    if hook:
        model.register_comm_hook(group, _allreduce_hook)
    return model


DDP_CONFIGS: dict[str, tuple[dict[str, Any], bool]] = {
    "default": ({}, False),
    "comm_hook": ({}, True),
    "bucket_view": ({"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001}, False),
    "static_graph": ({"static_graph": True}, False),
}


def ddp_and_fsdp(rank: int, n: int, configs: list[str], fsdp: bool, hsdp: bool) -> dict[str, Any]:
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    world = dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {}
    for name in configs:
        options, hook = DDP_CONFIGS[name]
        out[f"ddp-{name}"] = (
            _train(_ddp(world, options, hook), _batches(rank)),
            _train(_ddp(gloo, options, hook), _batches(rank)),
        )
    if fsdp:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import fully_shard

        on_collsvc = fully_shard(_model(), mesh=init_device_mesh("cpu", (n,)))
        on_gloo = fully_shard(_model(), mesh=DeviceMesh.from_group(gloo, "cpu"))
        out["fsdp2"] = (_train(on_collsvc, _batches(rank)), _train(on_gloo, _batches(rank)))
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
        model = _model()
        for layer in model:
            if isinstance(layer, type(model[0])):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        out["hsdp"] = (_train(model, _batches(rank)), _reference(rank, n))
    return out


def _assert_same(values: list[dict[str, Any]]) -> None:
    for losses in values:
        for name, (ours, theirs) in losses.items():
            assert len(ours) == STEPS, name
            assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-6), name
            assert sum(ours[-10:]) < 0.5 * sum(ours[:10]), name  # it trains


def test_ddp_and_fsdp2_match_gloo_two_ranks() -> None:
    result = run_torch(ddp_and_fsdp, 2, args=(list(DDP_CONFIGS), True, False), timeout=240)
    _assert_same(result.values)
    assert set(result.values[0]) == {"ddp-default", "ddp-comm_hook", "ddp-bucket_view", "ddp-static_graph", "fsdp2"}


def test_ddp_and_hsdp_on_a_2d_mesh_four_ranks() -> None:
    result = run_torch(ddp_and_fsdp, 4, args=(["default"], False, True), timeout=240)
    _assert_same(result.values)


def ddp_with_torchs_comm_hooks(rank: int, n: int) -> dict[str, tuple[list[float], list[float]]]:
    """DDP with torch's own comm hooks, on collsvc and on gloo. PowerSGD's hook waits, inside a future's
    callback, for the future of another all_reduce (on a single completion thread that hung)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd

    gloo = dist.new_group(backend="gloo")
    world = dist.distributed_c10d._get_default_group()
    batches = _batches(rank)[:30]

    def train(group: Any, hook: str) -> list[float]:
        model = _ddp(group, {}, hook=False)
        if hook == "powersgd":
            state = power_sgd.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2)
            model.register_comm_hook(state, power_sgd.powerSGD_hook)
        else:
            model.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return _train(model, batches)

    return {hook: (train(world, hook), train(gloo, hook)) for hook in ("powersgd", "fp16_compress")}


def test_ddp_with_torchs_comm_hooks_matches_gloo() -> None:
    result = run_torch(ddp_with_torchs_comm_hooks, 2, timeout=120)
    for losses in result.values:
        for name, (ours, theirs) in losses.items():
            assert len(ours) == 30, name
            assert ours == pytest.approx(theirs, rel=1e-4, abs=1e-6), name


def sparse_embedding_ddp(rank: int, n: int) -> tuple[list[float], list[float]]:
    """DDP of a model with sparse gradients (nn.Embedding(sparse=True)), on collsvc and on gloo."""
    import torch
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    world = dist.distributed_c10d._get_default_group()

    def train(group: Any) -> list[float]:
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Flatten(), torch.nn.Linear(32, 1))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(20):
            words = torch.randint(0, 50, (16, 4), generator=generator)
            target = words.float().mean(dim=1, keepdim=True) / 50.0
            loss = torch.nn.functional.mse_loss(ddp(words), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    return train(world), train(gloo)  # DDP hands the embedding's sparse gradient to allreduce as is


def test_ddp_with_sparse_gradients_matches_gloo() -> None:
    result = run_torch(sparse_embedding_ddp, 2, timeout=240)
    for ours, theirs in result.values:
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
        assert sum(ours[-5:]) < sum(ours[:5])  # it trains


def ddp_across_two_hosts(rank: int, n: int) -> dict[str, Any]:
    """DDP on collsvc and on gloo from the same weights and batches; the model's 70 000 parameters
    (280 KiB of gradients in one bucket) take the hierarchical all_reduce by slices, the comm hook's
    async calls too."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    gloo = dist.new_group(backend="gloo")
    world = dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {}
    for hook in (False, True):
        trained = []
        for group in (world, gloo):
            model = DistributedDataParallel(_model(256, 256), process_group=group, bucket_cap_mb=1)
            if hook:
                model.register_comm_hook(group, _allreduce_hook)
            trained.append(_train(model, _batches(rank)))
        out["comm_hook" if hook else "default"] = tuple(trained)
    return out


def test_ddp_across_two_hosts_of_two_matches_gloo() -> None:
    result = run_torch(ddp_across_two_hosts, 4, rank_env=lambda r: {"COLLSVC_HOST": f"host{r // 2}"}, timeout=240)
    _assert_same(result.values)
