"""Elastic torch DistributedDataParallel on the collsvc backend: one rank dies, DDP carries on.

Run:  collsvc run -n 3 --min-ranks 2 examples/elastic_ddp.py

The model's and the optimizer's state dicts are the elastic state. Each membership builds its own
torch process group on the communicator ``collsvc.elastic.run`` hands it (collsvc is joined already,
so the store torch asks for is not used for a rendezvous) and wraps the model in DDP again. Halfway
rank 2 SIGKILLs itself; the survivors restore the last commit and carry on as ranks 0..1. Each rank's
loss is scaled so that DDP's averaged gradient is the full batch's whatever the number of ranks, so
rank 0 can compare with training in one process without failures.
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

import collsvc
import collsvc.torch  # noqa: F401 - registers the "collsvc" backend

STEPS = 60
BATCH = 12


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(step))
    return x, x.sum(dim=1, keepdim=True)


def new_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 1)


def train_single_process() -> torch.Tensor:
    model = new_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(step)
        loss = ((model(x) - y) ** 2).sum() / BATCH
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.weight.detach().clone()


def main() -> None:
    collsvc.init()
    model = new_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = collsvc.elastic.State(step=0, model=model.state_dict(), optimizer=optimizer.state_dict())
    replacement = bool(os.environ.get("COLLSVC_ELASTIC_JOIN"))

    @collsvc.elastic.run
    def train(comm: collsvc.Communicator, state: collsvc.elastic.State) -> collsvc.Communicator:
        if dist.is_initialized():
            dist.destroy_process_group()  # the previous membership's group
        dist.init_process_group("collsvc", store=dist.HashStore(), rank=comm.rank, world_size=comm.size)
        model.load_state_dict(state.model)
        optimizer.load_state_dict(state.optimizer)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        while state.step < STEPS:
            if state.step == STEPS // 2 and comm.rank == 2 and not replacement:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(state.step)
            rows = slice(comm.rank, None, comm.size)
            loss = ((ddp(x[rows]) - y[rows]) ** 2).sum() * comm.size / BATCH  # DDP averages over ranks
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            if state.step % 5 == 0:
                state.model, state.optimizer = model.state_dict(), optimizer.state_dict()
                state.commit()
        return comm

    comm = train(state)  # a replacement that arrives after the job finished exits 0 in there
    weights = comm.all_gather_object(model.weight.detach().clone())
    if comm.rank == 0:
        same = all(torch.equal(w, weights[0]) for w in weights)
        matches = torch.allclose(weights[0], train_single_process(), rtol=1e-5, atol=1e-6)
        print(f"trained {state.step} steps, {comm.size} ranks at the end")
        print(f"weights identical on all {comm.size} ranks: {same}")
        print(f"weights match training in one process without failures: {matches}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
