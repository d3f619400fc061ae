"""A small torch model trained with DistributedDataParallel on the collsvc backend.

Run:  collsvc run -n 4 examples/torch_ddp.py [--steps 60]
  or: torchrun --nproc-per-node 4 examples/torch_ddp.py

The script is an ordinary DDP script: the only collsvc lines are ``import collsvc.torch`` and the
backend name. Every rank trains on its own batches of one synthetic regression task; DDP averages
the gradients through collsvc. Rank 0 prints the loss (averaged over the ranks), which falls.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import collsvc.torch  # noqa: F401 - registers the "collsvc" backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)  # ranks share the host's cores
    dist.init_process_group("collsvc")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # identical initial weights (DDP also broadcasts rank 0's)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    truth = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own samples

    first = last = 0.0
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=data)
        y = torch.tanh(x @ truth)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP all_reduces the gradients on collsvc, bucket by bucket
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        first = first or mean.item()
        last = mean.item()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {last:.5f}", flush=True)
    if rank == 0:
        print(f"loss fell from {first:.5f} to {last:.5f} on {world} ranks ({dist.get_backend()} backend)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
