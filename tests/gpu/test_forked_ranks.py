"""Ranks forked by ``collsvc run``'s fork server use the GPU: the server loads numpy, gRPC and collsvc
but never CUDA, so each forked rank initializes CUDA itself. CuPy arrays over the ring with two ranks
sharing the GPU, NCCL at world size 1, and a torch CUDA tensor, each under both start methods. Skipped
without CuPy, NCCL and a CUDA GPU (run: pytest -m gpu tests/gpu)."""

from __future__ import annotations

from pathlib import Path

import pytest

from collsvc.client.devices import cupy_available
from tests.cli._util import run_cli, script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cupy_available(), reason="needs CuPy with NCCL and a CUDA GPU"),
]

CUPY_RANKS = """
import cupy
import collsvc

comm = collsvc.init(backend={backend!r})
cupy.cuda.Device(0).use()
x = cupy.arange(1 << 16, dtype=cupy.float32) * (comm.rank + 1)
total = comm.all_reduce(x)
expected = cupy.arange(1 << 16, dtype=cupy.float32) * sum(range(1, comm.size + 1))
assert bool(cupy.all(total == expected)), "wrong sum"
print("GPU_OK", comm.rank, flush=True)
collsvc.destroy()
"""

TORCH_CUDA_RANK = """
import torch
import torch.distributed as dist
import collsvc.torch

dist.init_process_group("collsvc")
t = torch.ones(1024, device="cuda")
dist.all_reduce(t)
assert int(t.sum()) == 1024 * dist.get_world_size()
print("GPU_OK", dist.get_rank(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("method", ["fork-server", "spawn"])
@pytest.mark.parametrize(("ranks", "backend"), [(2, "ring"), (1, "nccl")])
def test_forked_ranks_use_cupy_on_the_gpu(tmp_path: Path, method: str, ranks: int, backend: str) -> None:
    path = script(tmp_path, "cupy_ranks.py", CUPY_RANKS.format(backend=backend))
    res = run_cli("run", "-n", str(ranks), "--start-method", method, path, timeout=180)
    assert res.returncode == 0, res.stderr
    done = sorted(line.split()[-1] for line in res.lines("stdout") if "GPU_OK" in line)
    assert done == [str(r) for r in range(ranks)]


@pytest.mark.parametrize("method", ["fork-server", "spawn"])
def test_a_forked_torch_rank_uses_cuda(tmp_path: Path, method: str) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    path = script(tmp_path, "torch_rank.py", TORCH_CUDA_RANK)
    res = run_cli("run", "-n", "1", "--start-method", method, path, timeout=180)
    assert res.returncode == 0, res.stderr
    assert "GPU_OK 0" in res.stdout
