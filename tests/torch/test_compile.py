"""``torch.compile`` of a DDP model trains on collsvc as on gloo: Dynamo runs the backend's Python as it
runs gloo's C++, without tracing into it (``collsvc/dynamo_skip.py``); so does a compiled function that
calls collsvc's own API."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tests.harness import coordinator, run_ranks
from tests.torch._util import run_torch

torch = pytest.importorskip("torch")

STEPS = 12


def compiled_ddp(rank: int, n: int) -> dict[str, list[float]]:
    """Losses of ``torch.compile(DDP(model))`` on collsvc and on gloo. The model has BatchNorm, so DDP
    broadcasts its buffers before every forward: a collective Dynamo does not put in its graph."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    gloo = dist.new_group(backend="gloo")
    world = dist.distributed_c10d._get_default_group()

    def train(group: Any) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
        compiled = torch.compile(DistributedDataParallel(model, process_group=group), backend="aot_eager")
        optimizer = torch.optim.SGD(compiled.parameters(), lr=0.05)
        generator = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(STEPS):
            x = torch.randn(8, 8, generator=generator)
            loss = torch.nn.functional.mse_loss(compiled(x), x.sum(dim=1, keepdim=True))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    return {"collsvc": train(world), "gloo": train(gloo)}


def test_compiled_ddp_trains_as_on_gloo() -> None:
    result = run_torch(compiled_ddp, 2, timeout=240)
    for losses in result.values:
        assert len(losses["collsvc"]) == STEPS
        assert losses["collsvc"] == pytest.approx(losses["gloo"], rel=1e-5, abs=1e-7)
        assert sum(losses["collsvc"][-3:]) < sum(losses["collsvc"][:3])  # it trains


def compiled_comm_all_reduce(comm: Any) -> list[list[float]]:
    """A compiled function that calls collsvc's own ``all_reduce`` on a torch tensor (no torch.distributed)."""
    import torch

    @torch.compile(backend="aot_eager")
    def step(x: Any) -> Any:
        return comm.all_reduce(x * 2) + 1

    return [step(torch.full((3,), float(comm.rank + 1))).tolist(), step(torch.ones(3)).tolist()]


def test_a_compiled_function_calls_collsvcs_own_api() -> None:
    with coordinator() as (_, address):
        result = run_ranks(compiled_comm_all_reduce, 2, address=address, env={"OMP_NUM_THREADS": "1"}, timeout=180)
    assert result.values == [[[7.0] * 3, [5.0] * 3]] * 2  # 2 * (1 + 2) + 1, then 2 * 2 + 1


SKIP_LIST_CHECK = """
import sys
{first}
{second}
import collsvc, collsvc.dynamo_skip, torch._dynamo.trace_rules as rules
directory = collsvc.__file__.rsplit("__init__.py", 1)[0]
print(rules.check_file(collsvc.__file__).skipped, any(type(f).__name__ == "_SkipListFinder" for f in sys.meta_path))
collsvc.dynamo_skip.install()  # again: idempotent
print(sum(entry == directory for entry in rules.SKIP_DIRS))
"""


@pytest.mark.parametrize("dynamo_first", [False, True], ids=["collsvc-first", "dynamo-first"])
def test_collsvc_is_on_dynamos_skip_list_whichever_is_imported_first(dynamo_first: bool) -> None:
    imports = ["import collsvc", "import torch._dynamo"]
    first, second = reversed(imports) if dynamo_first else imports
    out = subprocess.run(
        [sys.executable, "-c", SKIP_LIST_CHECK.format(first=first, second=second)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split()  # fmt: skip
    assert out == ["True", "False", "1"]  # skipped, the finder is gone, and collsvc is on the list once
